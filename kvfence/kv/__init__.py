"""KV memory: `layout` (every buffer a model keeps per token), `pool` (the paged tensors), `allocator` (who
owns which page; every page free, owned or quarantined, checked by `PageAllocator.check`) and `prefix_cache`
(full pages of computed prefixes shared by one tenant's requests, digest-checked at every reuse).

What it does not know: models, requests or transports."""
