"""Executor: a Lightning Trainer on a barrier task (LightningEstimator)."""
