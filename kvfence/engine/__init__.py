"""Requests, scheduler, model runner, sampler and the engine loop."""
