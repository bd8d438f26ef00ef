"""The OpenAI-compatible gateway: agents written against the OpenAI API drive the run's rollout
engines through the store, one row per episode (``chat``: messages to ids, ``book``: the rows
and leases, ``app``: the HTTP endpoint; docs/agents.md)."""
