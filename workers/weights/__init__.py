"""Weight sync from the trainer to the rollout engines: ``versions`` (file names, no torch),
``file_sync`` (publish and load a version through a file), ``net`` (the same bytes to other hosts),
``group`` (the collective weight-update group) and ``collective`` (its publisher and subscriber).
"""
