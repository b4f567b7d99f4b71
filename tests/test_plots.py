"""benchmarks/plots.py: the benchmark figures render from the committed results files, headless
and byte for byte the same each time, and a results file missing or garbled stops it in one line
naming that file."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from PIL import Image

from tests.sglang_cpu.harness import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import plots  # noqa: E402

RESULTS = [rel for paths in plots.RESULTS.values() for rel in paths]


def run(*args):
    # no display and no backend chosen: what a CI runner or a GPU host without a screen has
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "MPLBACKEND")}
    return subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "plots.py"), *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_every_figure_renders_from_the_committed_results_the_same_each_time(tmp_path):
    pngs = {}
    for out in (tmp_path / "a", tmp_path / "b"):
        r = run("--out", str(out))
        assert r.returncode == 0, r.stderr
        assert sorted(os.listdir(out)) == sorted(plots.FIGURES)
        pngs[out.name] = {n: (out / n).read_bytes() for n in plots.FIGURES}
    for name, data in pngs["a"].items():
        assert data[:8] == b"\x89PNG\r\n\x1a\n", name
        with Image.open(out / name) as im:
            im.verify()  # every chunk's CRC, to the end of the file
        assert 5_000 < len(data) < 150_000, (name, len(data))
        assert data == pngs["b"][name], f"{name} differs between two runs on the same results"


def tree(tmp_path):
    """A checkout's results files, to break one of."""
    root = tmp_path / "root"
    for rel in RESULTS:
        os.makedirs(root / os.path.dirname(rel), exist_ok=True)
        shutil.copy(os.path.join(REPO, rel), root / rel)
    return root


@pytest.mark.parametrize("rel", RESULTS)
@pytest.mark.parametrize("fault,said", [("missing", "missing"), ("garbled", "not JSON"),
                                        ("other shape", "not the shape")])
def test_a_results_file_missing_or_garbled_stops_it_in_one_line(tmp_path, rel, fault, said):
    root = tree(tmp_path)
    if fault == "missing":
        os.remove(root / rel)
    else:
        (root / rel).write_text('{"runs": [{"summa' if fault == "garbled" else '{"runs": [{}]}')
    r = run("--root", str(root), "--out", str(tmp_path / "out"))
    assert r.returncode == 1
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("benchmarks/plots.py: "), r.stderr
    assert rel in r.stderr and said in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "out"), "no figure is written unless all of them draw"


def test_the_chat_servers_get_a_panel_of_their_own(tmp_path):
    # rate_sweep.py's chat-* servers have no state rate (most prompt tokens come from the cache)
    root = tree(tmp_path)
    rel = plots.RESULTS["rate_sweep"][0]
    doc = json.loads((root / rel).read_text())
    for run_ in doc["runs"]:  # the committed results hold chat servers already: drawn without them first
        run_["summary"] = [s for s in run_["summary"] if not s["server"].startswith("chat-")]
    (root / rel).write_text(json.dumps(doc))
    r = run("--root", str(root), "--out", str(tmp_path / "alone"))
    assert r.returncode == 0, r.stderr
    doc["runs"][-1]["summary"] += [{"server": n, "states_gbps": None, "on_over_off": x, "writer": "process"}
                                   for n, x in (("chat-5", 0.99), ("chat-100", 0.93), ("chat-serve", 0.61))]
    (root / rel).write_text(json.dumps(doc))
    r = run("--root", str(root), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    with Image.open(tmp_path / "out" / "capture_overhead.png") as im, \
            Image.open(tmp_path / "alone" / "capture_overhead.png") as alone:
        assert im.size[0] > alone.size[0]  # the second panel beside the rate one
