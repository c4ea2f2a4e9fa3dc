"""Digests, canaries, manifests, verification and integrity records for KV handoffs."""
