"""Executor: a rank's decoding of its batches' variable columns (images, text, sequences):
``Decoder`` in threads or in decode worker processes, the batches' decoding and collation,
the workers' processes, shared memory and scheduling."""
