"""Every knob of a run has one default. The worker records (workers.config) carry the run's
settings objects or take the value from the plan with no default of their own; the store's limits
are declared in storage and the run config takes its defaults from there; no constructor or
function repeats a knob's default as a literal (read from the source)."""

from __future__ import annotations

import ast
import dataclasses
import types
import typing
from pathlib import Path

import pytest
from testkit import worker_plan

from storage.schema import TableSpec
from storage.server import ServerConfig
from streamflow.cli import main as cli_main
from streamflow.config import RunConfig, StoreSection, load_config
from streamflow.config.convert import section_keys
from workers import config as records
from workers.checked import Checked, embedded

ROLE_RECORDS = {"rollout": records.RolloutWorkerConfig, "reward": records.RewardWorkerConfig,
                "reference": records.ReferenceWorkerConfig,
                "trainer": records.TrainerWorkerConfig}

# Record fields with a default that no YAML key sets: the worker's own, and why.
WORKER_INTERNAL = {
    "WorkerCommon.events_address": "the controller's socket (None: reports kept in memory)",
    "WorkerCommon.claim_timeout_s": "how often the loop re-checks for shutdown",
    "WorkerCommon.metrics_host": "set by the cluster from metrics.* (None: no endpoint)",
    "WorkerCommon.metrics_port": "0: every worker picks a free port and reports it",
    "WorkerCommon.request_timeout_s": "how soon a dead store node is noticed",
    "WorkerCommon.coordinator_address": "the run's coordinator (None: claim from any shard)",
    "WorkerCommon.simulated": "None: a real engine (the plan sets simulated.* otherwise)",
    "WorkerCommon.cores": "None: own threads (the plan sets run.host_threads' share)",
    "CoreShareConfig.max_threads": "0: no cap (the plan caps the rollout at its threads)",
    "WeightGroupConfig.transport": "derived by the plan from the members' devices",
    "WeightGroupConfig.shm_dir": "derived by the plan (the weights directory)",
    "RolloutWorkerConfig.weight_wait_s": "longest wait for a required policy version",
    "RolloutWorkerConfig.weights_fetch": "set by a multi-host launch (None: one host)",
    "RolloutWorkerConfig.weights_group": "None: weights by file (the plan sets the group)",
    "RolloutWorkerConfig.reference_path": "None: no reference here (derived from kl_coef and "
                                          "reference.placement)",
    "TrainerWorkerConfig.checkpoint_dir": "derived from the run directory",
    "TrainerWorkerConfig.start_iteration": "derived from the resumed checkpoint",
    "TrainerWorkerConfig.resume_from": "derived from run.resume",
    "TrainerWorkerConfig.checkpoint_keep": "complete checkpoints kept",
    "TrainerWorkerConfig.weights_keep": "derived from run.max_staleness",
    "TrainerWorkerConfig.weights_serve": "set by a multi-host launch",
    "TrainerWorkerConfig.weights_group": "None: weights by file (the plan sets the group)",
}


def _inner(tp: typing.Any) -> typing.Any:
    """X of ``X | None``; ``tp`` otherwise."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _records() -> list[type]:
    """Every record class a worker process reads, reached from the role records' fields."""
    seen: list[type] = []
    todo = list(ROLE_RECORDS.values())
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = _inner(hints[f.name])
            if dataclasses.is_dataclass(tp) and not issubclass(tp, Checked):
                todo.append(tp)
    return seen


def _default(f: dataclasses.Field) -> typing.Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def test_every_record_is_walked():
    names = {cls.__name__ for cls in _records()}
    assert {"WorkerCommon", "WeightGroupConfig", "CoreShareConfig"} <= names


@pytest.mark.parametrize("cls", _records(), ids=lambda c: c.__name__)
def test_a_record_field_with_a_default_is_a_settings_object_or_the_workers_own(cls):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            continue  # filled by the plan: the run config's default is the only one
        tp, name = _inner(hints[f.name]), f"{cls.__name__}.{f.name}"
        if isinstance(tp, type) and issubclass(tp, Checked):
            # a settings object: its class's defaults, never a record's own variant of them
            assert _default(f) in (None, tp()), f"{name}: defaults differ from {tp.__name__}'s"
        else:
            assert name in WORKER_INTERNAL, (
                f"{name} has a default of its own: take it from the plan (no default) or, if no "
                "YAML key sets it, list it in WORKER_INTERNAL")


