"""The probe's verdict: what a set of replies from one server says about cross-request KV leaks.

What it knows: the replies the probe collected (`Reply`: which check sent it, how many prompt tokens,
status, text, planted canary, the prompt's owner and the text only that prompt held, the server's own integrity
status), what it learnt of the server (`ServerFacts`), and the rules that turn them into findings: over-length
or over-pool prompts answered with 200, prompt-token accounting (the placeholder signature), canaries seen in
another request's output, another prompt's unique text echoed verbatim into a reply (both critical: the leak
signature itself), golden answers that drift between idle, replay and load, server errors within the limits,
replies the server itself marked unverified; and `limits`: what a run could not establish (page reuse in a pool
larger than the traffic, checks skipped, inexact sizes, too few answered canaries). Pure: no I/O, no clock.
What it does not know: how the replies were obtained (kvfence.audit.probe sends them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvfence.audit.findings import Finding, Severity


def first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@dataclass
class Reply:
    check: str
    sent_tokens: int | None
    status: int  # HTTP status; 0 for a transport error or timeout; -1 when we aborted it ourselves
    text: str = ""
    prompt_tokens: int | None = None
    error: str = ""
    canary: str | None = None
    server_integrity: str | None = None  # kvfence's own `kvfence.integrity.status`, when the reply has one
    owner: str = ""  # which prompt it answered (replies to the same prompt share it)
    markers: tuple[str, ...] = ()  # text only that prompt held (kvfence.audit.probe.prompt_markers)

    @property
    def failed(self) -> bool:
        """A server-side failure: 5xx, transport error/timeout, or an error inside a stream we read."""
        return self.status >= 500 or self.status == 0 or (self.status == -1 and bool(self.error))


@dataclass
class ServerFacts:
    context_length: int | None = None
    context_source: str = "unknown"
    pool_tokens: int | None = None
    pool_source: str = "unknown"
    counter: str = "unknown"  # "/tokenize", "usage.prompt_tokens calibration" or "unavailable: <why>"
    models: list[str] = field(default_factory=list)


def judge(
    replies: list[Reply],
    facts: ServerFacts,
    base: list[Reply | None],
    after: list[Reply | None],
    replay: list[Reply | None] | None = None,
    *,
    exact_counts: bool,
    sized: bool,
    expect_deterministic: bool,
    stopped: str | None = None,
) -> list[Finding]:
    """Findings from every reply. `base`/`after`/`replay`: the golden set's answers idle, idle after the burst,
    and replayed after unrelated churn (same order); `exact_counts`: prompt sizes were counted by the server's
    /tokenize; `sized`: prompts of a given token count could be built at all; `stopped`: why the probe stopped
    early, if it did."""
    out: list[Finding] = []
    ctx = facts.context_length
    # Over-length / over-pool accepted, and prompt-token accounting.
    for r in replies:
        if r.status != 200 or r.sent_tokens is None:
            continue
        over_ctx = ctx is not None and r.sent_tokens > ctx
        at_ctx = ctx is not None and r.sent_tokens == ctx
        pool = facts.pool_tokens
        over_pool = pool is not None and r.sent_tokens > pool
        if r.check in ("boundary", "overlength-burst") and over_ctx:
            out.append(
                Finding(
                    "overlength-accepted",
                    Severity.CRITICAL,
                    r.check,
                    f"a {r.sent_tokens}-token prompt (context {ctx}) got HTTP 200 "
                    f"(usage.prompt_tokens={r.prompt_tokens})",
                    "reject prompts above the context length with 400 on every side (router, prefill, decode)",
                )
            )
        elif r.check == "boundary" and at_ctx:
            out.append(
                Finding(
                    "context-filled-accepted",
                    Severity.WARNING,
                    r.check,
                    f"a prompt of exactly the context length ({ctx} tokens) got HTTP 200; no room is left for "
                    "a generated token",
                    "reject prompts with prompt_tokens >= context length",
                )
            )
        elif over_pool and r.check in ("over-pool", "overlength-burst"):
            out.append(
                Finding(
                    "over-pool-accepted",
                    Severity.CRITICAL,
                    r.check,
                    f"a {r.sent_tokens}-token prompt, larger than the {pool}-token KV pool, got HTTP 200",
                    "keep context length <= KV pool on both sides, or reject such prompts with 400",
                )
            )
        if r.prompt_tokens is None:
            continue
        diff = abs(r.prompt_tokens - r.sent_tokens)
        exact = exact_counts and r.check in ("boundary", "over-pool")  # sized and verified by /tokenize
        if (exact and diff > 0) or diff > max(2, r.sent_tokens // 50):
            sig = " (placeholder signature: a 1-token stub was served)" if r.prompt_tokens <= 1 else ""
            out.append(
                Finding(
                    "prompt-tokens-mismatch",
                    Severity.CRITICAL,
                    r.check,
                    f"sent {r.sent_tokens} prompt tokens, the reply counted usage.prompt_tokens={r.prompt_tokens}{sig}",
                    "the answer was computed from a different prompt than the one sent; do not trust it",
                )
            )
    for r in replies:
        if r.check in ("boundary", "overlength-burst", "over-pool") and r.status >= 500:
            out.append(
                Finding(
                    "overlength-5xx",
                    Severity.WARNING,
                    r.check,
                    f"a {r.sent_tokens}-token prompt failed with HTTP {r.status} instead of a 400",
                    "validate prompt length before scheduling so clients get a clear 400",
                )
            )
    # Canary leak.
    planted = {r.canary for r in replies if r.canary}
    for r in replies:
        for code in planted:
            if code != r.canary and code in r.text:
                out.append(
                    Finding(
                        "canary-leak",
                        Severity.CRITICAL,
                        "canary",
                        f"canary {code} planted in another request appeared in the output of a {r.check} request",
                        "cross-request KV leak: stop serving, audit the deployment and logs "
                        "(kvfence audit sglang / logs)",
                    )
                )
    # Another prompt's unique text in a reply: the output (or KV) of another request was served into this one.
    owners: dict[str, str] = {}
    for r in replies:
        for m in r.markers:
            owners.setdefault(m, r.owner)
    for r in replies:
        if not r.text:
            continue
        for m, owner in owners.items():
            if owner != r.owner and m in r.text:
                out.append(
                    Finding(
                        "foreign-text-echo",
                        Severity.CRITICAL,
                        r.check,
                        f"a {r.check} reply contains {m!r}, text that only the prompt of another request "
                        f"({owner}) held: another request's KV or output was served into this reply",
                        "cross-request leak: stop serving, audit the deployment and logs (kvfence audit sglang / logs)",
                    )
                )
                break
    # Golden drift: the same prompt at temperature 0 must get the same answer whatever ran before or beside it.
    drift_sev = Severity.CRITICAL if expect_deterministic else Severity.WARNING
    drift_fix = (
        "this server is expected to be deterministic: an answer that depends on other traffic means decode "
        "read KV it did not compute for this prompt (unwritten or stale pages); stop serving and audit the "
        "KV handoff (kvfence audit sglang / logs)"
        if expect_deterministic
        else "some kernels are not batch-invariant and prefix-cache hits change numerics; if the drift is large, "
        "shows foreign text, or the server should be deterministic (--expect-deterministic), treat it as a leak"
    )

    def compare(later: list[Reply | None], rule: str, check: str, when: str) -> None:
        changed = []
        for i, b in enumerate(base):
            a = later[i] if i < len(later) else None
            if b is None or a is None or b.status != 200 or a.status != 200:
                continue
            if a.text != b.text:
                changed.append((i, first_difference(a.text, b.text), len(b.text)))
        if changed:
            i, at, n = changed[0]
            out.append(
                Finding(
                    rule,
                    drift_sev,
                    check,
                    f"{len(changed)} golden prompt(s) answered differently {when} at temperature 0 (first: prompt "
                    f"{i}, the {n}-character answer differs from character {at})",
                    drift_fix,
                )
            )

    compare(replay or [], "golden-drift-replay", "golden-replay", "when replayed idle after unrelated requests")
    compare(after, "golden-drift-after-load", "golden-after", "idle before and after the burst")
    load = [r for r in replies if r.check == "golden-load"]
    base_texts = [b.text for b in base if b is not None and b.status == 200]
    drift = [r for r in load if r.status == 200 and r.text not in base_texts]
    if drift and base_texts:
        out.append(
            Finding(
                "golden-drift-under-load",
                drift_sev,
                "golden-load",
                f"{len(drift)} of {len(load)} golden answers changed under load at temperature 0",
                drift_fix,
            )
        )
    # Server errors on requests within the limits: not a leak, but every one is a request the server failed.
    in_limit = ("calibration", "golden-idle", "golden-replay", "churn", "canary", "golden-load", "golden-after")
    rs = [r for r in replies if r.check in in_limit or r.check == "midstream-abort"]
    bad = [r for r in rs if r.failed]
    if bad:
        kinds = [f"HTTP {code}" for code in sorted({r.status for r in bad if r.status > 0})]
        kinds += ["transport/stream errors"] if any(r.status <= 0 for r in bad) else []
        how = " and ".join(kinds)
        checks = ", ".join(sorted({r.check for r in bad}))
        out.append(
            Finding(
                "server-errors",
                Severity.WARNING,
                "server",
                f"{len(bad)} of {len(rs)} requests within the limits failed ({how}; checks: {checks}); "
                f"first: {bad[0].error}",
                "read the server's error and logs; a server that refuses to decode over KV it cannot verify "
                "fails requests like this instead of answering from the wrong pages",
            )
        )
    unverified = [r for r in replies if r.server_integrity == "unverified"]
    if unverified:
        out.append(
            Finding(
                "handoff-unverified",
                Severity.WARNING,
                "server",
                f"the server itself marked {len(unverified)} of {len(replies)} replies' KV handoff "
                "'unverified' (kvfence.integrity)",
                "turn KV handoff verification back on (drop --no-verify)",
            )
        )
    if ctx is None or not sized:
        why = "context length unknown" if ctx is None else f"prompt tokens cannot be counted ({facts.counter})"
        out.append(
            Finding(
                "boundary-skipped",
                Severity.INFO,
                "boundary",
                f"{why}: boundary, over-pool and over-length checks skipped",
                "pass --context-length (and --pool-tokens); the server must answer /tokenize or usage",
            )
        )
    if stopped:
        out.append(
            Finding(
                "probe-truncated",
                Severity.INFO,
                "probe",
                f"stopped early: {stopped}; some checks ran partially",
                "raise --max-requests or --time-budget",
            )
        )
    # One finding per (rule, check, message); more than two of a kind fold into one with a count.
    seen, unique = set(), []
    for f in out:
        key = (f.rule, f.role, f.message)
        if key not in seen:
            seen.add(key)
            unique.append(f)
    groups: dict[tuple[str, str], list[Finding]] = {}
    for f in unique:
        groups.setdefault((f.rule, f.role), []).append(f)
    folded = []
    for fs in groups.values():
        if len(fs) <= 2:
            folded += fs
        else:
            first = fs[0]
            msg = f"{len(fs)} replies; first: {first.message}"
            folded.append(Finding(first.rule, first.severity, first.role, msg, first.fix))
    return folded


class Limit(NamedTuple):
    """Something a probe run could not establish, and why."""

    check: str
    why: str


def limits(
    replies: list[Reply],
    facts: ServerFacts,
    *,
    sized: bool,
    exact_counts: bool,
    expect_deterministic: bool,
    churn: int,
    stopped: str | None = None,
) -> list[Limit]:
    """What a clean result of this run does not rule out."""
    out: list[Limit] = []
    ctx, pool = facts.context_length, facts.pool_tokens
    answered = [r for r in replies if r.status == 200 or (r.status == -1 and not r.error)]
    through = sum((r.prompt_tokens or r.sent_tokens or 0) + len(r.text.split()) for r in answered)
    if churn == 0:
        out.append(Limit("golden-replay", "not run (--churn 0): no replay after other traffic"))
    if pool is None:
        out.append(
            Limit(
                "golden-replay",
                "page reuse unknown: the KV pool size is unknown (pass --pool-tokens), so nothing says whether the "
                "churn's pages were handed to the replayed prompts",
            )
        )
    elif through < pool:
        out.append(
            Limit(
                "golden-replay",
                f"page reuse not established: about {through} tokens went through a KV pool of {pool}; an "
                "allocator that hands out never-used pages first (a large decode pool) need not have reused any "
                "page, so a clean replay does not show that decode never reads pages another request wrote "
                "(raise --churn / --golden, or probe a server with a smaller pool)",
            )
        )
    if ctx is None or not sized:
        why = "context length unknown" if ctx is None else f"prompt tokens cannot be counted ({facts.counter})"
        out.append(Limit("boundary", f"not run: {why}; over-length and over-pool prompts were not sent"))
    elif pool is None:
        out.append(Limit("over-pool", "not run: the KV pool size is unknown (pass --pool-tokens)"))
    if sized and not exact_counts:
        out.append(
            Limit(
                "prompt-tokens",
                f"sizes fitted from usage.prompt_tokens ({facts.counter}), not counted by /tokenize: a reply "
                "counting a few tokens off what was sent is tolerated, so only gross mismatches (a 1-token stub) show",
            )
        )
    canaries = [r for r in replies if r.canary and r.status == 200]
    if len(canaries) < 2:
        out.append(
            Limit("canary", f"{len(canaries)} canary request(s) answered: too few for a canary to show up elsewhere")
        )
    aborts = [r for r in replies if r.check == "midstream-abort"]
    if aborts and not any(r.status == -1 and not r.error for r in aborts):
        out.append(Limit("midstream-abort", "no stream was open when it was aborted: the abort path was not exercised"))
    if not expect_deterministic:
        out.append(
            Limit(
                "golden",
                "drift is a warning only: the server does not claim batch-invariant greedy decoding "
                "(--expect-deterministic), so a changed answer is not proof of a leak",
            )
        )
    if stopped:
        out.append(Limit("probe", f"stopped early ({stopped}): the checks after that point ran partially or not"))
    return out
