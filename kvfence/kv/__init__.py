"""KV layout, pool and page allocator."""