def test_the_internal_list_names_no_yaml_key_and_no_stale_field():
    run_keys = set(section_keys(type(RunConfig().run)))
    role_keys = {role: set(section_keys(type(getattr(RunConfig(), role))))
                 for role in ROLE_RECORDS}
    section_of = {cls.__name__: role for role, cls in ROLE_RECORDS.items()}
    by_name = {cls.__name__: cls for cls in _records()}
    for name in WORKER_INTERNAL:
        owner, field = name.split(".")
        fields = {f.name: f for f in dataclasses.fields(by_name[owner])}
        assert field in fields and _default(fields[field]) is not dataclasses.MISSING, name
        keys = role_keys[section_of[owner]] if owner in section_of else set().union(
            run_keys, *role_keys.values())
        assert field not in keys, f"{name} is a YAML key: it must not have a default here"


def test_the_settings_objects_default_as_the_run_config_does():
    cfg = RunConfig()
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        for name, cls in embedded(type(value)).items():
            assert getattr(value, name) == cls(), f"{section.name}: embeds {cls.__name__} " \
                "with defaults of its own (the worker records would use the class's)"


# record (role, field) -> the YAML key the plan fills it from
FILLED = {
    ("rollout", "groups_per_claim"): "rollout.groups_per_claim",
    ("rollout", "engine"): "rollout.engine",
    ("reward", "rows_per_claim"): "reward.rows_per_claim",
    ("reference", "rows_per_claim"): "reference.rows_per_claim",
    ("trainer", "rows_per_claim"): "trainer.rows_per_claim",
    ("trainer", "engine"): "trainer.engine",
    ("trainer", "deterministic"): "trainer.deterministic",
    ("trainer", "zero_stage"): "trainer.zero_stage",
    ("trainer", "num_ranks"): "trainer.num_ranks",
    ("trainer", "checkpoint_every"): "run.checkpoint_every",
    ("trainer", "iterations"): "run.iterations",
    ("trainer", "group_size"): "data.group_size",
    ("rollout", "group_size"): "data.group_size",
}
CHANGED = ["reward.rows_per_claim=7", "reference.rows_per_claim=9", "trainer.rows_per_claim=5",
           "rollout.groups_per_claim=3", "trainer.deterministic=true", "trainer.zero_stage=1",
           "run.checkpoint_every=2", "run.iterations=4", "data.group_size=3", "run.seed=11",
           "rollout.threads=2", "reference.threads=3", "trainer.threads=4", "trainer.is_cap=3",
           "rollout.temperature=0.5", "trainer.packing=false", "trainer.lr=0.5"]


@pytest.mark.parametrize("overrides", [[], CHANGED], ids=["defaults", "changed"])
def test_the_plan_fills_each_record_from_its_yaml_key(overrides, tmp_path):
    cfg = load_config(None, overrides)
    plan = worker_plan(cfg, tmp_path)
    for (role, field), key in FILLED.items():
        section, name = key.split(".")
        assert getattr(getattr(plan, role), field) == getattr(getattr(cfg, section), name), key
    for role in ("rollout", "reference", "trainer"):
        assert getattr(plan, role).common.threads == getattr(cfg, role).threads
        assert getattr(plan, role).common.seed == cfg.run.seed
    t, r = plan.trainer, plan.rollout
    assert (t.optim, t.grpo, t.pack, t.sampling) == (
        cfg.trainer.optim, cfg.trainer.grpo.resolved(cfg.run.mode), cfg.trainer.pack,
        cfg.rollout.sampling)
    assert r.reference_pack == cfg.trainer.pack and plan.reward.verifier == cfg.reward.verifier


