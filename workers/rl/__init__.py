"""The RL math and the scoring passes it runs on: ``grpo`` (pure tensor math of one step),
``packing`` / ``packing_layout`` (shared-prompt attention), ``trimodel`` (policy and reference
log-probs in one pass). No store, no I/O.
"""
