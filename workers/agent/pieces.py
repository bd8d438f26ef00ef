"""Trajectories as ordered pieces: the one model of a row's response (no store, no model).

A row's response is an ordered list of pieces (docs/training.md "Trajectories"):

* a **model piece**: the tokens one generate call added, their behaviour log-probs, the policy
  version that generated them, the seed of its turn's random stream, and how it ended: "stop",
  "length" (the turn's ``max_new_tokens``), "tool" (a tool-call end marker), "budget" (the
  trajectory's ``max_total_tokens``) or "cut" (a newer policy version cut the call: the next piece
  continues the same turn);
* an **observation piece**: tokens the environment, a tool or the agent appended (context for the
  later tokens, never trained on: loss mask 0, log-prob 0.0), with its error kind, if any.

A model *turn* is a run of model pieces, each but the last ended "cut". "Next turn", "resume after
a cut" and "next gateway call" are one operation: continue the row with a piece. ``Rules`` says
how a generation closes into a piece (``close``) and what follows it (``then``); ``assemble`` turns
the pieces into the response columns the trainer reads. The row side (columns, reader, writer):
``workers.agent.piece_rows``.

Invariants:

* versions never decrease along the pieces (a continuation runs with at least the previous
  piece's version), so ``policy_version`` (the first piece's) is the OLDEST token's;
* a piece continuing a cut draws on from its turn's stream: the cut piece's seed, with the turn's
  tokens so far as used draws, so under unchanged weights it draws what the uncut call would have;
* at most ``Rules.max_cuts`` pieces of a trajectory end "cut" (a call that cuts a row past its
  bound is continued at once, uncut, by the stage that made it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from workers.engines.base import FINISH_CUT, FINISH_LENGTH, FINISH_STOP, Generation, SamplingParams

END_TOOL = "tool"  # the piece ended in a tool call (its end marker is its last token)
END_BUDGET = "budget"  # max_total_tokens cut the piece, or left no room for the observation
END_OBSERVATION = "observation"  # an observation piece the model goes on from
FINISH_DONE = "done"  # the environment ended the trajectory (Observation.done)
# who continues a row after a piece (else the piece ended the trajectory: a finish reason)
TO_MODEL = "model"
TO_ENV = "env"


@dataclass(frozen=True)
class Piece:
    """One piece of a response: a model piece has a ``version``, an observation none."""

    ids: tuple[int, ...]  # [L_k]
    end: str  # stop | length | tool | budget | cut (model); observation, done, budget (observation)
    logprobs: tuple[float, ...] = ()  # [L_k] behaviour log-probs (model pieces only)
    version: int | None = None  # policy version that generated it (model pieces only)
    seed: int | None = None  # the seed of its turn's random stream (model pieces only)
    error: str | None = None  # the observation's error kind (workers.agent.environments)

    @property
    def model(self) -> bool:
        return self.version is not None


def model_piece(ids: Sequence[int], logprobs: Sequence[float], version: int, end: str,
                seed: int | None = None) -> Piece:
    return Piece(tuple(int(i) for i in ids), end, tuple(float(x) for x in logprobs),
                 int(version), None if seed is None else int(seed))


def observation(ids: Sequence[int], error: str | None = None,
                end: str = END_OBSERVATION) -> Piece:
    return Piece(tuple(int(i) for i in ids), end, error=error)


@dataclass(frozen=True)
class Turn:
    """A model turn: its model pieces joined."""

    ids: list[int]
    end: str  # the last piece's


@dataclass(frozen=True)
class History:
    """A trajectory so far: its pieces in order."""

    pieces: tuple[Piece, ...] = ()

    def then(self, piece: Piece) -> History:
        return History((*self.pieces, piece))

    def length(self) -> int:
        """Response tokens so far (what ``max_total_tokens`` bounds)."""
        return sum(len(p.ids) for p in self.pieces)

    @property
    def turn(self) -> int:
        """The model turn the next model piece belongs to (0-based): observations so far."""
        return sum(1 for p in self.pieces if not p.model)

    @property
    def cuts(self) -> int:
        return sum(1 for p in self.pieces if p.end == FINISH_CUT)

    def open_turn(self) -> list[int]:
        """The tokens of the turn a cut left open (its pieces so far); [] when the last piece
        is not a cut."""
        out: list[int] = []
        for p in reversed(self.pieces):
            if not (p.model and p.end == FINISH_CUT):
                break
            out = list(p.ids) + out
        return out

    def turns(self) -> list[Turn]:
        """The model turns (a cut piece joined with the pieces that continue it)."""
        out: list[Turn] = []
        joining = False
        for p in self.pieces:
            if not p.model:
                joining = False
                continue
            if joining:
                out[-1] = Turn(out[-1].ids + list(p.ids), p.end)
            else:
                out.append(Turn(list(p.ids), p.end))
            joining = p.end == FINISH_CUT
        return out

    def observations(self) -> list[Piece]:
        return [p for p in self.pieces if not p.model]

    def last_version(self) -> int:
        """The newest model piece's version; -1 before any."""
        return max((p.version for p in self.pieces if p.version is not None), default=-1)


def context_ids(prompt: Sequence[int], hist: History) -> list[int]:
    """prompt + every piece: what the next piece is generated from."""
    out = list(prompt)
    for p in hist.pieces:
        out += p.ids
    return out


