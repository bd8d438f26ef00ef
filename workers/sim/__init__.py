"""Simulated devices: a cost model (``cost``), simulated stage engines (``engine``) and the host
process that runs many simulated workers as threads (``host``). Used by ``streamflow bench
simulate``. Nothing here imports torch (``workers.engines`` does), so a host process with 100+
simulated workers stays small."""
