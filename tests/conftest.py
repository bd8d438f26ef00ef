"""Session-wide test rules: ``@pytest.mark.gpu`` tests run whenever torch sees a CUDA device and
are skipped, with the reason printed (``-ra``), when it does not."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch  # only when a gpu test was collected: a plain session stays light

    if torch.cuda.is_available():
        return
    reason = (f"no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda}, "
              "torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason=reason))
