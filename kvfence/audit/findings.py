"""Findings shared by the operator tools (`audit sglang`, `audit logs`, `probe`).

What it knows: a finding is one rule that fired, with a severity, the role it is about
(prefill, decode, both, a time window...), a sentence saying what is wrong, a sentence
saying how to fix it, and where it shows (`Location`s: a file or URL and, for a file, the 1-based line: the log
line that is the evidence, the launch-script line that sets the flag); the exit code of a tool that ran to the end
is the worst severity it found (0 clean, 1 warnings, 2 critical; kvfence.audit.exit_status has the codes of a tool
that could not check); findings print as a plain aligned text table, as JSON, as SARIF 2.1.0 (one result per
finding, levels error/warning/note, physical locations with the line, an invocation that says whether the tool ran
to the end) and as JUnit XML (one test case per rule the tool checked, failed when that rule fired at warning or
above), so CI systems and code-scanning views can show them.
What it does not know: any rule. Each tool owns its rules and lists them as `Rule`s.
"""

from __future__ import annotations

import enum
import json
import re
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote
from xml.etree import ElementTree as ET


class Severity(enum.IntEnum):
    INFO = 0
    WARNING = 1
    CRITICAL = 2

    @property
    def label(self) -> str:
        return self.name.lower()


class Location(NamedTuple):
    """A place a finding shows: a file path or URL as the operator gave it, and the 1-based line in that file."""

    uri: str
    line: int | None = None

    def to_dict(self) -> dict:
        return {"where": self.uri, "line": self.line} if self.line else {"where": self.uri}


@dataclass(frozen=True)
class Finding:
    rule: str  # stable identifier, e.g. "context-exceeds-pool"
    severity: Severity
    role: str  # "prefill", "decode", "both", "server", a request id or a time window
    message: str  # what is wrong, with the numbers that show it
    fix: str  # what the operator should change
    where: str = ""  # the input it was read from (file path or URL), when one
    line: int | None = None  # the 1-based line of `where` that shows it (a log line, a launch-script line)
    also: tuple[Location, ...] = ()  # further places: the other side's file, the next log lines of the same kind

    @property
    def locations(self) -> list[Location]:
        """Every place it shows, the main one first."""
        first = [Location(self.where, self.line)] if self.where else []
        return first + [loc for loc in self.also if loc.uri]

    def to_dict(self) -> dict:
        out: dict = {
            "rule": self.rule,
            "severity": self.severity.label,
            "role": self.role,
            "message": self.message,
            "fix": self.fix,
        }
        if self.where:
            out["where"] = self.where
        if self.line:
            out["line"] = self.line
        if self.also:
            out["also"] = [loc.to_dict() for loc in self.also]
        return out


class Rule(NamedTuple):
    id: str
    summary: str


def exit_code(findings: Iterable[Finding]) -> int:
    """0 when nothing above INFO fired, 1 for warnings, 2 for anything critical."""
    worst = max((int(f.severity) for f in findings), default=0)
    return worst


def sort_findings(findings: Iterable[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: (-int(f.severity), f.rule, f.role))


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]], wrap: dict[int, int] | None = None) -> str:
    """A plain text table with aligned columns; `wrap` maps a column index to its max width.

    Wrapped cells continue on following lines in the same column, so long messages stay readable
    in a terminal without any table library.
    """
    wrap = wrap or {}
    cells: list[list[list[str]]] = []  # row -> column -> lines
    all_rows: list[list[object]] = [list(headers), *[list(r) for r in rows]]
    for values in all_rows:
        out_row: list[list[str]] = []
        for i, value in enumerate(values):
            text = "" if value is None else str(value)
            width = wrap.get(i)
            lines = textwrap.wrap(text, width) if width and len(text) > width else [text]
            out_row.append(lines or [""])
        cells.append(out_row)
    ncol = len(headers)
    widths = [max(len(line) for row in cells for line in row[i]) for i in range(ncol)]
    out: list[str] = []
    for r, row in enumerate(cells):
        height = max(len(c) for c in row)
        for k in range(height):
            parts = [(row[i][k] if k < len(row[i]) else "").ljust(widths[i]) for i in range(ncol)]
            out.append("  ".join(parts).rstrip())
        if r == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def findings_table(findings: Sequence[Finding]) -> str:
    if not findings:
        return "no findings"
    rows = [(f.severity.label.upper(), f.rule, f.role, f.message, f.fix) for f in sort_findings(findings)]
    return render_table(["SEVERITY", "RULE", "ROLE", "FINDING", "FIX"], rows, wrap={3: 60, 4: 50})


def summary_line(findings: Sequence[Finding]) -> str:
    n_crit = sum(f.severity == Severity.CRITICAL for f in findings)
    n_warn = sum(f.severity == Severity.WARNING for f in findings)
    n_info = sum(f.severity == Severity.INFO for f in findings)
    return f"{n_crit} critical, {n_warn} warning(s), {n_info} info; exit code {exit_code(findings)}"


