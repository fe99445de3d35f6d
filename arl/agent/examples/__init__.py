"""Example agents, importable by nodes (they live under the default ``arl.`` prefix)."""
