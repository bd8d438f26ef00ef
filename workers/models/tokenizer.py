"""The embedded character-level tokenizer, saved and loaded as a normal HF tokenizer, and the
helpers that encode prompts/answers the same way everywhere. Ids: docs/engines.md, "The embedded
character tokenizer".
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
# Digits, the arithmetic operators, '=' and a space: enough for the embedded task and for simple
# user prompts over the same alphabet. Order matters (it fixes the ids).
DEFAULT_ALPHABET = "0123456789+-*=() "


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET) -> PreTrainedTokenizerFast:
    """A character-level HF fast tokenizer over ``alphabet`` (duplicates are rejected)."""
    if not alphabet:
        raise ValueError("alphabet must not be empty")
    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet has duplicate characters: {alphabet!r}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own word; the special tokens are matched before this split runs.
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS,
                                   eos_token=EOS, unk_token=UNK, padding_side="left")


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Prompt token ids as a rollout engine sees them (with the tokenizer's own special tokens)."""
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def encode_answer(tokenizer: PreTrainedTokenizerBase, answer: str) -> list[int]:
    """Target ids for supervised training: the answer's tokens followed by ``eos``."""
    ids = list(tokenizer(answer, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has no eos token; cannot mark the end of an answer")
    return ids + [int(tokenizer.eos_token_id)]


# tokenizer -> the same tokenizer with no added tokens (see encode_text); built once per tokenizer
_TEXT_ONLY: weakref.WeakKeyDictionary[Any, Tokenizer] = weakref.WeakKeyDictionary()


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Ids of text that came from outside the model (a tool's output, a user's message) as
    ordinary text: a string that spells a control token (``<|im_end|>``, ``<eos>``, or a
    non-special added token such as ``</tool_response>``) is encoded as the characters it is made
    of, never as that token, so such text cannot forge a chat turn or end one. Text that spells
    no added token gets exactly the ids ``tokenizer(text, add_special_tokens=False)`` gives.

    The fast tokenizer's own pipeline (normaliser, pre-tokeniser, model) with its added-token
    table emptied does this for every added token; ``split_special_tokens`` alone would still
    match the added tokens that are not marked special."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer: its special tokens at least are split
        return [int(i) for i in tokenizer(text, add_special_tokens=False,
                                          split_special_tokens=True)["input_ids"]]
    plain = _TEXT_ONLY.get(tokenizer)
    if plain is None:
        spec = json.loads(backend.to_str())
        spec.update(added_tokens=[], truncation=None, padding=None)
        plain = _TEXT_ONLY[tokenizer] = Tokenizer.from_str(json.dumps(spec))
    return list(plain.encode(text, add_special_tokens=False).ids)


def decode_response(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> str:
    """Completion text with special tokens (eos, pad) dropped."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)
