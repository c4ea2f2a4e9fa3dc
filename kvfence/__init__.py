"""kvfence: LLM serving with disaggregated prefill/decode and a verified KV handoff."""

__version__ = "0.1.0"
