"""What a worker process runs on: ``devices``, ``cores`` (the host's threads by phase), ``heap``,
``distributed`` (multi-rank coordination), ``events`` (reports to the controller), ``metrics``
(Prometheus), ``faults`` (failure reasons that name their rows), ``child`` (a spawned child
process for user code that may hang or crash).
"""
