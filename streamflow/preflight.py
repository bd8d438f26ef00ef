"""Checks of a run config against this machine, before anything is built or started.

``check(cfg)`` (``streamflow run`` and ``--dry-run``): no torch, well under a second; every
failure is a one-line ``ConfigError``. Invariant: every check that depends only on the config and
its files runs here, so none of them can fail after the built-in model's warm start (the prompt
file's held-out split included). Also the output directory's refusal to overwrite and its
clearing on ``run.overwrite``, and ``notes``: what a valid config does that a user may not expect.
What is checked: docs/controller.md "Checks before a run".
"""

from __future__ import annotations

import errno
import importlib
import importlib.util
import inspect
import json
import shutil
import socket
from pathlib import Path
from typing import Any

from streamflow.config import ConfigError, RunConfig
from workers.settings import EnvSettings

# What a run writes into run.output_dir (streamflow/rundir.py, controller, metrics, store persist).
RUN_FILES = ("config.yaml", "metrics.jsonl", "timeline.jsonl", "summary.json")
RUN_DIRS = ("checkpoints", "plots", "logs", "workers", "prometheus", "store", "weights",
            "trace")


def existing_run(path: str | Path) -> list[str]:
    """What in ``path`` shows a run that trained (empty: nothing to protect; a run that never
    finished an iteration holds nothing worth keeping: running into it again is a retry)."""
    p = Path(path)
    metrics = p / "metrics.jsonl"
    found = ["metrics.jsonl"] if metrics.is_file() and metrics.stat().st_size else []
    ckpt = p / "checkpoints"
    if ckpt.is_dir() and any(ckpt.iterdir()):
        found.append("checkpoints/")
    return found


def check_output_dir(cfg: RunConfig) -> None:
    if cfg.run.resume or cfg.run.overwrite:
        return
    found = existing_run(cfg.run.output_dir)
    if found:
        raise ConfigError("run.output_dir", f"{cfg.run.output_dir} already holds a run "
                          f"({', '.join(found)}); continue it with run.resume=auto, replace it "
                          "with run.overwrite=true (--overwrite), or choose another "
                          "run.output_dir or run.name")


def clear_output_dir(path: str | Path) -> None:
    """``run.overwrite``: delete the previous run's files (only those a run writes; anything
    else a user keeps in the directory stays)."""
    p = Path(path)
    for name in RUN_FILES:
        (p / name).unlink(missing_ok=True)
    for name in RUN_DIRS:
        shutil.rmtree(p / name, ignore_errors=True)


def check_inputs(cfg: RunConfig) -> None:
    resume = cfg.run.resume
    if resume and resume != "auto" and not (Path(resume) / "trainer_state.json").is_file():
        raise ConfigError("run.resume", f"{resume} is not a complete checkpoint "
                          "(no trainer_state.json); use run.resume=auto or a "
                          "checkpoints/step-* path")
    if cfg.model.path is not None:
        _check_model_dir(Path(cfg.model.path))
    if cfg.data.task == "file" and cfg.data.file:
        _check_problem_file(cfg)
    elif cfg.data.task == "arithmetic":
        _check_arithmetic(cfg)
    hub = _check_hub(cfg)
    _check_reward(hub if cfg.reward.fn == "hub" else cfg.reward.fn)
    if cfg.reward.model is not None:
        _check_reward_model(cfg)
    if cfg.gateway:
        _check_agent(str(cfg.agent.fn))
    if cfg.multi_turn:
        if cfg.env.fn == "mcp":
            _check_mcp(cfg.env.mcp_command)
        else:
            _check_env(cfg.env.fn)
        _check_tools(cfg.env.settings, hub if cfg.env.fn == "hub" else cfg.env.fn)
        _check_context(cfg)
    reward_engine = cfg.reward.engine if cfg.reward.model is not None else "torch"
    for key, engine, package in (("rollout.engine", cfg.rollout.engine, "vllm"),
                                 ("reward.engine", reward_engine, "vllm"),
                                 ("trainer.engine", cfg.trainer.engine, "deepspeed")):
        if engine == package and importlib.util.find_spec(package) is None:
            raise ConfigError(key, f"{engine}: the {package} package is not installed in this "
                              "Python environment (pip install 'streamflow[" f"{package}]')")


