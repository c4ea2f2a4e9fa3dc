"""Black-box probe of an OpenAI-compatible server for the PD KV-leak signatures.

What it knows: how to learn a server's context length and KV pool size (`/server_info`,
`/v1/models` `max_model_len`, or flags), how to build prompts of an exact token count (counted by
`/tokenize` when the server has it, else fitted from `usage.prompt_tokens` of calibration requests),
and these checks, all over `/v1/completions` with temperature 0:
- boundary: prompts of context-1, context and context+1 tokens; a 200 above the context is a finding;
- over-pool: prompts larger than the advertised KV pool (when the pool is below the context);
- prompt-token accounting: every 200 must report `usage.prompt_tokens` equal to what was sent
  (a reply counting 1 token is the placeholder signature of a too-long request served from a stub);
- canary leak: unique canary strings planted in some requests must never appear in another
  request's output, under a burst mixed with over-length prompts and mid-stream aborts;
- foreign text: every prompt carries text unique to it (its tagged header, a golden prompt's own heading, a churn
  request's random words); a reply that echoes another prompt's unique text verbatim is the leak signature an
  operator fears most, and is critical like a canary (`prompt_markers`);
- golden drift: a temperature-0 golden set (multi-page prompts) answered idle, replayed idle after
  unrelated "churn" requests, answered under load and idle again must not change. Decode over
  pages that were never written (the placeholder handoff served without verification) makes a
  reply depend on whatever earlier requests left in those pages, so the same prompt answers
  differently once other traffic has gone through the pool. Drift is a warning by default (GPU
  kernels that are not batch-invariant, or a prefix-cache hit, can flip a greedy token honestly)
  and critical with `expect_deterministic` (a server that claims batch-invariant greedy decoding);
- server errors: in-limit requests that fail (5xx, broken stream) are reported with the server's
  own reason, so a server that refuses unverifiable KV cleanly shows as errors, not as a leak.
What it does not know: the server's internals (it reads kvfence's `kvfence.integrity` status when
a reply carries one, nothing else). The replay check is only as strong as page reuse: a small
pool, or an allocator that hands freed pages out again soon, recycles the churn's pages into the
replay; a huge pool with a FIFO free list may not. What a run could not establish (page reuse, sizes it could
not count, checks it skipped) is listed in the report (`ProbeReport.not_established`). Only text this probe
planted is recognised in a reply; another user's text cannot be told from model output. It is bounded (request
count, concurrency, wall time) and refuses non-loopback targets unless explicitly authorised.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import secrets
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from kvfence.audit.findings import Finding, Severity
from kvfence.audit.probe_verdict import Limit, Reply, ServerFacts, judge, limits
from kvfence.errors import KvfenceError

FILLER = " the"
GOLDEN_WORDS = "red green blue one two three north south east west apple river stone cloud seven eight".split()


def _integrity_status(doc: Any) -> str | None:
    """kvfence's per-reply KV handoff status (`kvfence.integrity.status`), None for any other server."""
    info = (doc.get("kvfence") or {}).get("integrity") if isinstance(doc, dict) else None
    if isinstance(info, list):
        info = info[0] if info else None
    status = info.get("status") if isinstance(info, dict) else None
    return status if isinstance(status, str) else None


def _error_text(doc: Any, raw: str) -> str:
    """The server's own error sentence (OpenAI `error.message`, else `message`), else the raw body."""
    if isinstance(doc, dict):
        err = doc.get("error")
        msg = err.get("message") if isinstance(err, dict) else (err if isinstance(err, str) else doc.get("message"))
        if isinstance(msg, str) and msg:
            return msg[:300]
    return raw[:300]


_GOLDEN_HEAD_RE = re.compile(r"kvfence golden \d+:")
_HEX_WORD_RE = re.compile(r"(?<![0-9a-zA-Z])[0-9a-f]{4}(?![0-9a-zA-Z])")
MARKER_WORDS = 3  # a run of this many random 4-hex-digit words (about 48 random bits) marks a churn prompt


