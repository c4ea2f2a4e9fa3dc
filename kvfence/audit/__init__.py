"""Operator tools: audit SGLang deployments and logs, probe endpoints for leakage."""
