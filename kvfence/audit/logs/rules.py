"""The rules of `kvfence audit logs`: what in a scanned pair of SGLang logs is a finding, how severe, and where.

What it knows: each rule (`RULES`) and the finding it raises from what the scanner gathered (counts of notable
requests per kind, the aborts' verdicts, each run's settings, checksum coverage, canary lines, what each file held
at all), with the file and log line that show it (the first few lines of a kind: the first as the finding's place,
the rest as further places), and the release each rule judged by. A file that held nothing SGLang writes, no
start-up line or no request line is a finding, never silence.
What it does not know: how the lines were read (kvfence.audit.logs.scanner).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfence.audit import sglang_releases as rel
from kvfence.audit.findings import Finding, Location, Rule, Severity
from kvfence.audit.logs.notes import NoteBook
from kvfence.audit.logs.run import Run
from kvfence.audit.logs.scanner import Scanner

RULES = [
    Rule("aborted-but-transferred", "a request aborted on prefill was handed to decode anyway"),
    Rule("possible-stub-handoff", "a release that hands rejected prompts to decode rejected one; no line confirms it"),
    Rule("placeholder-signature", "decode finished a request whose prompt was 1 token"),
    Rule("checksum-mismatch", "the KV checksum caught corrupted or foreign KV"),
    Rule("context-corruption", "decode caught metadata of another request"),
    Rule("kv-canary-violation", "the KV canary found stale or foreign KV in an engine's pool"),
    Rule("kv-canary-coverage-gap", "the KV canary skipped verification"),
    Rule("kv-canary-perturbation", "the KV canary's test perturbation was on"),
    Rule("pool-below-context", "a server ran with a KV pool below its context length"),
    Rule("over-pool-served", "prefill processed an input above its KV pool"),
    Rule("deferred-release-timeout", "decode released held pages without prefill's drain acknowledgement"),
    Rule("auto-truncated", "prompts were silently truncated"),
    Rule("transfer-failures", "KV transfer or bootstrap failures"),
    Rule("too-long-unmatched", "a prefill abort could not be followed to decode"),
    Rule("over-pool-requests", "requests above the context or pool limit (refused)"),
    Rule("checksum-skipped", "decoded requests admitted with the KV checksum skipped"),
    Rule("checksum-absent", "decoded requests ran without a KV checksum"),
    Rule("release-unknown", "the start-up line names no release 0.5.19 .. 0.5.23"),
    Rule("log-unrecognised", "a file holds no line SGLang writes"),
    Rule("no-startup-line", "a log without the server_args / start-up lines"),
    Rule("no-request-lines", "a log without any per-request line"),
    Rule("model-filter-matched-nothing", "--model excluded every server run"),
]

MORE_PLACES = 9  # further places a finding lists after its first


class Places:
    """Locations of findings: a side's file and a line in it."""

    def __init__(self, files: dict[str, str], book: NoteBook) -> None:
        self.files = files
        self.book = book

    def of(self, side: str, line: int | None = None) -> tuple[str, int | None, tuple[Location, ...]]:
        return self.files.get(side, ""), line, ()

    def of_kinds(self, *kinds: str, default_side: str = "prefill") -> tuple[str, int | None, tuple[Location, ...]]:
        """The first note of these kinds as (where, line), the next ones as further places."""
        places = [(self.files.get(s, ""), line) for s, line in self.book.places(*kinds)]
        if not places:
            return self.files.get(default_side, ""), None, ()
        (where, line), rest = places[0], places[1 : 1 + MORE_PLACES]
        return where, line, tuple(Location(w, n) for w, n in rest)

    def of_places(self, places: Sequence[tuple[str, int | None]]) -> tuple[str, int | None, tuple[Location, ...]]:
        """(side, line) places, prefill before decode in file order: the first as the place, the next as further."""
        known = sorted(((s, n) for s, n in places if n), key=lambda p: (p[0] != "prefill", p[1]))
        if not known:
            return self.files.get(places[0][0] if places else "prefill", ""), None, ()
        located = [(self.files.get(s, ""), n) for s, n in known[: 1 + MORE_PLACES]]
        return located[0][0], located[0][1], tuple(Location(w, n) for w, n in located[1:])

    def of_lines(self, side: str, lines: Sequence[int | None]) -> tuple[str, int | None, tuple[Location, ...]]:
        known = [n for n in lines if n]
        where = self.files.get(side, "")
        if not known:
            return where, None, ()
        return where, known[0], tuple(Location(where, n) for n in known[1 : 1 + MORE_PLACES])


