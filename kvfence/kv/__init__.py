"""KV memory: `layout` (every buffer a model keeps per token), `pool` (the paged tensors) and `allocator` (who
owns which page; every page free, owned or quarantined, checked by `PageAllocator.check`).

What it does not know: models, requests or transports."""
