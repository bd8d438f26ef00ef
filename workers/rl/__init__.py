"""The RL math and the scoring passes it runs on: ``objectives`` and ``advantages`` (the pure
math of one step), ``tokens`` (token batches and the unpacked log-prob forward), ``packing`` /
``packing_layout`` (shared-prompt attention), ``trimodel`` (policy and reference log-probs in one
pass). No store, no I/O.
"""