def _finding(rule: str, sev: Severity, role: str, message: str, fix: str, at: tuple) -> Finding:
    where, line, also = at
    return Finding(rule, sev, role, message, fix, where, line, also)


def pool_severity(v: rel.Version | None) -> tuple[Severity, str]:
    reaches = rel.stub_reaches_decode(v)
    if reaches:
        return Severity.CRITICAL, f"in SGLang {rel.label(v)} an over-pool prompt is {rel.stub_fate(v)}"
    if reaches is None:
        return Severity.WARNING, "release unknown: in 0.5.19 an over-pool prompt is handed to decode as a stub"
    return Severity.WARNING, f"SGLang {rel.label(v)} refuses such prompts ({rel.stub_fate(v)})"


def abort_findings(sc: Scanner, at: Places, verdicts: dict[str, list[tuple[str, str, int | None]]]) -> list[Finding]:
    """From the verdicts on prefill aborts: status prefix -> [(window label, side, line of the evidence)]."""
    out: list[Finding] = []

    def places(*heads: str) -> tuple[str, int | None, tuple[Location, ...]]:
        return at.of_places([(side, line) for h in heads for _, side, line in verdicts.get(h, [])])

    transferred = verdicts.get("TRANSFERRED", [])
    if transferred:
        wins = sorted({w for w, _, _ in transferred})
        place = places("TRANSFERRED")
        out.append(
            _finding(
                "aborted-but-transferred", Severity.CRITICAL, "requests",
                f"{len(transferred)} request(s) were aborted on prefill as too long and their KV was still handed over "
                f"(decode decoded them, or prefill logged a completed transfer); their responses may contain another "
                f"request's KV (windows: {', '.join(wins)})",
                "treat those responses as suspect; upgrade to SGLang >= 0.5.22 and keep context length <= pool",
                place,
            )
        )  # fmt: skip
    possible, by_rule = verdicts.get("POSSIBLE", []), verdicts.get("HANDED OVER", [])
    if possible or by_rule:
        parts = []
        if possible:
            parts.append(f"{len(possible)} processed on prefill as the 1-token stub (ReqTimeStats)")
        if by_rule:
            parts.append(f"{len(by_rule)} decided by the release rule alone (no ReqTimeStats or request log line)")
        out.append(
            _finding(
                "possible-stub-handoff", Severity.WARNING, "requests",
                f"{len(possible) + len(by_rule)} request(s) were rejected on a prefill release that hands the 1-token "
                f"stub to decode ({'; '.join(parts)}); no decode record confirms or rules out that decode served them",
                "audit the decode log of the same period with --enable-request-time-stats-logging or --log-requests on "
                "both sides; upgrade to SGLang >= 0.5.22",
                places("POSSIBLE", "HANDED OVER"),
            )
        )  # fmt: skip
    unmatched = verdicts.get("unknown", [])
    if unmatched:
        out.append(
            _finding(
                "too-long-unmatched", Severity.WARNING, "requests",
                f"{len(unmatched)} too-long abort(s) on prefill could not be followed to decode, and the release that "
                "would decide their fate is unknown",
                "pass --sglang-version, or enable --enable-request-time-stats-logging or --log-requests on both sides "
                "to join by bootstrap_room",
                places("unknown"),
            )
        )  # fmt: skip
    return out


