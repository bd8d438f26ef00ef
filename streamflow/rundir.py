"""The run directory: what a run leaves behind, and the records written into it.

Layout and invariants (atomic ``summary.json``, flushed complete ``.jsonl`` lines, unknown keys
ignored on read): docs/controller.md "The run directory".
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from streamflow.config import RunConfig, dump_yaml

# Stage names follow the worker roles; spans with other names are drawn grey.
STAGES = ("rollout", "reward", "reference", "trainer", "weight_sync", "eval")
STAGE_COLORS = dict(zip(STAGES, ("#4C72B0", "#55A868", "#8172B2", "#C44E52", "#DD8452", "#937860"),
                        strict=True))


@dataclass
class IterationRecord:
    """What one RL iteration did: one line of metrics.jsonl (None = not measured this iteration)."""

    iteration: int  # 0-based iteration index
    policy_version: int  # trainer's policy version after this iteration's update
    reward_mean: float  # mean reward over the iteration's trained samples
    reward_std: float = 0.0  # std of those rewards
    accuracy: float | None = None  # held-out eval accuracy (None when not evaluated this iteration)
    # 1 while held-out accuracy falls as the reward rises (streamflow.hacking's rule), else 0
    reward_hacking: int = 0
    samples: int = 0  # responses trained on this iteration
    generated_tokens: int = 0  # response tokens generated for them
    loss: float | None = None  # GRPO loss of the update
    kl: float | None = None  # mean k3 KL to the reference (None when the reference is off)
    # loss, kl, clip fractions, grad_norm and the ratio/importance stats are the step's FIRST
    # pass (token-weighted); each pass of trainer.updates_per_batch > 1: ``passes``
    clip_fraction: float | None = None  # fraction of tokens (gspo: responses) clipped
    grad_norm: float | None = None  # gradient norm before clipping
    ratio_mean: float | None = None  # policy / old-policy ratio (exactly 1 with one update/batch)
    ratio_min: float | None = None  # smallest ratio of any token
    ratio_max: float | None = None  # largest ratio of any token
    # the off-policy weight (trainer.importance_correction); 1 when the correction is off
    importance_weight_mean: float | None = None
    clip_low_fraction: float = 0.0  # clipped at 1 - clip_eps_low (share of clip_fraction)
    clip_high_fraction: float = 0.0  # clipped at 1 + clip_eps_high
    sequence_ratio_mean: float = 1.0  # exp(mean token log-ratio) per response (gspo's ratio)
    importance_capped_fraction: float = 0.0  # tokens whose weight is_cap truncated or dropped
    passes: list[dict[str, float]] = field(default_factory=list)  # per pass, when several
    staleness_mean: float = 0.0  # mean (trainer version - behaviour version) of trained samples
    staleness_max: int = 0  # max of the same
    weight_sync_seconds: float = 0.0  # time spent publishing/loading weights this iteration
    weight_sync_bytes: int = 0  # bytes of weights moved this iteration
    reward_failures: int = 0  # samples whose verifier raised or timed out (scored as failed)
    # mean model turns, and tool calls answered with an observation, per trained trajectory
    # (rollout.max_turns > 1; single-turn: 1 and 0)
    turns_mean: float = 1.0
    tool_calls_mean: float = 0.0
    # partial rollout (docs/partial.md): trained trajectories whose tokens span more than one
    # policy version, mean tokens per run of one version, and token-weighted staleness (step -
    # the version that sampled each token; staleness_mean counts each row by its oldest token)
    partial_resumes: int = 0
    tokens_per_version_span: float = 0.0
    staleness_token_mean: float = 0.0
    # dynamic sampling (docs/training.md "Dynamic sampling"): zero-variance groups acked
    # untrained, groups with variance past the step's need acked untrained, the zero-variance
    # fraction of the groups that reached the trainer (measured with it off too), the
    # over-provisioning factor of the iteration's first put and the prompts put for it in all
    filtered_groups: int = 0
    surplus_groups: int = 0
    zero_variance_rate: float = 0.0
    oversample_factor: float = 1.0
    prompts_put: int = 0
    wall_seconds: float = 0.0  # wall time of the iteration
    stage_busy_seconds: dict[str, float] = field(default_factory=dict)  # stage -> busy seconds
    queue_depths: dict[str, int] = field(default_factory=dict)  # task -> rows waiting at the end
    timestamp: float = 0.0  # unix time at the end of the iteration


@dataclass
class StageSpan:
    """One busy interval of one worker (a lane of the timeline): [start, end) in unix seconds."""

    stage: str  # one of STAGES (others are drawn grey)
    worker: str  # e.g. "rollout-0"; one Gantt lane per worker
    start: float  # unix seconds
    end: float  # unix seconds, >= start
    iteration: int  # iteration the work belongs to (-1: rows of several iterations)
    rows: int = 0  # rows processed in the span
    tokens: int = 0  # tokens generated / processed in the span


@dataclass
class RunSummary:
    """The run in one object: summary.json. Rates are over the run's wall time."""

    mode: str  # sync | periodic | async
    iterations: int  # iterations completed
    samples: int  # responses trained on
    generated_tokens: int  # response tokens generated for them
    wall_seconds: float  # wall time of the RL loop
    samples_per_second: float
    tokens_per_second: float
    reward_mean_first: float | None  # reward of the first iteration (noisy: see the windows)
    reward_mean_last: float | None  # reward of the last iteration (noisy: see the windows)
    accuracy_first: float | None  # first held-out accuracy measured during RL (after a step)
    accuracy_last: float | None  # last held-out accuracy measured
    max_staleness_observed: int  # max policy-version lag of any trained sample
    # The store's counts (streaming modes): redelivered, quarantined, still leased at the end.
    redelivered_rows: int = 0
    redelivered_by_task: dict[str, int] = field(default_factory=dict)  # task -> rows, if any
    dead_rows: int = 0
    in_flight_rows: int = 0
    dead_reasons: dict[str, int] = field(default_factory=dict)
    worker_restarts: dict[str, int] = field(default_factory=dict)  # worker -> times restarted
    reward_window: int = 0
    reward_mean_first_window: float | None = None
    reward_mean_last_window: float | None = None
    staleness_mean: float = 0.0  # mean lag over iterations
    weight_sync_count: int = 0  # weight syncs performed
    weight_sync_seconds_total: float = 0.0
    weight_sync_bytes_total: int = 0
    reward_failures: int = 0  # samples whose verifier failed or timed out
    stage_busy_seconds: dict[str, float] = field(default_factory=dict)  # stage -> busy seconds
    final_policy_version: int = 0
    name: str = ""  # run.name
    status: str = "ok"  # ok | failed | interrupted | solved (dynamic sampling: nothing to train)
    error: str | None = None  # the failure, when status != ok
    # "task: reason" -> rows; the reward windows and the fields below: docs/controller.md
    accuracy_before: float | None = None
    startup_seconds: float = 0.0
    total_seconds: float = 0.0
    stopped_by: str | None = None  # status interrupted: the signal ("SIGINT" = Ctrl-C, "SIGTERM")

    @classmethod
    def from_records(cls, mode: str, records: Sequence[IterationRecord],
                     wall_seconds: float | None = None, **extra: Any) -> RunSummary:
        """Aggregate iteration records; ``wall_seconds`` defaults to the sum over iterations.
        ``extra`` sets the remaining fields (name, status, error, ...)."""
        wall = sum(r.wall_seconds for r in records) if wall_seconds is None else wall_seconds
        samples = sum(r.samples for r in records)
        tokens = sum(r.generated_tokens for r in records)
        accuracies = [r.accuracy for r in records if r.accuracy is not None]
        busy: dict[str, float] = {}
        for r in records:
            for stage, seconds in r.stage_busy_seconds.items():
                busy[stage] = busy.get(stage, 0.0) + seconds
        syncs = [r for r in records if r.weight_sync_bytes > 0 or r.weight_sync_seconds > 0]
        window = reward_window(len(records))
        first_w = [r.reward_mean for r in records[:window]]
        last_w = [r.reward_mean for r in records[len(records) - window:]] if window else []
        first, last = (records[0], records[-1]) if records else (None, None)
        values: dict[str, Any] = dict(
            reward_window=window,
            reward_mean_first_window=statistics.fmean(first_w) if first_w else None,
            reward_mean_last_window=statistics.fmean(last_w) if last_w else None,
            mode=mode, iterations=len(records), samples=samples, generated_tokens=tokens,
            wall_seconds=wall,
            samples_per_second=samples / wall if wall > 0 else 0.0,
            tokens_per_second=tokens / wall if wall > 0 else 0.0,
            reward_mean_first=first and first.reward_mean,
            reward_mean_last=last and last.reward_mean,
            accuracy_first=accuracies[0] if accuracies else None,
            accuracy_last=accuracies[-1] if accuracies else None,
            max_staleness_observed=max((r.staleness_max for r in records), default=0),
            staleness_mean=statistics.fmean(r.staleness_mean for r in records) if records else 0.0,
            weight_sync_count=len(syncs),
            weight_sync_seconds_total=sum(r.weight_sync_seconds for r in records),
            weight_sync_bytes_total=sum(r.weight_sync_bytes for r in records),
            reward_failures=sum(r.reward_failures for r in records),
            stage_busy_seconds=busy, final_policy_version=last.policy_version if last else 0)
        return cls(**{**values, **extra})