def dumps(obj: object) -> str:
    return json.dumps(obj, indent=2, sort_keys=False, default=str)


_SARIF_LEVEL = {Severity.CRITICAL: "error", Severity.WARNING: "warning", Severity.INFO: "note"}


def _all_rules(rules: Sequence[Rule], findings: Sequence[Finding]) -> list[Rule]:
    known = {r.id for r in rules}
    extra = sorted({f.rule for f in findings} - known)
    return [*rules, *(Rule(r, r) for r in extra)]


_URL_RE = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://")


def artifact_uri(where: str) -> str | None:
    """A SARIF artifact URI for a path or URL as the operator gave it: URLs as they are, absolute paths as file://
    URIs, relative paths as relative references (code-scanning views resolve them against the checkout); None for
    what is no artifact (a command line given literally)."""
    if not where or where == "command line":
        return None
    if _URL_RE.match(where):
        return where
    path = Path(where)
    if path.is_absolute():
        return path.as_uri()
    return quote(path.as_posix())


def _sarif_location(loc: Location) -> dict | None:
    uri = artifact_uri(loc.uri)
    if uri is None:
        return None
    physical: dict = {"artifactLocation": {"uri": uri}}
    if loc.line and not _URL_RE.match(loc.uri):
        physical["region"] = {"startLine": loc.line}
    return {"physicalLocation": physical}


def to_sarif(
    tool: str, version: str, rules: Sequence[Rule], findings: Sequence[Finding], error: str | None = None
) -> dict:
    """A SARIF 2.1.0 log with one run: the tool's rules, one result per finding with its locations, and one
    invocation that says whether the tool ran to the end (`error`: why it could not check, then no results)."""
    catalogue = _all_rules(rules, findings)
    index = {r.id: i for i, r in enumerate(catalogue)}
    results = []
    for f in sort_findings(findings):
        result: dict = {
            "ruleId": f.rule,
            "ruleIndex": index[f.rule],
            "level": _SARIF_LEVEL[f.severity],
            "message": {"text": f"{f.message} Fix: {f.fix}"},
            "properties": {"role": f.role, "severity": f.severity.label},
        }
        places = [p for p in (_sarif_location(loc) for loc in f.locations) if p is not None]
        if places:
            result["locations"] = places[:1]
        if len(places) > 1:
            result["relatedLocations"] = [{"id": i, **p} for i, p in enumerate(places[1:], start=1)]
        results.append(result)
    invocation: dict = {"executionSuccessful": error is None}
    if error is not None:
        invocation["toolExecutionNotifications"] = [{"level": "error", "message": {"text": error}}]
    return {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": tool,
                        "version": version,
                        "rules": [{"id": r.id, "shortDescription": {"text": r.summary}} for r in catalogue],
                    }
                },
                "invocations": [invocation],
                "results": results,
            }
        ],
    }


def _at(f: Finding) -> str:
    return f" ({f.where}:{f.line})" if f.where and f.line else (f" ({f.where})" if f.where else "")


def to_junit(tool: str, rules: Sequence[Rule], findings: Sequence[Finding], error: str | None = None) -> str:
    """JUnit XML: one test case per rule; it fails when the rule fired at warning or critical. `error`: the tool
    could not check, so every case is an error (nothing was checked), never a pass."""
    catalogue = _all_rules(rules, findings)
    by_rule: dict[str, list[Finding]] = {}
    for f in findings:
        by_rule.setdefault(f.rule, []).append(f)
    suites = ET.Element("testsuites", name=tool)
    failures = sum(1 for r in catalogue if any(f.severity > Severity.INFO for f in by_rule.get(r.id, [])))
    suite = ET.SubElement(suites, "testsuite", name=tool, tests=str(len(catalogue)), failures=str(failures))
    suite.set("errors", str(len(catalogue) if error is not None else 0))
    suite.set("skipped", "0")
    for r in catalogue:
        if error is not None:
            case = ET.SubElement(suite, "testcase", classname=tool, name=r.id)
            ET.SubElement(case, "error", message=error[:200], type="tool-error").text = error
            continue
        case = ET.SubElement(suite, "testcase", classname=tool, name=r.id)
        fired = sort_findings(by_rule.get(r.id, []))
        text = "\n".join(f"[{f.severity.label}] {f.role}: {f.message} Fix: {f.fix}{_at(f)}" for f in fired)
        if fired and fired[0].severity > Severity.INFO:
            fail = ET.SubElement(case, "failure", message=fired[0].message[:200], type=fired[0].severity.label)
            fail.text = text
        elif fired:
            ET.SubElement(case, "system-out").text = text
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"