def test_the_stores_limits_are_declared_once_in_storage():
    shared = {f.name for f in dataclasses.fields(TableSpec)} & {
        f.name for f in dataclasses.fields(StoreSection)}
    assert shared == {"capacity_rows", "lease_seconds", "max_deliveries", "fsync"}
    for name in shared - {"fsync"}:  # (store.fsync: true = "always", false = "never")
        assert getattr(StoreSection(), name) == getattr(TableSpec, name), name
    plan = worker_plan(RunConfig(), Path("/nonexistent"))
    spec = plan.table_spec
    assert (spec.capacity_rows, spec.lease_seconds, spec.max_deliveries) == (
        TableSpec.capacity_rows, TableSpec.lease_seconds, TableSpec.max_deliveries)


def test_store_serve_flags_default_to_the_nodes_own_config(capsys):
    assert cli_main(["store", "serve", "--dry-run"]) == 0
    assert capsys.readouterr().out.strip() == str(ServerConfig())


def test_the_builtin_model_size_is_declared_once():
    from streamflow.config.sections import TinyModelConfig
    from workers.models.spec import TinyModelSpec

    run_default = dataclasses.asdict(TinyModelConfig())
    spec_default = dataclasses.asdict(TinyModelSpec())
    assert run_default == {k: spec_default[k] for k in run_default}


# ---------------------------------------------------------------- constructors and functions
# Every def and class body under these packages is read (AST: nothing is imported), except the
# declarations themselves; a parameter or field named like a knob must take the value from its
# caller (no default) or name the declaration (``= GrpoSettings.kl_coef``, ``= TableSpec.fsync``),
# never carry a literal of its own (which may differ from the declaration, silently).
SCANNED = ("streamflow", "workers", "storage")
ROOT = Path(__file__).resolve().parents[1]
# where a knob's default is declared: whole files, or the one class of a file that declares
DECLARING_FILES = {"streamflow/config/sections.py", "workers/settings.py"}
DECLARING_CLASSES = {
    "storage/schema.py:TableSpec",  # store.lease_seconds, max_deliveries, capacity_rows
    "workers/models/spec.py:TinyModelSpec",  # model.builtin.*
    # the store node's own config: `streamflow store serve` flags (store.num_shards is the run's
    # own nodes' count, always passed to the nodes a run starts)
    "storage/server.py:ServerConfig",
}
# parameter name -> the knob it carries under another name
ALIASES = {
    "trace": "run.trace", "trace_rows": "run.trace", "max_restarts": "run.max_restarts",
    "cut_live_fraction": "rollout.partial_cut_live_fraction",
    "tail_cut": "rollout.partial_tail_cut", "max_cuts": "rollout.partial_max_cuts",
    "correction": "trainer.importance_correction", "min_saving": "trainer.packing_min_saving",
    "fp64_accumulation": "trainer.deterministic", "shards": "store.num_shards",
    "model_device": "reward.device", "model_dtype": "reward.dtype", "reward_dtype": "reward.dtype",
    "tool_fraction": "model.warmstart_tool_fraction",
    # VllmRolloutEngine's keywords: rollout.vllm_* without the prefix
    "max_model_len": "rollout.vllm_max_model_len", "kv_cache_gib": "rollout.vllm_kv_cache_gib",
    "gpu_memory_utilization": "rollout.vllm_gpu_memory_utilization",
    "enforce_eager": "rollout.vllm_enforce_eager",
}
# "path:Qualname.param" -> why that parameter is not the knob its name says (or is storage's own)
_STORAGE_SHARDS = ("storage's own node: one shard, as ServerConfig.num_shards (store serve); "
                   "every node a run starts is given store.num_shards")
_OVERWRITE = "a store write's overwrite flag (the verb's), not run.overwrite"
_WORKLOAD = ("bench simulate's modelled cluster workload (set by bench/simulate.py's flags), not "
             "a run's data.* / run.*")
_CUTS = ("the cuts a trajectory may have, 0 with partial rollout off (PartialSettings.max_cuts "
         "resolves the two knobs), not rollout.partial_max_cuts")