def prompt_markers(prompt: str, nonce: str) -> tuple[str, tuple[str, ...]]:
    """(owner, the text only this prompt holds): the tagged header `kvfence probe NONCE TAG:` (owner TAG), a golden
    prompt's heading `kvfence golden I:` (owner `golden I`, sent several times: its replies share the owner), and
    for a churn prompt every run of MARKER_WORDS consecutive random words of its body."""
    m = re.match(rf"kvfence probe {re.escape(nonce)} ([^:]+):", prompt)
    if m:
        owner, marks = m.group(1), [m.group(0)]
        if owner.startswith("churn"):
            body = prompt[m.end() :].split(". ", 1)[-1]
            words = _HEX_WORD_RE.findall(body)
            marks += [" ".join(words[i : i + MARKER_WORDS]) for i in range(len(words) - MARKER_WORDS + 1)]
        return owner, tuple(marks)
    g = _GOLDEN_HEAD_RE.match(prompt)
    if g:
        return "golden " + g.group(0)[len("kvfence golden ") : -1], (g.group(0),)
    return "", ()


@dataclass(frozen=True)
class ProbeConfig:
    url: str
    model: str
    context_length: int | None = None
    pool_tokens: int | None = None
    max_requests: int = 200
    time_budget_s: float = 120.0
    concurrency: int = 8
    request_timeout_s: float = 60.0
    max_tokens: int = 16
    golden: int = 4
    canaries: int = 8
    aborts: int = 4
    overlength_in_burst: int = 4
    churn: int = 1  # unrelated requests between a golden prompt's idle answer and its replay
    expect_deterministic: bool = False  # golden drift at temperature 0 is critical, not a warning
    allow_remote: bool = False
    api_key: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        assert self.max_requests > 0 and self.concurrency > 0 and self.time_budget_s > 0
        assert self.max_tokens > 0 and self.golden >= 0 and self.canaries >= 0 and self.aborts >= 0
        assert self.churn >= 0


@dataclass
class ProbeReport:
    url: str
    model: str
    facts: ServerFacts
    replies: list[Reply]
    findings: list[Finding]
    requests_sent: int
    elapsed_s: float
    stopped_early: str | None = None
    not_established: list[Limit] = field(default_factory=list)

    def summary_rows(self) -> list[tuple]:
        rows = []
        for check in sorted({r.check for r in self.replies}):
            rs = [r for r in self.replies if r.check == check]
            n200 = sum(r.status == 200 for r in rs)
            n4xx = sum(400 <= r.status < 500 for r in rs)
            other = len(rs) - n200 - n4xx
            bad = [f for f in self.findings if f.role == check]
            result = "FAIL" if any(f.severity == Severity.CRITICAL for f in bad) else ("WARN" if bad else "ok")
            if result == "ok" and any(r.failed for r in rs):
                result = "errors"
            rows.append((check, len(rs), n200, n4xx, other, result))
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "model": self.model,
            "facts": self.facts.__dict__,
            "requests_sent": self.requests_sent,
            "elapsed_s": round(self.elapsed_s, 3),
            "stopped_early": self.stopped_early,
            "checks": [
                dict(zip(("check", "sent", "ok_200", "rejected_4xx", "other", "result"), row, strict=True))
                for row in self.summary_rows()
            ],
            "findings": [f.to_dict() for f in self.findings],
            "not_established": [x._asdict() for x in self.not_established],
            "replies": [r.__dict__ for r in self.replies],
        }


# ---------------------------------------------------------------------------------------------
# Target check
# ---------------------------------------------------------------------------------------------


