"""kvfence's verified KV handoff inside other serving engines (one subpackage per engine)."""
