"""Findings shared by the operator tools (`audit sglang`, `audit logs`, `probe`).

What it knows: a finding is one rule that fired, with a severity, the role it is about
(prefill, decode, both, a time window...), a sentence saying what is wrong and a sentence
saying how to fix it; the exit code of a tool is the worst severity it found (0 clean,
1 warnings, 2 critical); findings print as a plain aligned text table, as JSON, as SARIF 2.1.0 (one result per
finding, levels error/warning/note) and as JUnit XML (one test case per rule the tool checked, failed when that
rule fired at warning or above), so CI systems can show them.
What it does not know: any rule. Each tool owns its rules and lists them as `Rule`s.
"""

from __future__ import annotations

import enum
import json
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple
from xml.etree import ElementTree as ET


class Severity(enum.IntEnum):
    INFO = 0
    WARNING = 1
    CRITICAL = 2

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class Finding:
    rule: str  # stable identifier, e.g. "context-exceeds-pool"
    severity: Severity
    role: str  # "prefill", "decode", "both", "server", a request id or a time window
    message: str  # what is wrong, with the numbers that show it
    fix: str  # what the operator should change
    where: str = ""  # the input it was read from (file path or URL), when one

    def to_dict(self) -> dict:
        out = {
            "rule": self.rule,
            "severity": self.severity.label,
            "role": self.role,
            "message": self.message,
            "fix": self.fix,
        }
        if self.where:
            out["where"] = self.where
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
    for row in [list(headers), *[list(r) for r in rows]]:
        out_row = []
        for i, value in enumerate(row):
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


def to_sarif(tool: str, version: str, rules: Sequence[Rule], findings: Sequence[Finding]) -> dict:
    """A SARIF 2.1.0 log with one run: the tool's rules and one result per finding."""
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
        if f.where:
            result["locations"] = [{"physicalLocation": {"artifactLocation": {"uri": f.where}}}]
        results.append(result)
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
                "results": results,
            }
        ],
    }


def to_junit(tool: str, rules: Sequence[Rule], findings: Sequence[Finding]) -> str:
    """JUnit XML: one test case per rule; it fails when the rule fired at warning or critical."""
    catalogue = _all_rules(rules, findings)
    by_rule: dict[str, list[Finding]] = {}
    for f in findings:
        by_rule.setdefault(f.rule, []).append(f)
    suites = ET.Element("testsuites", name=tool)
    failures = sum(1 for r in catalogue if any(f.severity > Severity.INFO for f in by_rule.get(r.id, [])))
    suite = ET.SubElement(suites, "testsuite", name=tool, tests=str(len(catalogue)), failures=str(failures))
    suite.set("errors", "0")
    suite.set("skipped", "0")
    for r in catalogue:
        case = ET.SubElement(suite, "testcase", classname=tool, name=r.id)
        fired = sort_findings(by_rule.get(r.id, []))
        text = "\n".join(f"[{f.severity.label}] {f.role}: {f.message} Fix: {f.fix}" for f in fired)
        if fired and fired[0].severity > Severity.INFO:
            fail = ET.SubElement(case, "failure", message=fired[0].message[:200], type=fired[0].severity.label)
            fail.text = text
        elif fired:
            ET.SubElement(case, "system-out").text = text
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"
