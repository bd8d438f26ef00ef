"""A store node process for a benchmark, started the way a run starts one (a supervised child)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from streamflow.cluster import start_store_node
from streamflow.supervisor import RestartPolicy, Supervisor


def spawn_store(
    shards: int, log_dir: str | os.PathLike, *, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, list[str]]:
    """``python -m storage.server`` on a free 127.0.0.1 port (its log under ``log_dir``); returns
    (process, addresses) once it is bound. The caller stops the process."""
    sup = Supervisor(Path(log_dir), RestartPolicy(max_restarts=0))
    sup.env.update(env or {})  # e.g. the bench's thread limits for the node
    node = start_store_node(sup, "store-0", bind="tcp://127.0.0.1:0", shards=shards,
                            metrics=False)
    node.wait()
    return node.child.popen, node.addresses
