"""The fidelity matrix: every sglang release this checkout has a venv for x every model
family, each pair served for real on this CPU and compared with transformers (float32).

    python -m tests.sglang_cpu.matrix [--releases 0.5.10,0.5.15,0.5.23] [--families llama,...]
                                      [--out matrix.json]

Releases: the suite's own venv (the interpreter running this) and .venvs/sglang-X, made by
`bash bin/setup_sglang_venv.sh X`. Prints a markdown table (the README's); exit 1 when a
pair fails or differs by more than 1e-4.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from tests.sglang_cpu.harness import REPO

TOL = 1e-4
LAYERS = 6


def release_pythons() -> Dict[str, str]:
    """sglang version -> interpreter, for the suite's venv and every .venvs/sglang-X."""
    found = {}
    for py in [sys.executable, *sorted(glob.glob(os.path.join(REPO, ".venvs", "sglang-*", "bin", "python")))]:
        out = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                             capture_output=True, text=True, timeout=120)
        if out.returncode == 0 and out.stdout.strip():
            found.setdefault(out.stdout.strip(), py)
    return found


def model_dir(family: str, root: str) -> str:
    from tests.sglang_cpu.models import make_tiny

    return make_tiny(family, os.path.join(root, family), layers=LAYERS)


def run_pair(release_python: str, family: str, models_root: str) -> dict:
    from tests.sglang_cpu.fidelity import run_fidelity
    from tests.sglang_cpu.models import SERVER_FLAGS

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"hscap-matrix-{family}-") as work:
        try:
            r = run_fidelity(model_dir(family, models_root), work, LAYERS, python=release_python,
                             extra_flags=SERVER_FLAGS.get(family, ()))
        except Exception as e:  # the server did not come up, or nothing was captured
            return {"family": family, "ok": False, "error": f"{type(e).__name__}: {str(e)[-400:]}"}
    ok = not r.problems and r.samples > 0 and r.worst <= TOL
    return {"family": family, "sglang": r.sglang, "architecture": r.architecture, "samples": r.samples,
            "layers": r.layers, "max_abs_diff": r.worst, "per_state": r.max_diff, "problems": r.problems,
            "ok": ok, "seconds": round(time.monotonic() - t0, 1)}


def table(rows: List[dict]) -> str:
    out = ["| sglang | model | architecture served | samples | max abs diff | result |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        diff = f"{r['max_abs_diff']:.1e}" if "max_abs_diff" in r else "-"
        result = "pass" if r["ok"] else ("FAIL: " + (r.get("error") or "; ".join(r.get("problems", [])[:2])
                                                      or f"diff > {TOL}"))
        out.append(f"| {r['release']} | {r['family']} | {r.get('architecture', '-')} | {r.get('samples', 0)} "
                   f"| {diff} | {result} |")
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    from tests.sglang_cpu.models import FAMILIES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--releases", help="comma-separated sglang versions (default: every venv found)")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    pythons = release_pythons()
    wanted = args.releases.split(",") if args.releases else sorted(pythons, key=lambda v: tuple(map(int, v.split("."))))
    missing = [v for v in wanted if v not in pythons]
    if missing:
        print(f"no venv for sglang {', '.join(missing)}: run bash bin/setup_sglang_venv.sh VERSION", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="hscap-matrix-models-") as models_root:
        for release in wanted:
            for family in args.families.split(","):
                row = {"release": release, **run_pair(pythons[release], family, models_root)}
                rows.append(row)
                print(f"{release} {family}: {'pass' if row['ok'] else 'FAIL'} "
                      f"{row.get('max_abs_diff', row.get('error', ''))}", file=sys.stderr, flush=True)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"tolerance": TOL, "rows": rows}, f, indent=2)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
