"""KV-transfer wiring: which connector an engine uses, and how it is configured."""
