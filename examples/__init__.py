"""Examples a user would write: agents for ``agent.fn`` (docs/agents.md)."""
