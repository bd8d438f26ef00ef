"""The embedded character-level tokenizer, saved and loaded as a normal HF tokenizer, and the
helpers that encode prompts/answers the same way everywhere. Ids: docs/engines.md, "The embedded
character tokenizer".
"""

from __future__ import annotations

from collections.abc import Sequence

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


def decode_response(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> str:
    """Completion text with special tokens (eos, pad) dropped."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)
