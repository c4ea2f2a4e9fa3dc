"""Errors a user can act on: the CLI prints their message, never a traceback.

What it knows: the small hierarchy of exceptions that carry a message meant for a
person (bad input, bad model directory, unsupported architecture, capacity). What it
does not know: how each front end shows them (CLI exit code, HTTP status).
"""

from __future__ import annotations


class KvfenceError(Exception):
    """An error whose message is for the user; front ends show it without a traceback."""


class ModelLoadError(KvfenceError):
    """A model directory is missing, incomplete or corrupt; the message names the file."""


class UnsupportedArchitectureError(KvfenceError):
    """config.json names an architecture kvfence cannot serve (or cannot verify)."""


class InvalidRequestError(KvfenceError):
    """A request is malformed or cannot be served (empty prompt, max_tokens <= 0, ...)."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


class ContextLengthExceededError(InvalidRequestError):
    def __init__(self, message: str) -> None:
        super().__init__(message, code="context_length_exceeded", param="messages")


class CapacityConfigError(KvfenceError):
    """A start-up configuration that cannot serve its own context length."""


class ServiceUnavailableError(KvfenceError):
    """The server cannot take the request now (e.g. no healthy worker of a role): HTTP 503, try again later."""

    def __init__(self, message: str, code: str = "service_unavailable") -> None:
        super().__init__(message)
        self.code = code
