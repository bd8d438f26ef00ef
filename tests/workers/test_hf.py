"""GGUF -> HF conversion (workers.models.gguf) on a tiny GGUF written here with the ``gguf`` library.

The real SmolLM2 conversion takes ~50 s on 2 cores (too slow for CI); its code path is the same
``convert_gguf`` exercised here: a Llama GGUF with a byte-level BPE tokenizer and a chat template.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from workers.models.gguf import ConversionError, convert_gguf, smollm2_gguf_path
from workers.models.local import load_model, load_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_gguf(
    path: Path,
    *,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 64,
    seed: int = 0,
) -> int:
    """A float32 Llama GGUF with a tiny byte-level BPE vocabulary; returns the vocab size."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"]  # byte-level space and newline
    tokens = specials + chars + ["Ġt", "he", "Ġthe"]
    types = [gguf.TokenType.CONTROL] * len(specials)
    types += [gguf.TokenType.NORMAL] * (len(tokens) - len(specials))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(seed)
    head_dim = hidden // heads

    def tensor(name: str, *shape: int) -> None:
        if len(shape) == 1:  # norms: around 1
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        else:
            w.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))

    tensor("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden)
        tensor(f"blk.{i}.attn_q.weight", hidden, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, hidden)
        tensor(f"blk.{i}.ffn_norm.weight", hidden)
        tensor(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ffn)
    tensor("output_norm.weight", hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return len(tokens)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    vocab = write_tiny_gguf(root / "tiny.gguf")
    report = convert_gguf(root / "tiny.gguf", root / "hf")
    return root, vocab, report


def test_converted_dir_loads_and_matches_the_gguf_model(converted):
    torch.set_num_threads(1)
    root, vocab, report = converted
    assert report.out_dir == root / "hf"
    assert (root / "hf" / "model.safetensors").is_file()
    assert not any(p.name.endswith(".gguf") for p in (root / "hf").iterdir())
    model = load_model(root / "hf", dtype=torch.float32, attn_implementation="eager")
    assert model.config.vocab_size == vocab
    assert not hasattr(model.config, "quantization_config")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert report.num_parameters == sum(p.numel() for p in model.parameters())
    reference = AutoModelForCausalLM.from_pretrained(
        str(root), gguf_file="tiny.gguf", dtype=torch.float32, local_files_only=True
    ).eval()
    ids = torch.tensor([[5, 9, 40, 77, 3, 100]])
    with torch.no_grad():
        diff = (reference(ids).logits - model(ids).logits).abs().max().item()
    assert diff < 1e-5


def test_converted_tokenizer_keeps_special_tokens_and_chat_template(converted):
    root, _, _ = converted
    tok = load_tokenizer(root / "hf")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    text = tok.apply_chat_template(
        [{"role": "user", "content": "the 3+4"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nthe 3+4<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and 2 in ids  # special tokens are single tokens, not spelled out


def test_missing_gguf_is_a_clear_error(tmp_path):
    with pytest.raises(ConversionError, match="does not exist"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_smollm2_gguf_is_found_without_importing_the_package():
    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    assert gguf.GGUFReader(str(path)).fields["general.architecture"] is not None
