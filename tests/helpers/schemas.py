"""A JSON schema for structured-output tests: an object whose every property kind (bounded integer, short
string, boolean, enum, bounded array) a grammar must enforce. It says nothing of how outputs are checked."""

from __future__ import annotations

from typing import Any

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["id", "name", "ok", "color", "tags"],
    "additionalProperties": False,
}
