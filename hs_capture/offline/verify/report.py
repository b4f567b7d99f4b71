"""What verify found: one Finding per problem, gathered into a Report that renders as a
short table for people and as one JSON document for machines."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

ERROR = "error"
WARNING = "warning"

# Every check verify runs, in the order the table lists them, with what it proves.
CHECKS: "OrderedDict[str, str]" = OrderedDict([
    ("runs", "run metadata present and readable; the run captured something"),
    ("config", "one configuration (layers, hidden size, dtype, model) across runs and ranks"),
    ("ranks", "every writing rank (one per DP group) is present"),
    ("index", "index lines parse; no step missing or listed twice"),
    ("dropped", "no step dropped or failed by the writer"),
    ("files", "index and files agree: nothing missing, nothing extra, no temp file"),
    ("header", "every file header is valid"),
    ("truncated", "every file is as long as its header says"),
    ("checksum", "every tensor decodes and matches its crc32"),
    ("placement", "each file holds the run, rank, step and part its name says"),
    ("shapes", "dtypes, shapes and layer sets agree with the run metadata"),
    ("positions", "stored positions and tokens agree with the index"),
    ("coverage", "every sample covered from 0 to its end exactly once, in every layer"),
    ("tokens", "token ids equal the dataset's"),
    ("nonfinite", "no NaN or Inf"),
    ("degenerate", "no all-zero or constant tensor, no all-zero row"),
    ("identical", "no layer identical to another"),
    ("samples", "merged output: every sample present, with the keys, dtypes and shapes of its format"),
    ("reference", "recomputed samples equal the stored ones within tolerance"),
    ("status", "runs closed cleanly"),
])


@dataclass
class Finding:
    check: str
    message: str
    severity: str = ERROR
    path: Optional[str] = None
    rid: Optional[str] = None

    def line(self) -> str:
        where = " ".join(x for x in (self.path, f"rid={self.rid!r}" if self.rid is not None else None) if x)
        return f"{self.severity.upper()} [{self.check}] {where + ': ' if where else ''}{self.message}"


@dataclass
class Report:
    paths: List[str]
    findings: List[Finding] = field(default_factory=list)
    ran: Dict[str, int] = field(default_factory=dict)  # check -> items it looked at
    stats: Dict[str, Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, check: str, message: str, severity: str = ERROR, path: Optional[str] = None,
            rid: Optional[str] = None) -> None:
        assert check in CHECKS, check
        with self._lock:
            self.findings.append(Finding(check, message, severity, path, rid))

    def looked(self, check: str, n: int = 1) -> None:
        with self._lock:
            self.ran[check] = self.ran.get(check, 0) + n

    @property
    def ok(self) -> bool:
        return not any(f.severity == ERROR for f in self.findings)

    def table(self) -> List[Dict[str, Any]]:
        rows = []
        for check, what in CHECKS.items():
            errors = sum(1 for f in self.findings if f.check == check and f.severity == ERROR)
            warnings = sum(1 for f in self.findings if f.check == check and f.severity == WARNING)
            if check not in self.ran and not errors and not warnings:
                continue
            status = "FAIL" if errors else "warn" if warnings else "ok"
            rows.append({"check": check, "status": status, "checked": self.ran.get(check, 0),
                         "errors": errors, "warnings": warnings, "what": what})
        return rows

    def to_json(self) -> Dict[str, Any]:
        return {"ok": self.ok, "paths": self.paths, "checks": self.table(), "stats": self.stats,
                "findings": [asdict(f) for f in self.findings]}

    def render(self, max_per_check: int = 20) -> str:
        out = [f"{'check':<11} {'status':<6} {'checked':>8} {'errors':>7} {'warns':>6}  what"]
        for r in self.table():
            out.append(f"{r['check']:<11} {r['status']:<6} {r['checked']:>8} {r['errors']:>7} "
                       f"{r['warnings']:>6}  {r['what']}")
        shown: Dict[str, int] = {}
        details = []
        for f in sorted(self.findings, key=lambda f: (f.severity != ERROR, list(CHECKS).index(f.check))):
            shown[f.check] = shown.get(f.check, 0) + 1
            if shown[f.check] <= max_per_check:
                details.append(f.line())
            elif shown[f.check] == max_per_check + 1:
                details.append(f"... more [{f.check}] findings: see --json")
        if details:
            out += [""] + details
        errors = sum(1 for f in self.findings if f.severity == ERROR)
        warnings = len(self.findings) - errors
        out.append("")
        out.append(("PASS" if self.ok else "FAIL") + f": {errors} error(s), {warnings} warning(s)"
                   + "".join(f", {k}={v}" for k, v in self.stats.items() if isinstance(v, (int, float, str))))
        return "\n".join(out)
