"""What a rank holds: samples (store, key index, shards, memory), batches, GPU copies."""
