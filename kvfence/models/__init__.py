"""Model implementations that read and write a paged KV pool."""
