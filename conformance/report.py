"""The conformance report: one `CheckResult` per check, written as `report.json` and `report.md`.

Statuses: pass; fail (a claim or an invariant does not hold); error (the check could not run:
a crash in the platform counts as fail, a crash in the suite as error); skip (not applicable,
with the reason); info (measured but not claimed, e.g. batch invariance of an op declared only
`run_to_run`). The run fails when any check is fail or error.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
from typing import Any, Literal

from pydantic import BaseModel, Field

from shuili.conformance.compare import Divergence

Status = Literal["pass", "fail", "error", "skip", "info"]
FAILING = ("fail", "error")


class CheckResult(BaseModel):
    name: str  # e.g. "op.linear.batch_invariance", "engine.tiny-v4.greedy.chunking"
    kind: Literal["op", "engine", "baseline", "replay", "control"]
    status: Status
    level: str | None = None  # the determinism level the check holds the platform to
    message: str = ""
    seeds: list[int] = Field(default_factory=list)  # every seed used: rerun with --seed to replay
    cases: int = 0
    divergence: Divergence | None = None
    details: dict[str, Any] = Field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.status in FAILING


class Report(BaseModel):
    platform: str
    reference: str = "reference"
    started: str = Field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat())
    duration_s: float = 0.0
    seed: int = 0
    command: str = ""
    fingerprint: dict[str, Any] = Field(default_factory=dict)
    capabilities: dict[str, Any] = Field(default_factory=dict)
    checks: list[CheckResult] = Field(default_factory=list)

    def add(self, results) -> None:
        self.checks.extend([results] if isinstance(results, CheckResult) else results)

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in ("pass", "fail", "error", "skip", "info")}
        for c in self.checks:
            out[c.status] += 1
        return out

    @property
    def passed(self) -> bool:
        return not any(c.failed for c in self.checks)

    def failures(self) -> list[CheckResult]:
        return [c for c in self.checks if c.failed]

    def get(self, name: str) -> CheckResult:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r} in the report; have {[c.name for c in self.checks]}")


def write(report: Report, out_dir: str) -> tuple[str, str]:
    """Write DIR/report.json and DIR/report.md; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    js, md = os.path.join(out_dir, "report.json"), os.path.join(out_dir, "report.md")
    data = report.model_dump(mode="json")
    data["summary"] = {"passed": report.passed, **report.counts()}
    with open(js, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    with open(md, "w") as f:
        f.write(render_markdown(report))
    return js, md


def load(path: str) -> Report:
    with open(path) as f:
        data = json.load(f)
    data.pop("summary", None)
    return Report.model_validate(data)


_MARK = {"pass": "PASS", "fail": "**FAIL**", "error": "**ERROR**", "skip": "skip", "info": "info"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(report: Report) -> str:
    counts = report.counts()
    verdict = "PASSED" if report.passed else "FAILED"
    lines = [
        f"# shuili conformance: platform `{report.platform}`: {verdict}",
        "",
        f"- started {report.started}, {report.duration_s:.1f} s; seed {report.seed}",
        f"- command: `{report.command}`" if report.command else "- command: (library call)",
        "- checks: " + ", ".join(f"{k} {v}" for k, v in counts.items()),
        "- stack: " + ", ".join(f"{k}={v}" for k, v in sorted(report.fingerprint.items())
                                if not isinstance(v, dict)),
        "",
    ]
    fails = report.failures()
    if fails:
        lines += ["## Failures", ""]
        for c in fails:
            lines.append(f"### {c.name} ({c.level or '-'})")
            lines.append("")
            lines.append(c.message or "(no message)")
            if c.divergence is not None:
                lines.append("")
                lines.append(f"First divergence {c.divergence.line()}")
            case = c.details.get("case")
            if case:
                lines.append("")
                lines.append(f"Case: `{case}`; seeds {c.seeds[:8]}")
            lines.append("")
    lines += ["## All checks", "", "| check | level | status | detail |", "|---|---|---|---|"]
    for c in report.checks:
        detail = c.message
        if c.divergence is not None and c.status != "pass":
            detail += "; first divergence " + c.divergence.line()
        lines.append(f"| {c.name} | {c.level or '-'} | {_MARK[c.status]} | {_cell(detail)} |")
    lines += ["", "How to read this: see docs/conformance.md.", ""]
    return "\n".join(lines)
