"""Executor: the process group, device pinning and gradient communication."""
