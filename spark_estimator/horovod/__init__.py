"""Horovod's PyTorch API on spark-estimator (the hvd API modules come with their own branch)."""
