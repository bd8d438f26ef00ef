"""Tiny model + char tokenizer: deterministic build, HF save/load round trip, sizes."""

from __future__ import annotations

import json

import pytest
import torch

from workers.models.local import (
    TinyModelSpec,
    build_tiny_model,
    load_model,
    load_tokenizer,
    save_model,
)
from workers.models.tokenizer import (
    build_char_tokenizer,
    decode_response,
    encode_answer,
    encode_prompt,
)

torch.set_num_threads(1)
SMALL = TinyModelSpec(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
)


def test_char_tokenizer_round_trip_and_special_ids():
    tok = build_char_tokenizer()
    ids = encode_prompt(tok, "12+34=")
    assert ids[0] == tok.bos_token_id == 1
    assert len(ids) == 7
    assert decode_response(tok, ids) == "12+34="
    ans = encode_answer(tok, "46")
    assert ans[-1] == tok.eos_token_id == 2 and len(ans) == 3
    assert tok.pad_token_id == 0


def test_char_tokenizer_rejects_duplicate_alphabet():
    with pytest.raises(ValueError, match="duplicate"):
        build_char_tokenizer("0012")


def test_spec_validation_names_the_field():
    with pytest.raises(ValueError, match="num_heads"):
        TinyModelSpec(hidden_size=30, num_heads=4)


def test_build_is_deterministic_from_seed_and_keeps_global_rng():
    tok = build_char_tokenizer()
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_tiny_model(SMALL, tok)
    after = torch.rand(1)
    assert torch.equal(before, after)  # building did not consume the caller's RNG
    b = build_tiny_model(SMALL, tok)
    c = build_tiny_model(TinyModelSpec(**{**SMALL.__dict__, "seed": 1}), tok)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert type(a).__name__ == "Qwen2ForCausalLM"
    assert a.config.vocab_size == len(tok)


def test_save_load_round_trip_is_an_hf_directory(tmp_path):
    tok = build_char_tokenizer()
    model = build_tiny_model(SMALL, tok)
    path = save_model(model, tok, tmp_path / "m")
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen2"
    loaded = load_model(path, dtype=torch.float32, attn_implementation="eager")
    assert not loaded.training
    ids = torch.tensor([encode_prompt(tok, "12+34=")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    tok2 = load_tokenizer(path)
    assert encode_prompt(tok2, "99+1=") == encode_prompt(tok, "99+1=")
    # Saving again over an existing directory replaces it atomically (no leftovers).
    save_model(model, tok, path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_load_model_missing_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "nope", dtype=torch.float32, attn_implementation="eager")


def state_dict_bytes(model: torch.nn.Module) -> int:
    """Bytes of the unique tensors in the state dict (tied weights counted once)."""
    unique = {t.untyped_storage().data_ptr(): t for t in model.state_dict().values()}
    return sum(t.numel() * t.element_size() for t in unique.values())


def test_state_dict_bytes_counts_tied_weights_once():
    tok = build_char_tokenizer()
    model = build_tiny_model(SMALL, tok)
    n_params = sum(p.numel() for p in model.parameters())
    assert state_dict_bytes(model) == 4 * n_params
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
