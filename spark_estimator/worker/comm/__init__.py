"""Executor: the process group, device pinning and gradient communication (not ``dist/``,
which packaging and pytest treat as a build folder)."""
