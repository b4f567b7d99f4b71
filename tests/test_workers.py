"""merge and verify in worker processes (procs.py's fork server) give what one process gives,
on a dump whose samples chain across steps as under chunked prefill (written by the real
ShardWriter; no server needed: this is the offline side's own logic)."""

import hashlib
import json
import os
import random

import pytest
import torch
from click.testing import CliRunner

from hs_capture.cli import main
from hs_capture.server.config import CaptureConfig
from hs_capture.dump.paths import RankId
from hs_capture.server.writer import ShardWriter
from hs_capture.dump.schema import RankMeta, step_line
from tests.sglang_cpu.chained import chained_steps, positions

H, LAYERS, STEP, STEPS = 32, [1, 3], 64, 12


@pytest.fixture(scope="module")
def chained(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("chained"))
    g, rng = torch.Generator().manual_seed(0), random.Random(0)
    cfg = CaptureConfig(dump_dir=root, run_id="run-chained", layers=LAYERS, writer_threads=2, fsync=False)
    w = ShardWriter(cfg, RankId(), RankMeta(layers=LAYERS, hidden_size=H, num_layers=4))
    w.start()
    steps, _ = chained_steps(rng, STEPS, STEP, 8, STEP)
    for seqs in steps:
        tensors = {"aux": torch.randn(STEP, 2 * H, generator=g).to(torch.bfloat16),
                   "final": torch.randn(STEP, H, generator=g).to(torch.bfloat16),
                   "tokens": torch.randint(0, 1000, (STEP,), generator=g), "positions": positions(seqs)}
        w.submit(step_line("EXTEND", STEP, STEP, "bfloat16", seqs), tensors, aux_layers=LAYERS)
    assert w.close()
    return root


def hscap(*args):
    r = CliRunner().invoke(main, [*args, "--json"], catch_exceptions=False)
    return json.loads(r.output.strip().splitlines()[-1]), r.exit_code


def digests(out):
    return {os.path.relpath(os.path.join(d, n), out): hashlib.sha256(open(os.path.join(d, n), "rb").read()).hexdigest()
            for d, _, ns in os.walk(out) for n in ns if n != "merge_report.json"}


def step_bytes(root):
    """Each step's bytes on disk (its part files)."""
    (run,) = os.listdir(root)
    sizes = {}
    with open(os.path.join(root, run, "index", RankId().tag + ".jsonl")) as f:
        for line in map(json.loads, f):
            sizes[line["step"]] = sum(os.path.getsize(os.path.join(root, run, x["path"])) for x in line["files"].values())
    return sizes


def dump_bytes(root):
    return sum(step_bytes(root).values())


@pytest.mark.parametrize("fmt", ["specforge", "hscap"])
def test_merge_in_workers_is_byte_identical_and_reads_each_step_about_once(chained, tmp_path, fmt):
    one, one_rc = hscap("merge", chained, "-o", str(tmp_path / "j1"), "--format", fmt, "-j", "1")
    many, many_rc = hscap("merge", chained, "-o", str(tmp_path / "j3"), "--format", fmt, "-j", "3")
    assert one_rc == many_rc == 0 and one["written"] == many["written"] >= 5
    assert digests(str(tmp_path / "j1")) == digests(str(tmp_path / "j3"))
    # samples cross into the next step (none is longer than a step); three workers decode
    # twice at most the two steps where their runs meet
    sizes = sorted(step_bytes(chained).values())
    assert one["bytes_in"] == sum(sizes)
    assert sum(sizes) <= many["bytes_in"] <= sum(sizes) + sizes[-1] + sizes[-2]
    assert many["worker_peak_rss_mb"] > 0 and one["worker_peak_rss_mb"] > 0


def test_verify_in_workers_reports_what_one_process_reports(chained, tmp_path):
    one, rc1 = hscap("verify", chained, "-j", "1")
    many, rc3 = hscap("verify", chained, "-j", "3")
    assert rc1 == rc3 == 0 and one["ok"] and many["ok"]
    assert one["checks"] == many["checks"] and many["stats"]["steps_decoded"] == STEPS
    assert many["stats"]["bytes_read"] == one["stats"]["bytes_read"] == dump_bytes(chained)
    # a damaged file: the finding comes back from the worker that decoded it, and the step it
    # damages makes its samples incomplete in the coverage check, as in one process
    import shutil

    bad = str(tmp_path / "bad")
    shutil.copytree(chained, bad)
    (run,) = [d for d in os.listdir(bad)]
    part = sorted(os.path.join(d, n) for d, _, ns in os.walk(os.path.join(bad, run)) for n in ns
                  if n.endswith(".hst"))[5]
    with open(part, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    one, rc1 = hscap("verify", bad, "-j", "1")
    many, rc3 = hscap("verify", bad, "-j", "3")
    assert rc1 == rc3 != 0 and not one["ok"] and not many["ok"]
    assert one["checks"] == many["checks"]
    assert sorted(map(json.dumps, one["findings"])) == sorted(map(json.dumps, many["findings"]))
    assert any(f["check"] == "checksum" for f in many["findings"])


def test_a_ctrl_c_while_the_pool_starts_a_worker_is_held_until_that_is_done():
    """multiprocessing's bookkeeping half made by a KeyboardInterrupt prints a traceback when
    collected (merge's Ctrl-C test saw one): the pool holds a Ctrl-C across its start and each
    submit, then raises it."""
    import signal
    import time

    from hs_capture.offline.workers import procs

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        done = []
        with pytest.raises(KeyboardInterrupt):
            with procs._interrupt_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler runs between bytecodes: here, were it not held
                done.append(True)
        assert done == [True]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_ctrl_c_held_under_the_default_action_still_ends_the_process(tmp_path):
    """Where SIGINT has its default action (a caller that set SIG_DFL), the held signal is
    delivered, not dropped: the process ends by it."""
    import subprocess
    import sys

    code = ("import os, signal, time\n"
            "from hs_capture.offline.workers import procs\n"
            "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
            "with procs._interrupt_deferred():\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(0.05)\n"
            "print('still alive')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == -2 and "still alive" not in p.stdout, (p.returncode, p.stdout, p.stderr)
