"""Executor: what a rank shows of itself: its output and progress, TensorBoard events."""