def _check_model_dir(path: Path) -> None:
    key = "model.path"
    if not path.is_dir():
        raise ConfigError(key, f"{path} is not a directory")
    config = path / "config.json"
    if not config.is_file():
        raise ConfigError(key, f"{path} is not a Hugging Face model directory (no config.json)")
    try:
        json.loads(config.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(key, f"{config} is not readable JSON: {err}") from None
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ConfigError(key, f"{path} has no tokenizer (tokenizer.json or tokenizer_config.json)")
    if not [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin")]:
        raise ConfigError(key, f"{path} has no weights (*.safetensors or pytorch_model*.bin)")


def _check_problem_file(cfg: RunConfig) -> None:
    from workers.tasks.prompt_file import ProblemFileError, load_problem_file

    d = cfg.data
    try:
        problems = load_problem_file(  # type: ignore[arg-type]
            d.file, d.prompt_column, d.answer_column)
    except ProblemFileError as err:
        raise ConfigError("data.file", str(err).replace("\n", " ")) from None
    if not problems:
        raise ConfigError("data.file", f"{d.file} has no rows")
    from workers.tasks.heldout import split_prompt_file

    n_eval = cfg.run.eval_prompts if cfg.run.eval_every else 0
    try:  # the split build_plan makes: enough distinct prompts for it and for training
        split_prompt_file(problems, n_eval, source=str(d.file))
    except ValueError as err:
        raise ConfigError("", str(err)) from None  # the message starts with run.eval_prompts=N


# Up to this many problems the arithmetic task enumerates its held-out split exactly (as
# ArithmeticTask.eval_problems does); above, the split holds tens of thousands of problems.
_ENUMERATED = 200_000


def _check_arithmetic(cfg: RunConfig) -> None:
    from workers.tasks.arithmetic import ArithmeticTask

    d = cfg.data
    try:
        task = ArithmeticTask(digits=d.digits, operations=tuple(d.operations), seed=d.seed)
    except ValueError as err:
        key = "data.digits" if "digits" in str(err) else "data.operations"
        raise ConfigError(key, str(err)) from None
    n = cfg.run.eval_prompts
    if n and len(task.operations) * (task.max_operand + 1) ** 2 <= _ENUMERATED:
        try:
            task.eval_problems(n)
        except ValueError as err:
            raise ConfigError("run.eval_prompts", f"{n}: {err}; lower run.eval_prompts or raise "
                              "data.digits") from None


def notes(cfg: RunConfig) -> list[str]:
    """What a valid config does that its user may not expect (the CLI prints them at start and
    with ``--dry-run``)."""
    out = []
    if cfg.data.task != "arithmetic" and cfg.model.path is None:
        source = cfg.data.file if cfg.data.task == "file" else f"env.hub={cfg.env.hub}"
        out.append("model.path is unset: the built-in model is warm-started on its arithmetic "
                   f"task, not on {source}; set model.path to train your own model")
    r = cfg.reward
    if r.model is None:
        return out
    from workers.models.reward_manifest import MANIFEST, recorded_accuracy

    accuracy = recorded_accuracy(r.model)
    if r.min_accuracy > 0 and accuracy is None:
        out.append(f"reward.model {r.model} records no accuracy (no {MANIFEST}: not made by "
                   "streamflow model train-reward), so reward.min_accuracy is not checked; "
                   "watch the run's reward_hacking metric")
    elif accuracy is not None and accuracy < r.min_accuracy and r.allow_weak:
        out.append(f"reward.allow_weak: starting from reward.model {r.model}, whose held-out "
                   f"accuracy {accuracy:.3f} is below reward.min_accuracy {r.min_accuracy}")
    return out


def _check_reward(fn: str) -> None:
    from workers.tasks.verifiers import RewardError, resolve_reward, takes_trajectory

    try:
        takes_trajectory(resolve_reward(fn))
    except RewardError as err:
        raise ConfigError("reward.fn", str(err).replace("\n", " ")) from None
    except Exception as err:  # the user's module raised while being imported
        why = f"importing {fn!r} raised {type(err).__name__}: {err}".replace("\n", " ")
        raise ConfigError("reward.fn", why) from None


def _check_reward_model(cfg: RunConfig) -> None:
    """reward.model is a classifier or a judge with a template (no torch: its config.json), and
    not below reward.min_accuracy where its manifest records an accuracy."""
    from workers.checked import ConfigValueError
    from workers.models.reward_manifest import MANIFEST, recorded_accuracy
    from workers.models.reward_text import model_kind

    try:
        model_kind(cfg.reward.scorer)
    except ConfigValueError as err:
        raise err.with_prefix("reward") from None
    r = cfg.reward
    accuracy = recorded_accuracy(str(r.model))
    if accuracy is not None and accuracy < r.min_accuracy and not r.allow_weak:
        raise ConfigError("reward.min_accuracy", f"{r.model} records a held-out accuracy of "
                          f"{accuracy:.3f} ({MANIFEST}), below {r.min_accuracy}: a policy "
                          "trained on a weak reward model learns to please it, not to solve "
                          "the task; retrain it (streamflow model train-reward --force, a larger "
                          "reward.train_max_epochs) or start anyway with reward.allow_weak=true "
                          "(or reward.min_accuracy=0)")


def _check_hub(cfg: RunConfig) -> str:
    """Where data.task, env.fn or reward.fn is "hub": the hub library and env.hub's module can be
    found (nothing is imported: the environment is made where it runs). Its spec, or ''."""
    if "hub" not in (cfg.data.task, cfg.reward.fn, cfg.env.fn if cfg.multi_turn else None):
        return ""
    from workers.agent.hub import hub_modules, hub_spec

    def found(name: str) -> bool:  # a submodule is looked for in its package's directories
        top, _, rest = name.partition(".")
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            return False
        if spec is None or not rest:
            return spec is not None
        path = rest.replace(".", "/")
        return any(Path(root, path).is_dir() or Path(root, f"{path}.py").is_file()
                   for root in spec.submodule_search_locations or ())

    library, modules = hub_modules(cfg.env.hub)
    for names, what in (((library,), f"the {library} package"), (modules, f"module {modules[0]!r}")):
        if not any(found(name) for name in names):
            raise ConfigError("env.hub", f"{cfg.env.hub}: {what} is not installed in this Python "
                              "environment (docs/agents.md \"Environments from a hub\")")
    return hub_spec(cfg.env.hub)


def _check_env(fn: str) -> None:
    """env.fn names a built-in or an importable class (not made here: a user's environment is
    only ever made in the child process that isolates it); the python tool needs a sandbox that
    works on this machine."""
    from workers.agent.environments import BUILTIN_ENVIRONMENTS

    if fn == "python":
        from workers.agent.sandbox import check_sandbox

        reason = check_sandbox()
        if reason is not None:
            raise ConfigError("env.fn", f"'python' needs the sandbox, which does not work here: "
                              f"{reason}".replace("\n", " "))
        return
    if fn in BUILTIN_ENVIRONMENTS or fn == "hub":  # (env.hub: _check_hub)
        return
    module_name, _, attr = fn.partition(":")
    if not attr:
        raise ConfigError("env.fn", f"unknown environment {fn!r}; built-in: "
                          f"{', '.join(BUILTIN_ENVIRONMENTS)} (or 'package.module:Class')")
    try:
        obj = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or the user's module raised while being imported
        why = f"cannot import {module_name!r}: {type(err).__name__}: {err}".replace("\n", " ")
        raise ConfigError("env.fn", why) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError("env.fn", f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError("env.fn", f"{fn!r} is not a class or factory")


def _check_agent(fn: str) -> None:
    """agent.fn is an importable function taking (base_url, api_key, prompt, answer) (imported
    here, run only in the agent workers' child process)."""
    module_name, _, attr = fn.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or the user's module raised while being imported
        why = f"cannot import {module_name!r}: {type(err).__name__}: {err}".replace("\n", " ")
        raise ConfigError("agent.fn", why) from None
    if not callable(fn_obj := getattr(obj, attr, None)):
        raise ConfigError("agent.fn", f"module {module_name!r} has no function {attr!r}")
    try:
        inspect.signature(fn_obj).bind("base_url", "api_key", "prompt", "answer")
    except (TypeError, ValueError):
        raise ConfigError("agent.fn", f"{fn!r} must take (base_url, api_key, prompt, answer)") \
            from None


def _check_mcp(command: tuple[str, ...]) -> None:
    """env.fn 'mcp' needs the mcp SDK, and a stdio server's command an executable (the server
    itself is only started by _check_tools, when env.tools names tools)."""
    if importlib.util.find_spec("mcp") is None:
        raise ConfigError("env.fn", "'mcp' needs the mcp package, which is not installed in this "
                          "Python environment (pip install 'streamflow[mcp]')")
    if command and shutil.which(command[0]) is None:
        raise ConfigError("env.mcp_command", f"{command[0]!r} is not an executable file or a "
                          "command on PATH")


def _check_tools(env: EnvSettings, fn: str) -> None:
    """Each name of env.tools is served by the environment (its ``tools()``): a built-in is made
    here, a user's (or a hub's: ``fn`` is then its spec) only in a child process
    (``workers.agent.isolated``), an MCP server is started and asked, and only when env.tools
    names any."""
    tools = env.tools
    if not tools:
        return
    from workers.agent.environments import BUILTIN_ENVIRONMENTS

    if fn in BUILTIN_ENVIRONMENTS:
        served = tuple(BUILTIN_ENVIRONMENTS[fn]().tools())
    else:
        try:
            if fn == "mcp":
                from workers.agent.mcp_tools import McpEnvironment

                made: Any = McpEnvironment(command=env.mcp_command, url=env.mcp_url,
                                           timeout_s=env.timeout_s)
            else:
                from workers.agent.isolated import IsolatedEnvironment

                made = IsolatedEnvironment(fn, env.timeout_s)
        except ValueError as err:  # the message names its key (env.fn, env.mcp_*)
            key, _, why = str(err).partition(": ")
            if not key.startswith("env."):
                key, why = "env.fn", str(err)
            raise ConfigError(key, why.replace("\n", " ")) from None
        served = made.tools()
        made.close()
    unknown = [t for t in tools if t not in served]
    if unknown:
        raise ConfigError("env.tools", f"{unknown[0]!r} is not a tool of env.fn={fn}, which "
                          f"serves: {', '.join(served)}")


def _check_context(cfg: RunConfig) -> None:
    """A whole trajectory (prompt, turns, observations) is one forward of the model: its response
    budget must leave the model's context room for a prompt."""
    if cfg.model.path is None:
        from workers.models.spec import TinyModelSpec

        context, where = TinyModelSpec.max_position_embeddings, "the built-in model"
    else:
        config = json.loads((Path(cfg.model.path) / "config.json").read_text())
        context, where = config.get("max_position_embeddings"), cfg.model.path
        if not isinstance(context, int):
            return  # (a model that states no context: the engine's own limit applies)
    limit = cfg.rollout.max_total_tokens
    if limit >= context:
        raise ConfigError("rollout.max_total_tokens", f"{limit} leaves no room for a prompt in "
                          f"the context of {where} ({context} tokens): use less than {context}")


def port_in_use(key: str, address: str) -> ConfigError:
    """The one error for a busy port, here and where the bind itself fails."""
    return ConfigError(key, f"{address} is already in use (another run or program listens "
                       f"there); free it, choose another {key}, or 0 for a free port")


def _bindable(host: str, port: int) -> int | None:
    """None when ``host:port`` can be bound now (as the servers bind: SO_REUSEADDR, so a port in
    TIME_WAIT is free), else the errno."""
    bind_host = "" if host in ("*", "0.0.0.0", "") else host.strip("[]")
    try:
        infos = socket.getaddrinfo(bind_host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return None  # an unknown host is the bind's own error to report
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(sockaddr)
        except OSError as err:
            return err.errno
    return None


def check_ports(cfg: RunConfig) -> None:
    wanted = []
    if cfg.store.port and not cfg.store.addresses and cfg.run.mode != "sync":
        # sync runs keep the store in-process and bind nothing
        wanted.append(("store.port", cfg.store.host, cfg.store.port,
                       f"tcp://{cfg.store.host}:{cfg.store.port}"))
    if cfg.gateway and cfg.agent.port:
        wanted.append(("agent.port", cfg.agent.host, cfg.agent.port,
                       f"{cfg.agent.host}:{cfg.agent.port}"))
    if cfg.metrics.enabled and cfg.metrics.port:
        wanted.append(("metrics.port", cfg.metrics.host, cfg.metrics.port,
                       f"{cfg.metrics.host}:{cfg.metrics.port}"))
    for key, host, port, address in wanted:
        code = _bindable(host, port)
        if code == errno.EADDRINUSE:
            raise port_in_use(key, address)
        if code == errno.EACCES:
            raise ConfigError(key, f"{address}: permission denied (ports below 1024 need "
                              "privileges); choose another port, or 0 for a free one")