def reward_window(iterations: int) -> int:
    """Iterations averaged at each end of a run to compare rewards: min(10, iterations // 2)."""
    return min(10, iterations // 2)


# Every built-in reward (workers/tasks/verifiers.py) scores in [0, 1]; a user's function has no declared
# range (tests/streamflow/test_rundir.py fails when a built-in is added without a range here).
BUILTIN_REWARD_RANGES: dict[str, tuple[float, float]] = {
    "exact_match": (0.0, 1.0),
    "numeric_close": (0.0, 1.0),
    "brevity": (0.0, 1.0),
    "final_answer": (0.0, 1.0),
}


def record_from_dict(cls: type[Any], data: dict[str, Any]) -> Any:
    """Build a record dataclass from JSON, ignoring keys this version does not know."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def _json_line(obj: Any) -> str:
    # NaN/inf are not JSON: write null so every line stays parseable by any JSON reader.
    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(dataclasses.asdict(obj)), allow_nan=False)


class RunDir:
    """A run directory on disk (made with its ``plots/`` and ``checkpoints/`` folders)."""

    def __init__(self, path: str | Path) -> None:
        self.path = p = Path(path)
        self.config_path, self.summary_path = p / "config.yaml", p / "summary.json"
        self.metrics_path, self.timeline_path = p / "metrics.jsonl", p / "timeline.jsonl"
        self.plots, self.checkpoints = p / "plots", p / "checkpoints"
        self.plots.mkdir(parents=True, exist_ok=True)
        self.checkpoints.mkdir(exist_ok=True)
        self._files: dict[Path, IO[str]] = {}  # the .jsonl files appended to

    @property
    def trace(self) -> Path:
        """The row trace's directory (streamflow.tracefile; made by its writer)."""
        return self.path / "trace"

    def write_config(self, cfg: RunConfig) -> Path:
        _atomic_write(self.config_path, dump_yaml(cfg))
        return self.config_path

    def append_metrics(self, record: IterationRecord) -> None:
        self._append(self.metrics_path, [record])

    def append_spans(self, spans: Iterable[StageSpan]) -> None:
        self._append(self.timeline_path, spans)

    def _append(self, path: Path, records: Iterable[Any]) -> None:
        if path not in self._files:
            self._files[path] = path.open("a")
        self._files[path].writelines(_json_line(r) + "\n" for r in records)
        self._files[path].flush()

    def write_summary(self, summary: RunSummary) -> Path:
        data = json.loads(_json_line(summary))
        _atomic_write(self.summary_path, json.dumps(data, indent=2) + "\n")
        return self.summary_path

    def write_plots(self, iteration: int | None = None) -> list[Path]:
        """(Re)draw plots/rewards.png and plots/timeline.png from the files on disk."""
        out = []
        records = self.read_metrics()
        if records:
            summary = self.read_summary()
            out.append(plot_rewards(
                records, self.plots / "rewards.png", reward_range=self.reward_range(),
                accuracy_before=summary.accuracy_before if summary else None))
        spans = self.read_spans()
        if spans:
            out.append(plot_timeline(spans, iteration, self.plots / "timeline.png"))
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_metrics(self) -> list[IterationRecord]:
        return [record_from_dict(IterationRecord, d) for d in read_jsonl(self.metrics_path)]

    def read_spans(self) -> list[StageSpan]:
        return [record_from_dict(StageSpan, d) for d in read_jsonl(self.timeline_path)]

    def reward_range(self) -> tuple[float, float] | None:
        """The range of the run's reward function when known (a built-in), from config.yaml."""
        if not self.config_path.exists():
            return None
        try:
            fn = (yaml.safe_load(self.config_path.read_text()) or {}).get("reward", {}).get("fn")
        except (yaml.YAMLError, AttributeError):
            return None
        return BUILTIN_REWARD_RANGES.get(fn or "exact_match")

    def read_summary(self) -> RunSummary | None:
        path = self.summary_path
        return record_from_dict(RunSummary, json.loads(path.read_text())) if path.exists() else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in filter(None, map(str.strip, path.read_text().splitlines())):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            # A run killed mid-write may leave a torn last line; everything before it is valid.
            break
    return out


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _pyplot() -> Any:  # matplotlib's Agg backend, imported lazily (a slow import)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def reward_band(records: Sequence[IterationRecord],
                reward_range: tuple[float, float] | None) -> tuple[list[float], list[float]]:
    """mean -/+ std per iteration, clipped to the reward's range when known."""
    low, high = reward_range or (-math.inf, math.inf)
    return ([max(r.reward_mean - r.reward_std, low) for r in records],
            [min(r.reward_mean + r.reward_std, high) for r in records])


