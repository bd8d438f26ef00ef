"""Multi-turn tool use: the tool-call format, the environments that answer calls, the sandbox."""