def count_findings(sc: Scanner, at: Places) -> list[Finding]:
    """One finding per kind of notable line that appeared, with its count."""
    out: list[Finding] = []
    for kinds, rule, sev, what, fix in (
        (("placeholder_signature",), "placeholder-signature", Severity.CRITICAL,
         "decode finished request(s) with prompt_tokens=1 (a 1-token stub was decoded as if complete)",
         "treat those responses as suspect; upgrade to SGLang >= 0.5.22"),
        (("checksum_mismatch",), "checksum-mismatch", Severity.CRITICAL,
         "KV checksum mismatch(es): corrupted or foreign KV reached decode (rejected with 500)",
         "find the transfer path that corrupts pages; check transfer failures in the same windows"),
        (("context_corruption",), "context-corruption", Severity.CRITICAL,
         "decode detected context corruption (metadata room mismatch)",
         "check deferred release and transfer failures around these times"),
        (("kv_canary_violation",), "kv-canary-violation", Severity.CRITICAL,
         "KV canary violation(s): an engine's pool held stale or foreign KV",
         "treat responses in those windows as suspect; the canary checks one engine's pool, so pair it with the KV "
         "checksum for the handoff"),
        (("over_pool_served",), "over-pool-served", Severity.CRITICAL,
         "prefill processed request(s) whose input exceeded its KV pool",
         "keep context length <= pool on both sides"),
        (("deferred_release_timeout",), "deferred-release-timeout", Severity.WARNING,
         "decode released KV pages without prefill's drain acknowledgement",
         "raise SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT on decode and check prefill health "
         "(decode holds pages; prefill has no deferred release to configure)"),
        (("truncated",), "auto-truncated", Severity.WARNING,
         "prompt(s) were silently truncated (--allow-auto-truncate)",
         "turn --allow-auto-truncate off on both sides"),
        (("transfer_failed", "bootstrap_failed"), "transfer-failures", Severity.WARNING,
         "KV transfer or bootstrap failure line(s)", "check network/transfer-engine health and the bootstrap server; "
         "with Mooncake, bound batches with SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES (SGLang >= 0.5.20)"),
    ):  # fmt: skip
        n = sc.book.count(*kinds)
        if n:
            out.append(_finding(rule, sev, "requests", f"{n} {what}", fix, at.of_kinds(*kinds)))
    over_pool = sc.book.count("too_long", "kv_budget", "over_capacity", "over_context")
    if over_pool:
        out.append(
            _finding(
                "over-pool-requests", Severity.INFO, "requests",
                f"{over_pool} request(s) had an input above the context or pool limit (listed per request)",
                "compare with the aborted-but-transferred rule; rejected requests alone are not a leak",
                at.of_kinds("too_long", "kv_budget", "over_capacity", "over_context"),
            )
        )  # fmt: skip
    return out