NOT_THE_KNOB: dict[str, str] = {
    "workers/agent/pieces.py:Rules.max_cuts": _CUTS,
    "workers/roles/reward.py:RewardStage.__init__.max_cuts": _CUTS,
    "storage/__init__.py:EmbeddedStore.__init__.num_shards": _STORAGE_SHARDS,
    "storage/__init__.py:embedded.num_shards": _STORAGE_SHARDS,
    "storage/node.py:StoreNode.__init__.num_shards": _STORAGE_SHARDS,
    "storage/client.py:Client.write.overwrite": _OVERWRITE,
    "storage/headers.py:Write.overwrite": _OVERWRITE,
    "storage/node.py:StoreNode.write.overwrite": _OVERWRITE,
    "storage/ports.py:_ephemeral_low.path": "a /proc file, not model.path",
    "storage/ports.py:free_port.host": "the address a free port is looked for on (loopback unless "
                                       "the caller names one), not store.host",
    "storage/rpc.py:Channel.__init__.name": "the peer's name in error messages, not run.name",
    "streamflow/cluster.py:StoreNode.wait.timeout_s": "how long a store node may take to write "
                                                      "its ready file, not a verifier's timeout",
    "streamflow/controller.py:StageSeconds.environment": "seconds the environment stages took in "
                                                        "an iteration, not a node's worker count",
    "streamflow/rundir.py:RunSummary.name": "the summary's record of run.name ('': unknown, e.g. a "
                                            "summary rebuilt from metrics.jsonl by a report)",
    "workers/engines/sim_cost.py:Workload.group_size": _WORKLOAD,
    "workers/engines/sim_cost.py:Workload.iterations": _WORKLOAD,
    "workers/engines/sim_cost.py:Workload.prompts_per_iteration": _WORKLOAD,
    "workers/engines/sim_cost.py:Workload.seed": _WORKLOAD,
    "workers/models/checkpoint.py:TrainerState.format": "a checkpoint's format version, not "
                                                        "env.format",
    "workers/models/reward_train.py:RewardRecipe.lr": "the reward model's own AdamW (model "
                                                      "train-reward), not the policy's trainer.lr",
    "workers/models/reward_train.py:RewardRecipe.threads": "torch threads of that offline "
                                                           "training, not a role's threads",
    "workers/models/warmstart.py:BuiltinRecipe.threads": "torch threads of the warm start (its "
                                                         "weights do not depend on them), not a "
                                                         "role's threads",
    "workers/rl/trimodel.py:TriModel.__init__.reference": "where the frozen reference comes from "
                                                          "('copy' of the policy, a module, a "
                                                          "directory), not a placement count",
    "workers/tasks/word.py:WordProblemTask.seed": "a task no run reaches (data.task is arithmetic "
                                                  "or file); its own CLI sets the seed",
    "workers/weights/net.py:WeightFetcher.__init__.timeout_s": "one fetch of a version across "
                                                               "hosts, not weights.timeout_s (the "
                                                               "collective's)",
}


def _leaf_keys(cls: type, prefix: str = "") -> dict[str, str]:
    """Leaf name -> dotted key of every YAML key under section class ``cls``."""
    out: dict[str, str] = {}
    for key, tp in section_keys(cls).items():
        args = typing.get_args(tp) if typing.get_origin(tp) is tuple else ()
        inner = args[0] if args and dataclasses.is_dataclass(args[0]) else tp
        if dataclasses.is_dataclass(inner):
            out.update({k: v for k, v in _leaf_keys(inner, f"{prefix}{key}.").items()
                        if k not in out})
        else:
            out.setdefault(key, f"{prefix}{key}")
    return out


def knob_names() -> dict[str, str]:
    names: dict[str, str] = {}
    for section in dataclasses.fields(RunConfig):
        for leaf, key in _leaf_keys(section.type if isinstance(section.type, type) else type(
                getattr(RunConfig(), section.name)), f"{section.name}.").items():
            names.setdefault(leaf, key)
    return {**names, **ALIASES}


def _module_literals(tree: ast.Module) -> set[str]:
    """Module-level names bound to a literal (``DEFAULT_ATTN = "eager"``): a default naming one
    is a literal too."""
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and _is_literal(node.value, set()):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and node.value is not None \
                and isinstance(node.target, ast.Name) and _is_literal(node.value, set()):
            out.add(node.target.id)
    return out


