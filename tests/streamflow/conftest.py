"""Shared fixtures for engine tests: the tiny config, with its built-in model cached per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamflow.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache root per test session: the warm-started tiny model is built once."""
    return tmp_path_factory.mktemp("runs")


@pytest.fixture
def tiny_config(model_cache: Path, tmp_path: Path):
    def make(*overrides: str) -> RunConfig:
        out = model_cache / tmp_path.name
        return load_config(
            ROOT / "configs" / "tiny.yaml",
            [f"run.output_dir={out}", "run.progress=false", *overrides],
        )

    return make
