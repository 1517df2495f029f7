"""Executor side: code that runs inside Spark tasks (training ranks, inference)."""
