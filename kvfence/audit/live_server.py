"""GETs to one running server that an audit reads (`audit sglang URL`, `audit vllm URL`): the shared HTTP step.

What it knows: `LiveServer`, a client for one base URL (a `with` block holds its connections): `get` (the response
when the server answered 200, None for any other status, a KvfenceError naming the URL when it cannot be reached)
and `get_json` (the JSON of the first of several paths answered 200; None when none was, or it was not JSON).

What it does not know: which endpoints a serving engine has or what their answers mean (`sglang_server`,
`vllm_server` build their bundles from them).
"""

from __future__ import annotations

from typing import Any

import httpx

from kvfence.errors import KvfenceError


class LiveServer:
    """One server's base URL, for GETs."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.base = url.rstrip("/")
        self._client = httpx.Client(timeout=timeout)

    def __enter__(self) -> LiveServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._client.close()

    def get(self, path: str) -> httpx.Response | None:
        """GET `path`: its response when the status is 200, else None; raises KvfenceError when unreachable."""
        try:
            r = self._client.get(self.base + path)
        except httpx.HTTPError as e:
            raise KvfenceError(f"cannot reach {self.base}{path}: {e}") from e
        return r if r.status_code == 200 else None

    def get_json(self, *paths: str) -> Any | None:
        """The JSON of the first of `paths` answered 200 (later ones are not asked); None when none was, or when
        that answer is not JSON."""
        for path in paths:
            r = self.get(path)
            if r is not None:
                try:
                    return r.json()
                except ValueError:
                    return None
        return None
