"""Tables (terminal and Markdown) and plots for ``streamflow bench simulate``.

Plots (matplotlib, Agg): ``throughput_vs_workers.png`` (achieved and bound per mode),
``efficiency.png`` (achieved / bound per mode and size, with the 0.9 and 0.8 targets) and
``utilisation_timeline.png`` (busy fraction per role over simulated time, periodic against async
s=1 on the long-tail workload). Not a bench itself (the leading underscore keeps it out of
``streamflow bench``'s list).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROLES = ("rollout", "reward", "reference", "trainer")


def _fmt_layout(r: dict[str, Any]) -> str:
    lay = r["layout"]
    if "devices" in lay:
        return f"{lay['devices']} colocated"
    return "/".join(str(lay.get(k, 0)) for k in ROLES)


def _util(r: dict[str, Any]) -> str:
    return " / ".join(f"{r['utilisation'].get(k, 0.0):.2f}" for k in ROLES)


def markdown(rows: list[dict[str, Any]], targets: dict[str, Any]) -> str:
    out = []
    head = (
        "| mode | workers | layout R/W/F/T | time scale | samples/s | bound | efficiency | "
        "vs ref. schedule | "
        "util rollout / reward / reference / trainer | controller ms/mb | store ms/mb |"
    )
    sep = "|" + "---|" * 11
    for sweep, title in (
        ("scaling", "Scaling (skew 1.0)"),
        ("control", "Control plane (periodic, coordinator + sessions, 4 shards)"),
        ("skew", "Response-length skew"),
        ("equal", "Generation ~ training"),
        ("balance", "Balancer under skew"),
    ):
        sel = [r for r in rows if r["sweep"] == sweep]
        if not sel:
            continue
        out += [
            f"**{title}**",
            "",
            head.replace("| mode |", "| mode | skew |") if sweep == "skew" else head,
            sep + ("---|" if sweep == "skew" else ""),
        ]
        for r in sel:
            label = r["label"] + (f" (balancer {r['balancer']})" if sweep == "balance" else "")
            skew = f" {r['skew']} |" if sweep == "skew" else ""
            out.append(
                f"| {label} |{skew} {r['workers']} | {_fmt_layout(r)} | {r['time_scale']:g} | "
                f"{r['throughput']:.2f} | {r['bound']:.2f} | {r['efficiency']:.3f} | "
                f"{r['reference_ratio']:.3f} | {_util(r)} | "
                f"{r['controller_cpu_ms_per_micro_batch']:.3f}"
                + (
                    f" (coordinator {r['coordinator_cpu_ms_per_micro_batch']:.3f})"
                    if sweep == "control"
                    else ""
                )
                + f" | {r['store_cpu_ms_per_micro_batch']:.2f} |"
            )
        if sweep == "balance":
            out.append("")
            for r in sel:
                refs = ", ".join(f"{k} {v:.2f}" for k, v in r["reference_utilisation"].items())
                out.append(
                    f"- balancer {r['balancer']}: reference utilisation {refs}; spread "
                    f"{r['reference_spread']:.3f}; coordinator "
                    f"{r['coordinator_cpu_ms_per_micro_batch']:.3f} ms/micro-batch"
                )
        out.append("")
    out.append("**Targets**: " + ", ".join(f"{k} = {_short(v)}" for k, v in targets.items()))
    return "\n".join(out)


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_short(x)}" for k, x in v.items()) + "}"
    return str(v)


def print_tables(rows: list[dict[str, Any]], targets: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="streamflow bench simulate (samples per simulated second; cost 7b-1acc)")
    for col in (
        "sweep",
        "mode",
        "skew",
        "workers",
        "layout R/W/F/T",
        "scale",
        "samples/s",
        "bound",
        "efficiency",
        "vs ref.",
        "util ro/rw/rf/tr",
        "ctl ms/mb",
        "coord ms/mb",
        "store ms/mb",
    ):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["sweep"],
            r["label"] + (f" {r['balancer']}" if "balancer" in r else ""),
            f"{r['skew']:g}",
            str(r["workers"]),
            _fmt_layout(r),
            f"{r['time_scale']:g}",
            f"{r['throughput']:.2f}",
            f"{r['bound']:.2f}",
            f"{r['efficiency']:.3f}",
            f"{r['reference_ratio']:.3f}",
            _util(r),
            f"{r['controller_cpu_ms_per_micro_batch']:.3f}",
            f"{r['coordinator_cpu_ms_per_micro_batch']:.3f}",
            f"{r['store_cpu_ms_per_micro_batch']:.2f}",
        )
    console = Console(width=None if sys.stdout.isatty() else 200)  # a pipe: do not squeeze
    console.print(table)
    console.print("targets: " + ", ".join(f"{k} = {_short(v)}" for k, v in targets.items()))


def draw(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    scaling = [r for r in rows if r["sweep"] == "scaling"]
    labels = list(dict.fromkeys(r["label"] for r in scaling))
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, label in enumerate(labels):
        sel = sorted((r for r in scaling if r["label"] == label), key=lambda r: r["workers"])
        xs = [r["workers"] for r in sel]
        (line,) = ax.plot(xs, [r["throughput"] for r in sel], "o-", label=f"{label} achieved")
        ax.plot(
            xs,
            [r["bound"] for r in sel],
            "--",
            color=line.get_color(),
            alpha=0.6,
            label=f"{label} bound",
        )
        del i
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("simulated workers")
    ax.set_ylabel("samples per simulated second")
    ax.set_title("Throughput vs workers (7b-1acc, skew 1.0)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(out / "throughput_vs_workers.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    sizes = sorted({r["workers"] for r in scaling})
    width = 0.8 / max(len(labels), 1)
    for i, label in enumerate(labels):
        eff = {r["workers"]: r["efficiency"] for r in scaling if r["label"] == label}
        ax.bar(
            [j + i * width for j in range(len(sizes))],
            [eff.get(n, 0) for n in sizes],
            width,
            label=label,
        )
    ax.axhline(0.9, color="k", ls="--", lw=0.8, label="target <= 64 workers")
    ax.axhline(0.8, color="r", ls=":", lw=0.8, label="target at 256")
    ax.set_xticks(
        [j + width * (len(labels) - 1) / 2 for j in range(len(sizes))], [str(n) for n in sizes]
    )
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("simulated workers")
    ax.set_ylabel("efficiency = achieved / bound")
    ax.set_title("Engine efficiency against the cost-model lower bound")
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    paths.append(out / "efficiency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    tail = [r for r in rows if r["sweep"] in ("skew", "scaling") and r["workers"] == 64]
    top = max((r["skew"] for r in tail), default=None)
    pick = [r for r in tail if r["skew"] == top and r["label"] in ("periodic", "async(s=1)")]
    if pick:
        fig, axes = plt.subplots(len(pick), 1, figsize=(8, 2.6 * len(pick)), sharex=True)
        axes = axes if len(pick) > 1 else [axes]
        for ax, r in zip(axes, pick, strict=True):
            _timeline(ax, r)
            ax.set_title(
                f"{r['label']}, {r['workers']} workers, skew {r['skew']}: "
                f"{r['throughput']:.1f} samples/s",
                fontsize=9,
            )
        axes[-1].set_xlabel("simulated seconds")
        fig.tight_layout()
        paths.append(out / "utilisation_timeline.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _timeline(ax: Any, r: dict[str, Any]) -> None:
    res = r["_result"]
    # one line per role: the busy fraction of its workers (a trainer of T devices is one worker)
    counts = {role: len({h[0] for h in res.holds if h[1] == role}) for role in ROLES}
    end = res.sim_seconds
    step = end / 300
    grid = [i * step for i in range(301)]
    for role in ("rollout", "reference", "trainer"):
        holds = [h for h in res.holds if h[1] == role]
        busy = [
            sum(1 for h in holds if h[3] <= t < h[4]) / max(counts.get(role, 1), 1) for t in grid
        ]
        ax.plot(grid, busy, label=role, lw=1)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("busy fraction")
    ax.legend(fontsize=7, loc="lower right")