def plot_rewards(records: Sequence[IterationRecord], path: str | Path, *,
                 reward_range: tuple[float, float] | None = None,
                 accuracy_before: float | None = None) -> Path:
    """Reward mean (+/- std band, clipped to ``reward_range``) and held-out accuracy per
    iteration (``accuracy_before`` drawn at iteration 0: the policy before RL), as PNG."""
    plt = _pyplot()
    path = Path(path)
    its = [r.iteration for r in records]
    mean = [r.reward_mean for r in records]
    fig, (ax_r, ax_a) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_r.plot(its, mean, marker="o", ms=3, color=STAGE_COLORS["reward"], label="reward mean")
    low, high = reward_band(records, reward_range)
    ax_r.fill_between(its, low, high, color=STAGE_COLORS["reward"], alpha=0.2,
                      label="+/- std" + (" (clipped to the reward's range)"
                                         if reward_range else ""))
    if reward_range:
        pad = 0.02 * (reward_range[1] - reward_range[0])
        ax_r.set_ylim(reward_range[0] - pad, reward_range[1] + pad)
    ax_r.set(title="Reward (trained samples)", xlabel="iteration", ylabel="reward")
    ax_r.legend(loc="lower right", fontsize=8)
    # An evaluation after iteration k's step is version k + 1: drawn there, before RL at 0.
    evals = [(r.iteration + 1, r.accuracy) for r in records if r.accuracy is not None]
    if accuracy_before is not None and (not records or records[0].iteration == 0):
        evals.insert(0, (0, accuracy_before))
    if evals:
        ax_a.plot(*zip(*evals, strict=True), marker="o", ms=3, color=STAGE_COLORS["trainer"])
        ax_a.set_ylim(-0.02, 1.02)
    else:
        ax_a.text(0.5, 0.5, "no evaluation", ha="center", va="center", transform=ax_a.transAxes)
    ax_a.set(title="Held-out accuracy (0 = before RL)", xlabel="policy version",
             ylabel="accuracy")
    from matplotlib.ticker import MaxNLocator

    for ax in (ax_r, ax_a):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def stage_order(stage: str) -> int:
    """Stages in STAGES order; any other after them."""
    return STAGES.index(stage) if stage in STAGES else len(STAGES)


