"""A server's start-up line `server_args=...`: its fields, and the SGLang release those fields belong to.

What it knows: the two shapes SGLang prints (entrypoints/engine.py `logger.info(f"server_args={...}")`): the dict
repr of `resolved_dict()` (0.5.19 .. 0.5.23), read with `ast.literal_eval`, and the `ServerArgs(k=v, ...)` repr,
read keyword by keyword; a dict that `literal_eval` refuses (an object repr such as `<function f at 0x..>` or
`<Mode.LOG: 'log'>` inside it) is read key by key at the top level, so every key is seen and every literal value
kept (the others as their text). Never evaluates code. The release: `resolved_dict()` prints every field of the
record (kvfence.audit.sglang_flags has each release's field set, all fields, read from the wheels), so the fields
that exist in some releases and not others (`DISCRIMINATING`) name it; a field no release 0.5.19 .. 0.5.23 has
means a release (or build) outside them, and the release is then unknown.
What it does not know: what the values mean for the rules (kvfence.audit.logs.scanner reads the few it needs).
"""

from __future__ import annotations

import ast
from typing import Any, NamedTuple

from kvfence.audit import sglang_flags

# Fields per release (index into sglang_flags.VERSIONS), all of them.
RELEASE_FIELDS = [
    frozenset(n for n, (a, b) in sglang_flags.FIELDS.items() if a <= i <= b) for i in range(len(sglang_flags.VERSIONS))
]
KNOWN_FIELDS = frozenset().union(*RELEASE_FIELDS)
COMMON_FIELDS = frozenset.intersection(*RELEASE_FIELDS)
DISCRIMINATING = KNOWN_FIELDS - COMMON_FIELDS
# The nearest two releases differ in 12 discriminating fields (0.5.22 / 0.5.23): a line a few fields off one
# release (a field dropped by a patch) is still that release, never the next one.
TOLERANCE = 3


def parse_server_args(msg: str) -> dict[str, Any] | None:
    """The fields of a `server_args={...}` or `server_args=ServerArgs(...)` message; never evaluates code."""
    body = msg[len("server_args=") :].strip()
    if body.startswith("{"):
        try:
            out = ast.literal_eval(body)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return _top_level_items(body)
        return out if isinstance(out, dict) else None
    if body.startswith("ServerArgs("):
        try:
            call = ast.parse(body, mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(call, ast.Call):
            return None
        fields: dict[str, Any] = {}
        for kw in call.keywords:
            if kw.arg is None:
                continue
            try:
                fields[kw.arg] = ast.literal_eval(kw.value)
            except ValueError:
                fields[kw.arg] = ast.unparse(kw.value)  # an object repr: keep its text, evaluate nothing
        return fields
    return None


_OPEN, _CLOSE = "([{<", ")]}>"


def _top_level_items(body: str) -> dict[str, Any]:
    """Every top-level `'key': value` of a dict repr, scanned by hand: strings (with escapes) are skipped whole and
    brackets (including `<...>` object reprs) nest, so a value ends at the first `, '` or `}` outside them."""
    out: dict[str, Any] = {}
    i, n = 1, len(body)
    while i < n:
        while i < n and body[i] in " ,":
            i += 1
        if i >= n or body[i] not in "'\"":
            break
        end = _string_end(body, i)
        try:
            key = ast.literal_eval(body[i:end])
        except (ValueError, SyntaxError):
            break
        i = end
        while i < n and body[i] in " :":
            i += 1
        start, depth = i, 0
        while i < n:
            c = body[i]
            if c in "'\"":
                i = _string_end(body, i)
                continue
            if c in _OPEN:
                depth += 1
            elif c in _CLOSE:
                if depth == 0 and c == "}":
                    break  # the dict's own closing brace
                depth = max(0, depth - 1)
            elif c == "," and depth == 0:
                break
            i += 1
        raw = body[start:i].strip()
        if isinstance(key, str) and raw:
            try:
                out[key] = ast.literal_eval(raw)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                out[key] = raw
        if i < n and body[i] == "}":
            break
    return out


def _string_end(s: str, i: int) -> int:
    """Index just past the quoted string that starts at s[i]."""
    quote, j = s[i], i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
            continue
        if s[j] == quote:
            return j + 1
        j += 1
    return len(s)


class Release(NamedTuple):
    version: str | None  # "0.5.23", or None when the fields do not name one release
    source: str  # how it was told, or why not


def infer_release(keys: set[str]) -> Release:
    """The release whose fields these keys are, judged by the fields that tell releases apart."""
    if len(COMMON_FIELDS - keys) > len(COMMON_FIELDS) // 10:
        return Release(None, f"server_args line incomplete ({len(keys)} fields): release not told")
    foreign = sorted(keys - KNOWN_FIELDS)
    observed = keys & DISCRIMINATING
    scores = [len(observed ^ (fields & DISCRIMINATING)) for fields in RELEASE_FIELDS]
    best = min(scores)
    nearest = [sglang_flags.VERSIONS[i] for i, s in enumerate(scores) if s == best]
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        return Release(
            None,
            f"server_args fields: {len(foreign)} field(s) no release 0.5.19 .. 0.5.23 has ({shown}); a newer release "
            f"or a patched build (nearest: {'/'.join(nearest)}); pass --sglang-version to judge by one",
        )
    if best > TOLERANCE or len(nearest) > 1:
        return Release(None, f"server_args fields fit no single release (nearest: {'/'.join(nearest)}, {best} off)")
    off = f", {best} field(s) off" if best else ""
    return Release(nearest[0], f"server_args fields{off}")


def infer_version(keys: set[str]) -> str | None:
    """The release of a `server_args` key set, or None (see infer_release for why)."""
    return infer_release(keys).version
