"""Verifiable tasks and their verifiers: ``arithmetic`` (the embedded task), ``word`` (word
problems and chat-template prompts), ``heldout`` (the one held-out rule of every task and prompt
file), ``verifiers`` (reward functions and their runner), ``evaluate`` (greedy accuracy).
"""
