"""KV storage and selection: the cache seam the torch decoder attends through, and KV policies."""
