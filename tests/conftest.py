import os
import random
import subprocess
import threading
import time

import pytest

from tests.sglang_cpu.harness import REPO, make_tiny_deepseek, serve_and_send, server_env, write_jsonl

NUM_LAYERS = 6


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 6-layer random DeepSeek-V3 in float32, made with transformers at test time."""
    return make_tiny_deepseek(str(tmp_path_factory.mktemp("tiny-dsv3")), layers=NUM_LAYERS)


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size) -> a tmpfs of that size ("3m"), unmounted after the test; the test skips where
    none can be mounted (it needs root, as CI has)."""
    mounted = []

    def mount(size: str) -> str:
        mnt = tmp_path / f"tmpfs-{len(mounted)}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(str(mnt))
        return str(mnt)

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", mnt], check=False)


@pytest.fixture
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("HSCAP_", "SGLANG_HS_")):
            monkeypatch.delenv(k)
    return monkeypatch


@pytest.fixture(scope="session")
def tiny_target(tiny_model, tmp_path_factory):
    """The tiny model's files beside a tokenizer and a weight index, what the trainers' own code
    loads of a target (bin/tiny_model.py's add_checkpoint_files)."""
    import importlib.util

    out = str(tmp_path_factory.mktemp("tiny-target"))
    for name in os.listdir(tiny_model):
        os.symlink(os.path.join(tiny_model, name), os.path.join(out, name))
    spec = importlib.util.spec_from_file_location("tiny_model", os.path.join(REPO, "bin", "tiny_model.py"))
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    tiny.add_checkpoint_files(out)
    return out


@pytest.fixture(scope="session")
def served_dump(tiny_model, tmp_path_factory):
    """One dump from the REAL CPU server, shared by the merge and verify suites (read-only:
    tests that damage it work on a copy). Layers 2,3,5 (the drafter ids SGLang serves them on: 1,2,4), pre-norm on, chunked at 128, -c 8."""
    root = tmp_path_factory.mktemp("served")
    rng = random.Random(7)
    rows = []
    for i, n in enumerate([1, 5, 64, 130, 257, 400, 33, 600, 12, 99, 300, 2]):
        ids = [rng.randrange(2, 1000) for _ in range(n)]
        rows.append({"id": f"m/{i}:x", "input_ids": ids, "loss_mask": [rng.randrange(2) for _ in range(n)]})
    data = write_jsonl(root / "data.jsonl", rows)
    d = str(root / "dump")
    # live readers, started before the server (the dump dir does not exist yet): what they saw
    # is test_dump_dataset's to judge
    live = {"with dataset": LiveReader(d, data), "without": LiveReader(d, None)}
    srv = serve_and_send(tiny_model, server_env(d, HSCAP_LAYERS="2,3,5", HSCAP_PRENORM="1"), root,
                         ["--chunked-prefill-size", "128", "--disable-radix-cache"], data, len(rows), concurrency=8,
                         while_up=lambda: _caught_up(live, len(rows)))
    assert "final state post-norm and pre-norm" in srv.log()
    for r in live.values():
        r.join(60)
    return {"dir": d, "rows": rows, "data": data, "root": root, "live": live, "seen_while_up": srv.seen_while_up,
            "log": srv.log()}


def _caught_up(live, rows: int, timeout: float = 60):
    """Each reader's count while the server is still up, once the dataset's reader has every
    sample (the other may still wait for a step after a request's last piece, or the close)."""
    deadline = time.monotonic() + timeout
    while len(live["with dataset"].items) < rows and time.monotonic() < deadline:
        time.sleep(0.2)
    return {name: len(r.items) for name, r in live.items()}


class LiveReader(threading.Thread):
    """DumpDataset(follow=True) iterated in a thread until the run closes."""

    def __init__(self, dump: str, dataset) -> None:
        super().__init__(daemon=True)
        self.dump, self.dataset = dump, dataset
        self.name = "with dataset" if dataset else "without"
        self.items, self.error = [], None
        self.start()

    def run(self) -> None:
        from hs_capture import DumpDataset

        try:
            for item in DumpDataset(self.dump, self.dataset, keys="hscap", follow=True, poll_s=0.2):
                self.items.append(item)
        except BaseException as e:  # the test names it
            self.error = repr(e)
