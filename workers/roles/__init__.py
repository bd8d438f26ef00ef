"""The compute roles: each claims its columns from the store, computes, writes them back.

``rollout`` (prompt -> model pieces; ``continuation``: ``rollout.{k}``), ``environment`` (tool
calls -> observation pieces), ``reward`` (responses -> rewards), ``reference`` (responses ->
frozen reference log-probs), ``trainer`` (groups -> optimizer step -> weights; and
``simulated_trainer``), over the shared claim -> compute -> write+ack ``loop`` (``riding``: the
rows that ride along a call, written as they finish); ``build`` makes each role from its typed
worker config.
"""
