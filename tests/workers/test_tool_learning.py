"""The pieces of the tool-use demo (configs/agentic.yaml): the final-answer reward, the warm
start's calculator tapes and their loss mask, and the greedy evaluator's multi-turn loop with the
calculator in process (a scripted engine stands in for the model, so each case is exact)."""

from __future__ import annotations

import pytest
import torch

from workers.engines.base import FINISH_LENGTH, FINISH_STOP, Generation
from workers.models.local import TinyModelSpec, build_tiny_model
from workers.models.tokenizer import build_char_tokenizer, encode_answer
from workers.models.warmstart import BuiltinRecipe, tool_tape, warm_start
from workers.settings import AgentSettings
from workers.tasks.arithmetic import ArithmeticTask
from workers.tasks.evaluate import greedy_accuracy, greedy_completions, reward_scorer
from workers.tasks.problem import Problem
from workers.tasks.verifiers import final_answer

TOK = build_char_tokenizer()
EOS = TOK.eos_token_id
AGENT = AgentSettings(max_turns=2, max_total_tokens=32, max_observation_tokens=16,
                      fn="calculator", format="plain")
PROBLEMS = [Problem("123*456=", "56088"), Problem("7*8=", "56"), Problem("999*999=", "998001")]


def _ids(text: str) -> list[int]:
    return list(TOK(text, add_special_tokens=False)["input_ids"])


def test_final_answer_scores_the_words_after_the_last_tool_answer() -> None:
    assert final_answer("(=12*34=)408 408", "408") == 1.0
    assert final_answer("(=12*34=)408 409", "408") == 0.0
    assert final_answer("(=12*34=)408 ", "408") == 0.0  # the tool's answer is not the model's
    assert final_answer("(=12*34=)408", "408") == 0.0  # cut before the observation ended
    assert final_answer(" 408 ", "408") == 1.0  # no call: the whole completion
    assert final_answer("(=12*34=)408 (=408+5=)413 413", "413") == 1.0
    assert final_answer("<tool_call>{}</tool_call><tool_response>\n9\n</tool_response>9", "9") == 1.0


def test_a_tool_tape_masks_exactly_the_observation() -> None:
    response, mask = tool_tape(TOK, Problem("123*456=", "56088"))
    assert TOK.decode(response, skip_special_tokens=True) == "(=123*456=)56088 56088"
    assert response[-1] == EOS and len(mask) == len(response)
    call, seen = _ids("(=123*456=)"), _ids("56088 ")
    assert mask == [1] * len(call) + [0] * len(seen) + [1] * len(encode_answer(TOK, "56088"))
    with pytest.raises(ValueError, match="calculator answers"):
        tool_tape(TOK, Problem("2*3=", "7"))  # a tape always holds the calculator's own answer


def test_warm_start_draws_tapes_at_its_fraction_and_trains_on_their_masks() -> None:
    task = ArithmeticTask(digits=3, operations=("*",), seed=0)
    model = build_tiny_model(TinyModelSpec(hidden_size=16, num_layers=1, num_heads=2,
                                           num_kv_heads=1, intermediate_size=32), TOK)
    seen: list[list[int]] = []
    original = torch.nn.Module.__call__

    def spy(self, *args, **kwargs):  # noqa: ANN001, ANN202 - every batch the model reads
        if self is model:
            seen.extend(kwargs.get("input_ids", args[0] if args else None).tolist())
        return original(self, *args, **kwargs)

    torch.nn.Module.__call__ = spy
    try:
        warm_start(model, TOK, task, steps=4, batch_size=50, lr=1e-3, seed=0, tool_fraction=0.3)
    finally:
        torch.nn.Module.__call__ = original
    tapes = sum(TOK.decode(row, skip_special_tokens=True).count("=)") == 1 for row in seen)
    assert len(seen) == 200 and 40 <= tapes <= 80, tapes  # 0.3 of 200 draws


def test_a_recipe_without_tapes_keeps_its_cache_key() -> None:
    spec = TinyModelSpec(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                         intermediate_size=32)
    kw = dict(spec=spec, digits=2, operations=("+",), task_seed=0, warmstart_steps=3,
              batch_size=2, lr=1e-3, seed=0, eval_size=2, target_accuracy=0.0)
    assert "tool_fraction" not in BuiltinRecipe(**kw, tool_fraction=0.0).to_json()
    assert BuiltinRecipe(**kw, tool_fraction=0.2).to_json()["tool_fraction"] == 0.2


class CopyingEngine:
    """Calls the calculator on its prompt in turn 0 (and babbles past the marker, which the turn
    cut drops), then answers with the observation (``copy``) or with a wrong number."""

    def __init__(self, copy: bool = True) -> None:
        self.copy = copy
        self.contexts: list[str] = []

    def generate(self, prompts, n, params):  # noqa: ANN001, ANN201
        out = []
        for context in prompts:
            text = TOK.decode(context, skip_special_tokens=True)
            self.contexts.append(text)
            if "=)" not in text:
                tokens = _ids(f"(={text.rstrip('=')}=)") + _ids("1111")
            else:
                seen = text.rpartition("=)")[2].strip()
                tokens = _ids(seen if self.copy else "1") + [EOS]
            keep = min(len(tokens), params.max_new_tokens)
            finish = FINISH_STOP if tokens[keep - 1] == EOS else FINISH_LENGTH
            out.append([Generation(tokens[:keep], [0.0] * keep, finish)] * n)
        return out


def test_the_multi_turn_evaluator_runs_the_calculator_and_scores_the_final_answer() -> None:
    engine = CopyingEngine()
    texts = greedy_completions(engine, TOK, PROBLEMS, max_new_tokens=12, agent=AGENT)
    assert texts == ["(=123*456=)56088 56088", "(=7*8=)56 56", "(=999*999=)998001 998001"]
    assert engine.contexts[3] == "123*456=(=123*456=)56088 "  # turn 1 reads the observation
    score = reward_scorer("final_answer", success_threshold=1.0, timeout_s=2.0)
    assert greedy_accuracy(engine, TOK, PROBLEMS, max_new_tokens=12, agent=AGENT,
                           score=score) == 1.0
    assert greedy_accuracy(CopyingEngine(copy=False), TOK, PROBLEMS, max_new_tokens=12,
                           agent=AGENT, score=score) == 0.0


def test_single_turn_evaluation_is_one_generation() -> None:
    engine = CopyingEngine()
    one_turn = AgentSettings(max_turns=1, fn="calculator", format="plain")
    for agent in (None, one_turn):
        assert greedy_completions(engine, TOK, PROBLEMS[:1], max_new_tokens=12,
                                  agent=agent) == ["(=123*456=)1"]  # cut at 12 tokens, no tool


def test_the_saved_character_tokenizer_loads_back_with_its_spaces(tmp_path) -> None:
    # (loaded through AutoTokenizer it became a Qwen2 tokenizer that dropped every space, so an
    # observation "56088 " read "56088" and the final answer ran into it)
    from workers.models.local import load_tokenizer, save_model

    model = build_tiny_model(TinyModelSpec(hidden_size=16, num_layers=1, num_heads=2,
                                           num_kv_heads=1, intermediate_size=32), TOK)
    loaded = load_tokenizer(save_model(model, TOK, tmp_path / "m"))
    text = "12*34=(=12*34=)408 408"
    assert loaded(text)["input_ids"] == TOK(text)["input_ids"]
    assert loaded.decode(TOK(text, add_special_tokens=False)["input_ids"]) == text
