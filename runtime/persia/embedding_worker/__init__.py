"""Embedding worker: buffers ID batches, looks rows up on the PS shards, pools them, reduces gradients."""
