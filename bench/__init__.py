"""Benchmarks and the simulation harness of StreamFlow; not part of the product packages.

Each public module (no leading underscore) is one benchmark: it exposes ``main(argv) -> int``,
prints a table, then (``--json``) one JSON line, and runs as ``streamflow bench NAME [args]`` or
``python -m bench.NAME [args]``. Underscored modules are their shared parts (workloads G1 and W1,
the plain loop, the null store node, plots); ``bench.sim`` is the simulated cluster behind
``bench simulate``. Imports point down only: bench uses streamflow, workers and storage; none of
them imports bench (``streamflow bench`` finds it by name at call time).
"""