def run_findings(sc: Scanner, runs: list[Run], at: Places) -> list[Finding]:
    """Pool against context per run, release not told, canary coverage and perturbation, checksum coverage."""
    out: list[Finding] = []
    for r in runs:
        if not r.counted:
            continue
        v = rel.parse_version(r.version)
        if r.pool_warning or (r.pool_tokens and r.context_len and r.context_len > r.pool_tokens):
            sev, why = pool_severity(v)
            out.append(
                _finding(
                    "pool-below-context", sev, r.side,
                    f"the run started {r.start or '?'} had a KV pool of {r.pool_tokens} tokens below its context "
                    f"length {r.context_len}; one full-length request cannot fit; {why}",
                    f"lower --context-length to <= {r.pool_tokens} or give the pool more memory on {r.side}",
                    at.of(r.side, r.pool_line or r.line),
                )
            )  # fmt: skip
        if r.start and r.version is None and r.version_source.startswith("server_args"):
            out.append(
                _finding(
                    "release-unknown", Severity.INFO, r.side,
                    f"the run started {r.start}: {r.version_source}; release-dependent verdicts say 'unknown'",
                    "pass --sglang-version X.Y.Z to judge by a release",
                    at.of(r.side, r.line),
                )
            )  # fmt: skip
    if sc.canary_overflow and sc.canary_overflow_first is not None:
        side, ts, line = sc.canary_overflow_first
        out.append(
            _finding(
                "kv-canary-coverage-gap", Severity.WARNING, "/".join(sorted(sc.canary_overflow_sides)),
                f"{sc.canary_overflow} step(s) skipped the per-forward canary verify (overflow), first at {ts}: those "
                "forwards ran unchecked",
                "check the pool sizing the warning names; raise the canary's capacity or lower batch size",
                at.of(side, line),
            )
        )  # fmt: skip
    if sc.canary_perturb and sc.canary_perturb_first is not None:
        side, ts, line = sc.canary_perturb_first
        out.append(
            _finding(
                "kv-canary-perturbation", Severity.INFO, "servers",
                f"the canary's test perturbation ran ({sc.canary_perturb} line(s), first at {ts}): violations in these "
                "logs may have been injected on purpose",
                "turn the canary perturbation off outside tests",
                at.of(side, line),
            )
        )  # fmt: skip
    coverage = sc.coverage
    decode_runs = [r for r in runs if r.side == "decode" and r.counted]
    if coverage.get("skipped"):
        skip_lines = [r.checksum_skipped_line for r in decode_runs if r.checksum_skipped_line]
        out.append(
            _finding(
                "checksum-skipped", Severity.WARNING, "requests",
                f"{coverage['skipped']} decoded request(s) were admitted with the KV checksum skipped (layout differs "
                "or checksum on one side only)",
                "make both sides' KV layouts identical and enable the checksum on both",
                at.of_lines("decode", skip_lines) if skip_lines else at.of("decode"),
            )
        )  # fmt: skip
    if coverage.get("absent"):
        any_version = next((rel.parse_version(r.version) for r in runs if r.version), None)
        old = any_version is not None and rel.has_kv_checksum(any_version) is False
        start_lines = [r.line for r in decode_runs if r.checksum is False]
        out.append(
            _finding(
                "checksum-absent", Severity.WARNING, "requests",
                f"{coverage['absent']} decoded request(s) ran without a KV checksum"
                + (f" (SGLang {rel.label(any_version)} has none)" if old else ""),
                "upgrade to SGLang >= 0.5.22: the KV checksum exists from 0.5.21" if old
                else "start both sides with --disaggregation-enable-kv-checksum (SGLang >= 0.5.21)",
                at.of_lines("decode", start_lines),
            )
        )  # fmt: skip
    return out


def input_findings(sc: Scanner, runs: list[Run], files: dict[str, str], model: str | None) -> list[Finding]:
    """Say loudly when a file held nothing we recognise: no findings must never mean 'not read'."""
    out: list[Finding] = []
    for side, path in files.items():
        side_runs = [r for r in runs if r.side == side and r.start]
        if sc.side_lines.get(side, 0) == 0:
            out.append(
                Finding(
                    "log-unrecognised", Severity.WARNING, side,
                    f"{path} holds no line in a format SGLang 0.5.19 .. 0.5.23 writes (start-up, batch or request "
                    "lines); nothing was checked for it",
                    "give the SGLang server's own log (stdout/stderr of the launch), not a router or proxy log",
                    path,
                )
            )  # fmt: skip
            continue
        if not side_runs:
            out.append(
                Finding(
                    "no-startup-line", Severity.WARNING, side,
                    f"{path} has no `server_args=` or `max_total_num_tokens=` start-up line: the model, release, KV "
                    "checksum and pool size of this server are unknown, so coverage and pool rules could not run",
                    "include the log from the server's start (or pass --sglang-version and audit the configuration "
                    "with `kvfence audit sglang`)",
                    path,
                )
            )  # fmt: skip
        if sc.side_request_lines.get(side, 0) == 0:
            out.append(
                Finding(
                    "no-request-lines", Severity.WARNING, side,
                    f"{path} has no per-request line (ReqTimeStats, --log-requests, or an abort line): no request "
                    "could be followed through the handoff",
                    "start SGLang with --enable-request-time-stats-logging (or --log-requests)",
                    path,
                )
            )  # fmt: skip
    if model is not None and not any(r.counted and r.start for r in runs):
        out.append(
            Finding(
                "model-filter-matched-nothing", Severity.WARNING, "servers",
                f"--model {model!r} matched no server run ({len([r for r in runs if r.start])} run(s) seen: "
                + ", ".join(sorted({r.model or '?' for r in runs if r.start})) + "); nothing was counted",
                "check the model name against the runs listed (served_model_name or model_path)",
            )
        )  # fmt: skip
    return out