def _is_literal(node: ast.expr, constants: set[str]) -> bool:
    """A value of the code's own: a constant other than None (None = "not given": the callee
    then does without, it picks no value), a tuple or list of them, a module attribute
    (``torch.float32``) or a module-level literal's name. ``SomeClass.field`` names a
    declaration and is not one."""
    if isinstance(node, ast.Constant):
        return node.value is not None
    if isinstance(node, ast.UnaryOp):
        return _is_literal(node.operand, constants)
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return all(_is_literal(e, constants) for e in node.elts)
    if isinstance(node, ast.Name):
        return node.id in constants
    if isinstance(node, ast.Attribute):
        root = node
        while isinstance(root, ast.Attribute):
            root = root.value
        return isinstance(root, ast.Name) and root.id[:1].islower()
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("field", "bounded"):
        value = node.args[0] if node.args else next(
            (k.value for k in node.keywords if k.arg == "default"), None)
        return value is not None and _is_literal(value, constants)
    return False


def _defaults(tree: ast.Module) -> typing.Iterator[tuple[str, str, ast.expr]]:
    """(class name or "", qualified name.param, default) of every def parameter and class-body
    field with a default."""

    def walk(node: ast.AST, qual: str, cls: str) -> typing.Iterator[tuple[str, str, ast.expr]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = f"{qual}{child.name}"
                for st in child.body:
                    if isinstance(st, ast.AnnAssign) and st.value is not None \
                            and isinstance(st.target, ast.Name):
                        yield child.name, f"{name}.{st.target.id}", st.value
                yield from walk(child, f"{name}.", child.name)
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                a, name = child.args, f"{qual}{child.name}"
                pos = a.posonlyargs + a.args
                given = zip(pos[len(pos) - len(a.defaults):], a.defaults, strict=True)
                keyword = zip(a.kwonlyargs, a.kw_defaults, strict=True)
                pairs = [*given, *((x, d) for x, d in keyword if d is not None)]
                for arg, default in pairs:
                    yield cls, f"{name}.{arg.arg}", default
                yield from walk(child, f"{name}.", cls)
            else:
                yield from walk(child, qual, cls)

    yield from walk(tree, "", "")


def literal_knob_defaults() -> dict[str, str]:
    """"path:Qualname.param" -> "default (knob)" for every parameter or field named like a knob
    with a literal default, outside the declarations."""
    names, found = knob_names(), {}
    for package in SCANNED:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in DECLARING_FILES:
                continue
            tree = ast.parse(path.read_text())
            constants = _module_literals(tree)
            for cls, qual, default in _defaults(tree):
                param = qual.rsplit(".", 1)[1]
                if param in names and f"{rel}:{cls}" not in DECLARING_CLASSES \
                        and _is_literal(default, constants):
                    found[f"{rel}:{qual}"] = f"{ast.unparse(default)} ({names[param]})"
    return found


def test_no_constructor_or_function_declares_a_knobs_default_again():
    found = literal_knob_defaults()
    again = {k: v for k, v in found.items() if k not in NOT_THE_KNOB}
    assert not again, (
        "a parameter named like a knob has a literal default of its own (take the value from "
        "the caller, or name the declaration, e.g. = GrpoSettings.kl_coef; if it is not the "
        "knob, list it in NOT_THE_KNOB with why):\n" + "\n".join(
            f"  {k} = {v}" for k, v in sorted(again.items())))
    assert not set(NOT_THE_KNOB) - set(found), "stale NOT_THE_KNOB entries"


def test_the_scan_sees_a_literal_default_and_not_a_named_declaration():
    src = ("DEFAULT = 'eager'\n"
           "def f(kl_coef=0.0, *, attn_implementation=DEFAULT, dtype=torch.float32,\n"
           "      fsync=TableSpec.fsync, seed=None): ...\n"
           "class C:\n    trace: bool = False\n")
    tree = ast.parse(src)
    constants = _module_literals(tree)
    literal = {qual for _, qual, d in _defaults(tree) if _is_literal(d, constants)}
    assert literal == {"f.kl_coef", "f.attn_implementation", "f.dtype", "C.trace"}
    assert {"kl_coef", "attn_implementation", "dtype", "fsync", "trace", "num_shards",
            "timeout_s", "max_restarts", "device"} <= set(knob_names())
