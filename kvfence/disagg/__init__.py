"""Disaggregated prefill/decode: router, workers and the handoff state machine."""
