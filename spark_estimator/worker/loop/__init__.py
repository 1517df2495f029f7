"""Executor: the one training loop (TorchEstimator) and its parts."""
