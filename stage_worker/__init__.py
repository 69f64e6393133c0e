"""Stage workers: one process per GPU (or CPU process) holding one pipeline stage's layers,
sharded for its tensor-parallel rank, and the paged KV cache of those layers."""
