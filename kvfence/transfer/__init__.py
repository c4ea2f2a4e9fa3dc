"""Transports that move KV pages between prefill and decode."""
