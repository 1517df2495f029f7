"""Executor: a rank's data: shards, Parquet reads and writes, batches as tensors."""
