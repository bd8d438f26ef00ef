"""The simulated cluster behind ``streamflow bench simulate``: a case as a real run of the real
controller over the ``simulated`` engine (``cluster.run_sim``), the ``Cluster`` that runs its
workers as threads of a few host processes (``simcluster.SimCluster``), and the lower bound on a
run's time and the zero-overhead reference schedule (``bound``). Costs come from the product's
cost model, ``workers.engines.sim_cost``.
"""
