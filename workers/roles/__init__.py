"""The compute roles: each claims its columns from the store, computes, writes them back.

``rollout`` (prompt -> responses), ``reward`` (responses -> rewards), ``reference`` (responses ->
frozen reference log-probs), ``trainer`` (groups -> optimizer step -> weights), over the shared
claim -> compute -> write+ack ``loop``; ``build`` makes each role from its typed worker config.
"""