def check_target(url: str, allow_remote: bool) -> str:
    """Return the host; raise unless every address it resolves to is loopback (or allowed)."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise KvfenceError(f"probe needs an http(s) URL, got {url!r}")
    host = parsed.hostname
    if allow_remote:
        return host
    try:
        infos = socket.getaddrinfo(host, parsed.port or 80, proto=socket.IPPROTO_TCP)
    except OSError as e:
        raise KvfenceError(f"cannot resolve {host}: {e}") from e
    addrs = {str(info[4][0]) for info in infos}
    non_loopback = sorted(a for a in addrs if not ipaddress.ip_address(a.split("%")[0]).is_loopback)
    if non_loopback:
        raise KvfenceError(
            f"refusing to probe {host} ({', '.join(non_loopback)}): not a loopback address. The probe sends "
            "over-length prompts and bursts; run it only against servers you operate, and pass "
            "--i-am-authorised to confirm you are allowed to test this one."
        )
    return host


# ---------------------------------------------------------------------------------------------
# The probe
# ---------------------------------------------------------------------------------------------


class _Budget:
    def __init__(self, cfg: ProbeConfig) -> None:
        self.max_requests = cfg.max_requests
        self.deadline = time.monotonic() + cfg.time_budget_s
        self.sent = 0
        self.stopped: str | None = None

    def take(self) -> bool:
        if self.sent >= self.max_requests:
            self.stopped = self.stopped or f"request budget of {self.max_requests} reached"
            return False
        if time.monotonic() >= self.deadline:
            self.stopped = self.stopped or "time budget reached"
            return False
        self.sent += 1
        return True

    def remaining_s(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


class Prober:
    def __init__(self, cfg: ProbeConfig) -> None:
        import httpx

        self.cfg = cfg
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.client = httpx.AsyncClient(
            base_url=cfg.url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(cfg.request_timeout_s, connect=min(10.0, cfg.request_timeout_s)),
            limits=httpx.Limits(max_connections=cfg.concurrency + 2),
        )
        self.budget = _Budget(cfg)
        self.sem = asyncio.Semaphore(cfg.concurrency)
        self.replies: list[Reply] = []
        self.facts = ServerFacts()
        self.nonce = secrets.token_hex(4)
        self.has_tokenize = False
        self.sized = False  # prompt sizes can be computed (calibration worked)
        self.base_tokens = 0  # tokens of an empty-filler prompt, fitted
        self.per_unit = 1.0
        self.bar: Any = None  # the tqdm bar while run() runs

    # -- HTTP helpers --------------------------------------------------------------------------
    async def _get_json(self, path: str) -> Any | None:
        import httpx

        try:
            r = await self.client.get(path)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        try:
            return r.json()
        except ValueError:
            return None

    async def complete(
        self, check: str, prompt: str, sent: int | None, canary: str | None = None, max_tokens: int | None = None
    ) -> Reply | None:
        import httpx

        if not self.budget.take():
            return None
        body = {
            "model": self.cfg.model,
            "prompt": prompt,
            "max_tokens": max_tokens or self.cfg.max_tokens,
            "temperature": 0,
            "seed": 0,
        }
        owner, marks = prompt_markers(prompt, self.nonce)
        async with self.sem:
            try:
                r = await self.client.post(
                    "/v1/completions", json=body, timeout=min(self.cfg.request_timeout_s, self.budget.remaining_s() + 1)
                )
                reply = Reply(check, sent, r.status_code, canary=canary, owner=owner, markers=marks)
                if r.status_code == 200:
                    doc = r.json()
                    reply.text = "".join(str(c.get("text") or "") for c in doc.get("choices") or [])
                    reply.prompt_tokens = (doc.get("usage") or {}).get("prompt_tokens")
                    reply.server_integrity = _integrity_status(doc)
                else:
                    try:
                        reply.error = _error_text(r.json(), r.text)
                    except ValueError:
                        reply.error = r.text[:300]
            except (httpx.HTTPError, ValueError) as e:
                reply = Reply(
                    check, sent, 0, error=f"{type(e).__name__}: {e}"[:300], canary=canary, owner=owner, markers=marks
                )
        self._record(reply)
        return reply

    async def abort_midstream(self, check: str, prompt: str, canary: str | None) -> Reply | None:
        import httpx

        if not self.budget.take():
            return None
        body = {
            "model": self.cfg.model,
            "prompt": prompt,
            "max_tokens": max(8, self.cfg.max_tokens * 4),
            "temperature": 0,
            "stream": True,
        }
        owner, marks = prompt_markers(prompt, self.nonce)
        reply = Reply(check, None, -1, canary=canary, owner=owner, markers=marks)
        async with self.sem:
            try:
                async with self.client.stream("POST", "/v1/completions", json=body) as r:
                    reply.status = r.status_code if r.status_code != 200 else -1
                    if r.status_code == 200:
                        async for line in r.aiter_lines():
                            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                                try:
                                    chunk = json.loads(line[5:])
                                except ValueError:
                                    break
                                choices = chunk.get("choices") or []
                                reply.text += "".join(str(c.get("text") or "") for c in choices)
                                reply.server_integrity = _integrity_status(chunk)
                                if chunk.get("error") or any(c.get("finish_reason") == "error" for c in choices):
                                    reason = _error_text(chunk, "")
                                    if not reason:
                                        info = ((choices[0] if choices else {}).get("kvfence") or {}).get("integrity")
                                        reason = (info or {}).get("reason") or "finish_reason=error"
                                    reply.error = f"stream error: {reason}"[:300]
                                break  # abort after the first chunk: the connection closes here
            except httpx.HTTPError as e:
                reply.status, reply.error = 0, f"{type(e).__name__}: {e}"[:300]
        self._record(reply)
        return reply

    def _record(self, reply: Reply) -> None:
        self.replies.append(reply)
        if self.bar is not None:
            self.bar.update(1)

    # -- prompt sizing -------------------------------------------------------------------------
    def header(self, tag: str) -> str:
        return f"kvfence probe {self.nonce} {tag}:"

    async def count_tokens(self, text: str) -> int | None:
        import httpx

        try:
            r = await self.client.post("/tokenize", json={"model": self.cfg.model, "prompt": text})
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        try:
            doc = r.json()
        except ValueError:
            return None
        if isinstance(doc.get("count"), int):
            return doc["count"]
        if isinstance(doc.get("tokens"), list):
            return len(doc["tokens"])
        return None

    async def calibrate(self) -> None:
        """Fit tokens(prompt with k filler units) = base + per_unit * k."""
        a, b = 4, 20  # small enough to be under any real limit
        pa, pb = self.header("cal") + FILLER * a, self.header("cal") + FILLER * b
        ca, cb = await self.count_tokens(pa), await self.count_tokens(pb)
        if ca is not None and cb is not None:
            self.has_tokenize = True
            self.facts.counter = "/tokenize"
        else:
            ra = await self.complete("calibration", pa, None, max_tokens=1)
            rb = await self.complete("calibration", pb, None, max_tokens=1)
            if ra is None or rb is None:
                self.facts.counter = "unavailable: budget spent before calibration"
                return
            if ra.failed or rb.failed:  # the server is failing requests; reported as server-errors
                self.facts.counter = f"unavailable: calibration requests failed (HTTP {ra.status}, {rb.status})"
                return
            if not (ra.prompt_tokens and rb.prompt_tokens):
                raise KvfenceError(
                    "cannot count prompt tokens: no /tokenize and the calibration requests returned no "
                    "usage.prompt_tokens"
                )
            ca, cb = ra.prompt_tokens, rb.prompt_tokens
            self.facts.counter = "usage.prompt_tokens calibration"
        per_unit = (cb - ca) / (b - a)
        if not 0.2 <= per_unit <= 8:
            raise KvfenceError(
                f"token counting looks wrong: {a} and {b} filler words counted as {ca} and {cb} tokens "
                f"({self.facts.counter}); pass --context-length/--pool-tokens and check the server's /tokenize"
            )
        self.per_unit = per_unit
        self.base_tokens = round(ca - self.per_unit * a)
        self.sized = True

    async def prompt_of(self, tag: str, target: int) -> tuple[str, int]:
        """A prompt of `target` tokens (exact when /tokenize exists) and its counted size."""
        head = self.header(tag)
        k = max(0, round((target - self.base_tokens) / self.per_unit))
        text = head + FILLER * k
        if not self.has_tokenize:
            # Headers differ in token count (digits, tags): count this one with a small request first.
            k0 = 4
            r = await self.complete("calibration", head + FILLER * k0, None, max_tokens=1)
            base = self.base_tokens
            if r is not None and r.status == 200 and r.prompt_tokens:
                base = round(r.prompt_tokens - self.per_unit * k0)
            k = max(0, round((target - base) / self.per_unit))
            return head + FILLER * k, round(base + self.per_unit * k)
        n = await self.count_tokens(text)
        for _ in range(4):
            if n is None or n == target:
                break
            k = max(0, k + (1 if n < target else -1) * max(1, round(abs(target - n) / self.per_unit)))
            text = head + FILLER * k
            n = await self.count_tokens(text)
        if n is not None and n != target:  # filler granularity: pad the header with single characters
            for pad in ("x", " x", "xx"):
                cand = head + pad + FILLER * k
                m = await self.count_tokens(cand)
                if m == target:
                    return cand, m
        return text, n if n is not None else target

    # -- discovery -----------------------------------------------------------------------------
    async def discover(self) -> None:
        f = self.facts
        models = await self._get_json("/v1/models")
        max_model_len = None
        for card in (models or {}).get("data") or []:
            if isinstance(card, dict):
                f.models.append(str(card.get("id")))
                if isinstance(card.get("max_model_len"), int):
                    max_model_len = card["max_model_len"]
        found = await self._get_json("/server_info") or await self._get_json("/get_server_info")
        info: dict[str, Any] = found if isinstance(found, dict) else {}
        ctx_flag = info.get("context_length") if isinstance(info.get("context_length"), int) else None
        pool = info.get("max_total_num_tokens") if isinstance(info.get("max_total_num_tokens"), int) else None
        cap_doc = info.get("capacity")
        capacity: dict[str, Any] = cap_doc if isinstance(cap_doc, dict) else {}  # kvfence's /server_info
        if ctx_flag is None and isinstance(capacity.get("context_length"), int):
            ctx_flag = capacity["context_length"]
        if pool is None:
            cap = capacity.get("max_total_tokens")
            sizes = list(cap.values()) if isinstance(cap, dict) else [cap]
            ints = [x for x in sizes if isinstance(x, int)]
            if ints and len(ints) == len(sizes):
                pool = min(ints)  # the smallest role pool bounds what a request can hold
        if pool is None:
            for st in info.get("internal_states") or []:
                cap = ((st or {}).get("memory_usage") or {}).get("token_capacity")
                if isinstance(cap, int):
                    pool = cap
                    break
        if self.cfg.context_length:
            f.context_length, f.context_source = self.cfg.context_length, "--context-length"
        elif ctx_flag:
            f.context_length, f.context_source = ctx_flag, "/server_info context_length"
        elif max_model_len:
            f.context_length, f.context_source = max_model_len, "/v1/models max_model_len"
        if self.cfg.pool_tokens:
            f.pool_tokens, f.pool_source = self.cfg.pool_tokens, "--pool-tokens"
        elif pool:
            f.pool_tokens, f.pool_source = pool, "/server_info max_total_num_tokens"
        if models is None and not info:
            raise KvfenceError(f"{self.cfg.url} answered neither /v1/models nor /server_info; is it running?")

    # -- checks --------------------------------------------------------------------------------
    def golden_words(self) -> int:
        """Words of golden text: a prompt of several KV pages (a page is 1-64 tokens on real servers),
        about a third of the context so that it stays far below every limit."""
        ctx, pool = self.facts.context_length, self.facts.pool_tokens
        limit = min(x for x in (ctx, pool, 10**9) if x)
        return max(8, min(96, limit // 3 - 24))

    def golden_prompts(self) -> list[str]:
        topics = ["the alphabet", "prime numbers", "colours of the rainbow", "planets", "days of the week"]
        n = self.golden_words()
        out = []
        for i in range(self.cfg.golden):
            words = [GOLDEN_WORDS[(7 * i + 3 * j + j // 5) % len(GOLDEN_WORDS)] for j in range(n)]
            out.append(f"kvfence golden {i}: {' '.join(words)}. Now list {topics[i % len(topics)]} in order.")
        return out

    def churn_prompt(self, i: int, words: int) -> tuple[str, str]:
        """Unrelated text at least as long as a golden prompt, with its own canary: (prompt, canary)."""
        code = f"KVF{secrets.token_hex(6).upper()}"
        body = " ".join(secrets.token_hex(2) for _ in range(words))
        return f"{self.header(f'churn {i}')} The secret code is {code}. {body}", code

    async def golden_with_replay(self, golden: list[str]) -> tuple[list[Reply | None], list[Reply | None]]:
        """Each golden prompt idle, then `churn` unrelated requests, then the same prompt again (idle)."""
        base, replay = [], []
        for i, p in enumerate(golden):
            base.append(await self.complete("golden-idle", p, None))
            if self.cfg.churn == 0:
                continue
            for c in range(self.cfg.churn):
                prompt, code = self.churn_prompt(i * self.cfg.churn + c, self.golden_words())
                await self.complete("churn", prompt, None, canary=code)
            replay.append(await self.complete("golden-replay", p, None))
        return base, replay

    async def run(self) -> ProbeReport:
        t0 = time.monotonic()
        from tqdm import tqdm

        self.bar = tqdm(
            total=self.planned(),
            desc="kvfence probe",
            unit="req",
            file=sys.stderr,
            disable=not self.cfg.progress,
            leave=False,
        )
        try:
            await self.discover()
            await self.calibrate()
            golden = self.golden_prompts()
            base, replay = await self.golden_with_replay(golden)
            ctx, pool = self.facts.context_length, self.facts.pool_tokens
            if ctx and self.sized:
                for target in (ctx - 1, ctx, ctx + 1):
                    prompt, n = await self.prompt_of(f"boundary {target}", target)
                    await self.complete("boundary", prompt, n, max_tokens=1)
            if pool and ctx and pool < ctx and self.sized:
                for target in sorted({pool + 1, min(ctx - 1, pool + max(16, pool // 8))}):
                    if target > pool:
                        prompt, n = await self.prompt_of(f"pool {target}", target)
                        await self.complete("over-pool", prompt, n, max_tokens=1)
            await self.burst(golden, ctx, pool)
            after = [await self.complete("golden-after", p, None) for p in golden]
            findings = judge(
                self.replies,
                self.facts,
                base,
                after,
                replay,
                exact_counts=self.has_tokenize,
                sized=self.sized,
                expect_deterministic=self.cfg.expect_deterministic,
                stopped=self.budget.stopped,
            )
            not_established = limits(
                self.replies,
                self.facts,
                sized=self.sized,
                exact_counts=self.has_tokenize,
                expect_deterministic=self.cfg.expect_deterministic,
                churn=self.cfg.churn,
                stopped=self.budget.stopped,
            )
        finally:
            self.bar.close()
            await self.client.aclose()
        return ProbeReport(
            url=self.cfg.url,
            model=self.cfg.model,
            facts=self.facts,
            replies=self.replies,
            findings=findings,
            requests_sent=self.budget.sent,
            elapsed_s=time.monotonic() - t0,
            stopped_early=self.budget.stopped,
            not_established=not_established,
        )

    def planned(self) -> int:
        c = self.cfg
        n = 2 + (3 + 2 * c.churn) * c.golden + 3 * 2 + 2 * 2 + c.canaries + c.aborts + c.overlength_in_burst
        return min(n, c.max_requests)

    async def burst(self, golden: list[str], ctx: int | None, pool: int | None) -> None:
        """Canary requests, over-length prompts, mid-stream aborts and the golden set, all at once."""
        tasks = []
        limit = min(x for x in (ctx, pool) if x) if (ctx or pool) else None
        spread = max(1, (limit // 2 - 24) if limit else 256)  # canary lengths vary across pages, well in limits
        for i in range(self.cfg.canaries):
            code = f"KVF{secrets.token_hex(6).upper()}"
            pad = FILLER * ((4 + 37 * i) % spread)
            prompt = f"{self.header(f'canary {i}')} The secret code is {code}. Repeat the secret code:{pad} {code}"
            tasks.append(self.complete("canary", prompt, None, canary=code))
        for i in range(self.cfg.aborts):
            code = f"KVF{secrets.token_hex(6).upper()}"
            prompt = f"{self.header(f'abort {i}')} The secret code is {code}. Write a long story about it."
            tasks.append(self.abort_midstream("midstream-abort", prompt, code))
        if limit and self.sized:  # over-length prompts need a token count
            for i in range(self.cfg.overlength_in_burst):
                code = f"KVF{secrets.token_hex(6).upper()}"
                target = limit + 1 + 7 * i
                head = f"{self.header(f'long {i}')} The secret code is {code}."
                k = max(0, round((target - self.base_tokens) / self.per_unit)) + 4
                sent = round(self.base_tokens + self.per_unit * k)
                tasks.append(self.complete("overlength-burst", head + FILLER * k, sent, canary=code, max_tokens=4))
        for p in golden:
            tasks.append(self.complete("golden-load", p, None))
        order = list(range(len(tasks)))
        order = order[::2] + order[1::2]  # interleave kinds
        await asyncio.gather(*(tasks[i] for i in order))


def run_probe(cfg: ProbeConfig) -> ProbeReport:
    check_target(cfg.url, cfg.allow_remote)
    return asyncio.run(Prober(cfg).run())