def marker_end(ids: Sequence[int], marker: Sequence[int], start: int = 0) -> int | None:
    """The index just past the first occurrence of ``marker`` in ``ids`` at or after ``start``;
    None without one."""
    m = len(marker)
    if m == 0:
        return None
    for i in range(max(start, 0), len(ids) - m + 1):
        if list(ids[i:i + m]) == list(marker):
            return i + m
    return None


@dataclass(frozen=True)
class Rules:
    """How long a trajectory may grow, and the one code path of "close a generation into a
    piece, decide what follows it" that every rollout task, the evaluator and the gateway's
    turns share. Single-turn: ``max_turns`` 1, no marker, ``max_total_tokens`` =
    ``max_new_tokens``."""

    max_turns: int  # T: model turns 0..T-1; turn T-1 ends the trajectory
    max_new_tokens: int  # per model turn (its pieces together)
    max_total_tokens: int  # response tokens of a trajectory (model and observation pieces)
    marker: tuple[int, ...] = ()  # the tool-call end marker's ids (() : no tools)
    max_cuts: int = 0  # most "cut" pieces of a trajectory (0: never cut)
    # a gateway run: every turn goes to the agent, which alone ends a trajectory
    agent_driven: bool = False

    def room(self, hist: History) -> tuple[int, bool]:
        """(tokens the next model piece may take, whether the trajectory's budget rather than
        the turn's ``max_new_tokens`` set it). At least 1: a row is continued only while the
        budget has room (the environment ends a trajectory its observation would fill)."""
        turn_left = self.max_new_tokens - len(hist.open_turn())
        total_left = self.max_total_tokens - hist.length()
        return max(min(turn_left, total_left), 1), total_left < turn_left

    def may_cut(self, hist: History) -> bool:
        """Whether the piece after ``hist`` may end "cut"."""
        return hist.cuts < self.max_cuts

    def params(self, base: SamplingParams, hists: Sequence[History]) -> SamplingParams:
        """``base`` for the next pieces of ``hists``: as many new tokens as the roomiest row may
        take (each row is cut to its own room after, ``close``), and a one-token marker as a
        stop token (a longer one cannot stop the engine: the piece is cut after it)."""
        limit = max(self.room(h)[0] for h in hists)
        stops = base.stop_token_ids + (self.marker if len(self.marker) == 1 else ())
        return dataclasses.replace(base, max_new_tokens=limit, stop_token_ids=stops)

    def close(self, gen: Generation, hist: History, *, version: int,
              seed: int | None) -> Piece:
        """The model piece ``gen`` makes after ``hist``. Tokens past the room never happened;
        the piece ends just after the turn's first tool-call end marker (which may begin in a
        cut piece before it; tokens an engine generated past a multi-token marker are dropped
        with their log-probs)."""
        limit, budget_bound = self.room(hist)
        ids, logprobs = list(gen.token_ids[:limit]), list(gen.logprobs[:limit])
        prior = hist.open_turn()
        end = marker_end(prior + ids, self.marker, len(prior) - len(self.marker) + 1)
        if end is not None:
            n = end - len(prior)
            return model_piece(ids[:n], logprobs[:n], version, END_TOOL, seed)
        if gen.finish_reason == FINISH_STOP and len(gen.token_ids) <= limit:
            finish = FINISH_STOP
        elif gen.finish_reason == FINISH_CUT and len(gen.token_ids) < limit:
            finish = FINISH_CUT
        else:
            finish = END_BUDGET if budget_bound else FINISH_LENGTH
        return model_piece(ids, logprobs, version, finish, seed)

    def then(self, piece: Piece, hist: History) -> str:
        """What follows model piece ``piece`` (after ``hist``): ``TO_MODEL`` (a cut: the same
        turn goes on), ``TO_ENV`` (a tool call to answer; in a gateway run, every turn), or the
        trajectory's finish_reason (the piece ended it; "tool" when the last allowed turn still
        called one)."""
        if piece.end == FINISH_CUT:
            return TO_MODEL
        if self.agent_driven:
            return TO_ENV
        if piece.end != END_TOOL:
            return piece.end
        return END_TOOL if hist.turn >= self.max_turns - 1 else TO_ENV


def version_runs(hist: History) -> list[tuple[int, int]]:
    """(start token, version) per run of equal versions over the response: adjacent pieces of
    one version merge, an empty piece adds nothing, and an observation's tokens belong to the
    run before them (they are not sampled)."""
    runs: list[tuple[int, int]] = []
    start = 0
    for p in hist.pieces:
        if p.version is not None and p.ids and (not runs or runs[-1][1] != p.version):
            runs.append((start, p.version))
        start += len(p.ids)
    return runs or [(0, hist.last_version())]


@dataclass(frozen=True)
class Assembled:
    """The response columns of an ended trajectory (what the trainer reads)."""

    response_ids: list[int]  # [L] every piece, in order
    response_logprobs: list[float]  # [L] 0.0 at observation tokens
    response_loss_mask: list[int] | None  # [L] 1 model, 0 observation; None: all model tokens
    policy_version: int  # the first piece's, the oldest
    finish_reason: str
    runs: list[tuple[int, int]]  # ``version_runs``


def assemble(hist: History, finish_reason: str) -> Assembled:
    ids: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    for p in hist.pieces:
        ids += p.ids
        logprobs += p.logprobs if p.model else [0.0] * len(p.ids)
        mask += [1 if p.model else 0] * len(p.ids)
    first = next((p.version for p in hist.pieces if p.version is not None), -1)
    return Assembled(ids, logprobs, mask if 0 in mask else None, first, finish_reason,
                     version_runs(hist))
