"""Models: build the embedded tiny Qwen2, save (atomically) and load any local HF causal-LM
directory (local files only, never a download). See docs/engines.md, "Models".
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from workers.models.spec import TinyModelSpec

if TYPE_CHECKING:  # annotations only: the modeling stack takes seconds to import
    from transformers import PreTrainedModel

# the attention the built-in model is built (and warm-started) with; a loaded model gets its
# role's (load_model)
BUILD_ATTN = "eager"


def _quiet_transformers() -> None:
    hf_logging.disable_progress_bar()  # transformers' tqdm bars are noise in the workers' logs


def build_tiny_model(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A freshly initialised ``Qwen2ForCausalLM`` sized by ``spec``; same seed -> same weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM  # (the modeling stack: seconds)

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, use_cache=True, attn_implementation=BUILD_ATTN)
    # Initialisation draws from torch's global RNG: fork it so building a model neither depends
    # on nor disturbs the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.float().eval()


def load_model(path: str | os.PathLike[str], *, dtype: torch.dtype,
               attn_implementation: str) -> PreTrainedModel:
    """Load any local HF causal-LM directory in eval mode (never downloads), in ``dtype``
    with ``attn_implementation`` (the caller's role's: rollout.*, trainer.*, reference.dtype)."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(p)!r} has no config.json")
    from transformers import AutoModelForCausalLM  # (the modeling stack: seconds)

    _quiet_transformers()
    return AutoModelForCausalLM.from_pretrained(
        str(p), local_files_only=True, dtype=dtype, attn_implementation=attn_implementation).eval()


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved beside a model (local files only)."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"tokenizer directory {str(p)!r} does not exist")
    if _generic_tokenizer(p):
        # AutoTokenizer would read the model's config (qwen2) and make a Qwen2 tokenizer whose own
        # pre-tokenizer replaces the saved one and drops spaces ("56088 " -> "56088"): the
        # built-in character tokenizer loads as the generic class it was saved as
        return PreTrainedTokenizerFast.from_pretrained(str(p), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p), local_files_only=True)


def _generic_tokenizer(path: Path) -> bool:
    """Whether the directory's tokenizer was saved as the generic fast tokenizer (the built-in
    character tokenizer), not a model family's own class."""
    try:
        saved = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return False
    return saved in ("TokenizersBackend", "PreTrainedTokenizerFast")


def save_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | os.PathLike[str]
) -> Path:
    """Write config + safetensors + tokenizer files to ``path`` atomically (replacing a directory
    there); returns the path."""
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _quiet_transformers()
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