def plot_timeline(spans: Sequence[StageSpan], iteration: int | None, path: str | Path) -> Path:
    """Gantt chart of one iteration (None: the middle one), one lane per worker; overlapping work
    of other iterations is drawn faded and hatched."""
    if not spans:
        raise ValueError("plot_timeline needs at least one span")
    plt = _pyplot()
    path = Path(path)
    iterations = sorted({s.iteration for s in spans if s.iteration >= 0})
    if iteration is None and not iterations:
        raise ValueError("no span names an iteration (all are -1)")
    k = iterations[len(iterations) // 2] if iteration is None else iteration
    own = [s for s in spans if s.iteration == k]
    if not own:
        raise ValueError(f"no spans for iteration {k}; iterations present: {iterations}")
    t0, t1 = min(s.start for s in own), max(s.end for s in own)
    shown = [s for s in spans if s.end > t0 and s.start < t1]
    lanes: dict[str, tuple[int, str]] = {}
    for s in shown:
        key = (stage_order(s.stage), s.worker)
        lanes[s.worker] = min(lanes.get(s.worker, key), key)
    order = sorted(lanes, key=lambda w: lanes[w])
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.45 * len(order)))
    for s in shown:
        y = order.index(s.worker)
        start, end = max(s.start, t0) - t0, min(s.end, t1) - t0
        mine = s.iteration == k
        ax.broken_barh([(start, max(end - start, 1e-6))], (y - 0.4, 0.8),
                       facecolors=STAGE_COLORS.get(s.stage, "#999999"), alpha=1.0 if mine else 0.35,
                       hatch=None if mine else "//", edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(order)), order)
    ax.invert_yaxis()
    ax.set_xlim(0, max(t1 - t0, 1e-3))
    ax.set(xlabel=f"seconds since the start of iteration {k}",
           title=f"Stage timeline, iteration {k}")
    stages = [st for st in STAGES if any(s.stage == st for s in shown)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=STAGE_COLORS[st]) for st in stages]
    ax.legend(handles, stages, loc="upper center", ncol=len(stages) or 1, fontsize=8,
              frameon=False, bbox_to_anchor=(0.5, -0.25 - 0.05 * (len(order) < 4)))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
