"""Verifiable tasks and their verifiers: ``arithmetic`` (the embedded task), ``word`` (word
problems and chat-template prompts), ``verifiers`` (reward functions and their runner).
"""
