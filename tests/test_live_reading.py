"""Live reading under the README's recipe, against the real CPU server: each sample reaches the
training loop within a bounded delay of the moment verify's completeness rule calls it whole.

The server is fed one sample at a time, 3 s apart, so the samples become whole at
distinct moments and end in different steps. While it runs, a watcher applies verify's rule
(planning.plan with the dataset's lengths, as `hscap verify --dataset` does) every 0.1 s and
notes when each sample is first whole; two loaders note when each item reaches them:
torchdata's StatefulDataLoader(ds, batch_size=None, num_workers=4), as the README gives it, and
a plain torch DataLoader with 3 workers, both with their default in-order round robin.
"""

import random
import threading
import time

import torch

from hs_capture import DumpDataset
from hs_capture.offline.read.planning import plan
from hs_capture.offline.read.reader import DumpError
from tests.sglang_cpu.harness import Server, server_env, write_jsonl

POLL_S = 0.5  # DumpDataset's default, which the README's recipe uses
BOUND_S = 2.0 + POLL_S  # the design's bound: the reader's poll, its decode and the loader's hand-over
SPACING_S = 3.0  # over BOUND_S: a sample held back behind the next one is late by more than the bound


class Loader(threading.Thread):
    """Iterates one loader over a live DumpDataset; notes when each sample's item arrives."""

    def __init__(self, name, make, rid_of):
        super().__init__(daemon=True, name=name)
        self.make, self.rid_of = make, rid_of
        self.got, self.error = [], None
        self.started = threading.Event()
        self.start()

    def run(self):
        try:
            items = iter(self.make())  # its workers start here
            self.started.set()
            for item in items:
                self.got.append((self.rid_of[tuple(item["input_ids"].reshape(-1).tolist())], time.monotonic()))
        except BaseException as e:  # the test names it
            self.error = repr(e)
        finally:
            self.started.set()


class Watcher(threading.Thread):
    """verify's rule applied to the dump every 0.1 s: when each sample is first whole."""

    def __init__(self, dump, lengths):
        super().__init__(daemon=True)
        self.dump, self.lengths = dump, lengths
        self.whole = {}
        self.done = threading.Event()
        self.start()

    def run(self):
        while not self.done.is_set():
            try:
                samples = plan([self.dump], self.lengths, strict=False).samples
            except DumpError:  # no run yet
                samples = {}
            now = time.monotonic()
            for rid in samples:
                self.whole.setdefault(rid, now)
            time.sleep(0.1)


def test_each_sample_reaches_the_loop_within_a_bounded_delay_of_being_whole(tiny_model, tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader

    rng = random.Random(11)
    rows = []
    for i, n in enumerate([40, 300, 7, 150, 90, 260, 33, 128, 3, 200]):  # some chunked (at 128)
        rows.append({"id": f"live/{i}", "input_ids": [rng.randrange(2, 1000) for _ in range(n)],
                     "loss_mask": [1] * n})
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    dump = str(tmp_path / "dump")
    rid_of = {tuple(r["input_ids"]): r["id"] for r in rows}

    # the README's live recipe, started before the server (the dump dir does not exist yet)
    readme = Loader("StatefulDataLoader, 4 workers", lambda: StatefulDataLoader(
        DumpDataset(dump, data, keys="specforge", follow=True), batch_size=None, num_workers=4), rid_of)
    plain = Loader("DataLoader, 3 workers", lambda: torch.utils.data.DataLoader(
        DumpDataset(dump, data, keys="hscap", follow=True), batch_size=None, num_workers=3), rid_of)
    loaders = [readme, plain]
    for x in loaders:  # workers forked while the server's launch has a pipe open would hold it
        assert x.started.wait(120), x.name
    srv = Server(tiny_model, server_env(dump, HSCAP_LAYERS="2,3,5"), str(tmp_path / "server.log"),
                 ["--chunked-prefill-size", "128", "--disable-radix-cache"])
    watcher = None
    try:
        srv.wait_healthy()
        watcher = Watcher(dump, {r["id"]: len(r["input_ids"]) for r in rows})
        for r in rows:
            srv.generate(r["id"], r["input_ids"])
            time.sleep(SPACING_S)
        deadline = time.monotonic() + 20  # ample: the design's bound is BOUND_S
        while time.monotonic() < deadline and not all(len(x.got) >= len(rows) or x.error for x in loaders):
            time.sleep(0.2)
        stopped = time.monotonic()
    finally:
        srv.stop()
        if watcher is not None:
            watcher.done.set()
    for x in loaders:
        x.join(60)
    assert not any(x.error or x.is_alive() for x in loaders), {x.name: x.error for x in loaders}
    assert sorted(watcher.whole) == sorted(rid_of.values())
    for x in loaders:
        got = dict(x.got)
        assert sorted(r for r, _ in x.got) == sorted(got) == sorted(watcher.whole), x.name  # each once
        late = {rid: round(got[rid] - t, 2) for rid, t in watcher.whole.items() if got[rid] - t > BOUND_S}
        held = [rid for rid, t in x.got if t > stopped]
        assert not late, f"{x.name}: seconds from whole to the loop, over {BOUND_S} s: {late}; after the stop: {held}"
