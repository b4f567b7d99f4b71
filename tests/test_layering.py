"""The package's layering is a tested fact (.importlinter): the server side never imports the
offline tools, the offline tools never import the server side or sglang, the dump contract
imports neither, the patching base imports neither side (nor torch or sglang), no package's
modules import each other in a circle, the offline commands (send, merge, verify, train) sit on
the readers, the formats and the worker processes, never the other way round, and the offline
tools and the CLI reach a training format only through the registry."""

import os
import shutil
import subprocess
import sys

from tests.sglang_cpu.harness import REPO

LINT = os.path.join(os.path.dirname(sys.executable), "lint-imports")


def lint(root: str):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = root  # the package analysed is the one under root
    return subprocess.run([LINT, "--config", os.path.join(REPO, ".importlinter"), "--no-cache"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_layering_contracts_hold():
    out = lint(REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "7 kept, 0 broken" in out.stdout


def test_a_forbidden_import_breaks_its_contract(tmp_path):
    copy = tmp_path / "tree"
    shutil.copytree(os.path.join(REPO, "hs_capture"), copy / "hs_capture",
                    ignore=shutil.ignore_patterns("__pycache__"))
    planted = {  # module -> the line that breaks a contract, and the contract's name
        "server/writer.py": ("from hs_capture.offline.merge import merge  # planted\n", "server side never imports"),
        "offline/read/reader.py": ("import sglang.srt  # planted\n", "offline tools never import"),
        "dump/paths.py": ("from hs_capture.server import config  # planted\n", "dump contract imports neither"),
        "patching/base.py": ("import torch  # planted\n", "patching base imports neither"),
        "offline/read/coverage.py": ("from hs_capture.offline.read import planning  # planted\n", "No import cycles"),
        "offline/read/planning.py": ("from hs_capture.offline.merge import merge_result  # planted\n",
                                     "sit on the readers"),
        "offline/train/dataset.py": ("from hs_capture.offline.formats import native  # planted\n",
                               "only through the registry"),
    }
    for rel, (line, contract) in planted.items():
        path = copy / "hs_capture" / rel
        clean = path.read_text()
        path.write_text(line + clean)
        out = lint(str(copy))
        path.write_text(clean)
        assert out.returncode != 0 and f"{contract}" in out.stdout and "BROKEN" in out.stdout, (rel, out.stdout[-2000:])
