"""The simulated cluster behind ``streamflow bench simulate``: a controller (``cluster.run_sim``),
host processes that run many simulated workers as threads (``host``), their stage engines and
trainer group (``engine``), colocated turns (``colocated``), the lower bound on a run's time and
the zero-overhead reference schedule (``bound``). Costs come from the product's cost model,
``workers.engines.sim_cost``.

Nothing here imports torch, so a host process with 100+ simulated device threads stays small.
"""
