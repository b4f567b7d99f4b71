"""DumpDataset: training straight from a dump (hs_capture/offline/train/dump_dataset.py).

Against the real CPU server's dump (served_dump: layers 2,3,5, pre-norm, chunked at 128):
every item equals the file `hscap merge` writes for that sample, in every format; read
through its sampler under DataLoader workers every sample comes once per epoch; a damaged
step file is one line naming the sample. Live (follow=True): a reader started before the
server yields every sample once, whole, equal to transformers; one restarted from its state
(torchdata's StatefulDataLoader) neither repeats nor skips. The sampler's order is pure logic,
tested on its own.
"""

import os
import random
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from hs_capture import DumpDataset, HsCaptureDataset
from hs_capture.cli import main
from hs_capture.dump.paths import run_dirs
from hs_capture.offline.train.dump_dataset import FollowingDumpDataset
from hs_capture.offline.formats.common import sample_file_stem
from hs_capture.offline.read.reader import DumpError, open_runs
from hs_capture.offline.train.step_sampler import StepWindowSampler, epoch_order, rank_share, worker_interleave
from tests.sglang_cpu.harness import hf_hidden_states
from tests.conftest import NUM_LAYERS


def _merge(dump, out, fmt, data):
    res = CliRunner().invoke(main, ["merge", dump, "-o", out, "--format", fmt, "--dataset", data, "--json"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output


def _same(a, b, where):
    assert set(a) == set(b), where
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]), (where, k)
        else:
            assert a[k] == b[k], (where, k)


@pytest.mark.parametrize("keys", ["specforge", "modelopt", "speculators", "hscap"])
def test_every_item_is_what_merge_writes_for_that_sample(served_dump, tmp_path, keys):
    out = str(tmp_path / keys)
    _merge(served_dump["dir"], out, keys, served_dump["data"])
    ds = DumpDataset(served_dump["dir"], served_dump["data"], keys=keys)
    assert ds.rids == [r["id"] for r in served_dump["rows"]]  # every sample whole, in dataset order
    merged = HsCaptureDataset(out) if keys == "hscap" else None
    for i, rid in enumerate(ds.rids):
        got = ds[i]
        if keys == "specforge":
            want = torch.load(os.path.join(out, sample_file_stem(rid) + ".ckpt"), weights_only=True)
        elif keys == "modelopt":
            want = torch.load(os.path.join(out, sample_file_stem(rid) + ".pt"), weights_only=True)
        elif keys == "speculators":
            want = load_file(os.path.join(out, f"hs_{ds.row_of(rid)}.safetensors"))
        else:
            want = merged.by_id(rid)
        _same(got, want, rid)


def test_it_pickles_into_spawned_workers(served_dump):
    ds = DumpDataset(served_dump["dir"], served_dump["data"], keys="modelopt")
    ds[0]  # a decode cache of its own: not carried into the copy
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="spawn",
                                         sampler=ds.sampler(num_workers=1, shuffle=False))
    got = {x["conversation_id"]: x for x in loader}
    assert sorted(got) == sorted(ds.rids)
    _same(got[ds.rids[3]], ds[3], ds.rids[3])


def test_without_a_dataset_it_takes_what_merge_takes(served_dump):
    ds = DumpDataset(served_dump["dir"], keys="hscap")
    assert sorted(ds.rids) == sorted(r["id"] for r in served_dump["rows"]) and ds.rids == sorted(ds.rids)
    assert all(bool((ds[i]["loss_mask"] == 1).all()) for i in range(len(ds)))  # no dataset: all ones


def test_a_format_the_dump_cannot_feed_and_a_damaged_step_are_one_line(served_dump, tmp_path):
    with pytest.raises(ValueError, match="choose from"):
        DumpDataset(served_dump["dir"], keys="eagle")
    broken = str(tmp_path / "dump")
    shutil.copytree(served_dump["dir"], broken)
    ds = DumpDataset(broken, served_dump["data"], keys="specforge")
    run = open_runs(broken)[0]
    rid = ds.rids[5]
    part = ds.plan.samples[rid][0].files[0][1]
    path = os.path.join(run.path, part)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    with pytest.raises(DumpError) as e:
        ds[5]
    msg = str(e.value)
    assert "\n" not in msg and rid in msg and part in msg and "hscap verify" in msg, msg


def test_read_through_its_sampler_with_workers_every_sample_comes_once_per_epoch(served_dump):
    ds = DumpDataset(served_dump["dir"], served_dump["data"], keys="specforge", window_bytes=1 << 16)
    assert len(ds.windows) > 2  # small windows: the order is really cut
    seen = []
    for epoch in range(2):
        sampler = ds.sampler(batch_size=2, num_workers=2, seed=3)
        sampler.set_epoch(epoch)
        loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2, sampler=sampler,
                                             collate_fn=lambda b: [len(x["input_ids"]) for x in b])
        seen.append(sorted(n for batch in loader for n in batch))
    want = sorted(len(r["input_ids"]) for r in served_dump["rows"])
    assert seen == [want, want]


# ------------------------------------------------------------------ the sampler's order


def _windows(rng, n_windows=9):
    out, at = [], 0
    for _ in range(n_windows):
        k = rng.randrange(1, 7)
        out.append(list(range(at, at + k)))
        at += k
    return out


def _contiguous_in(part, whole):
    """part is a contiguous slice of whole."""
    k = len(part)
    return any(whole[i:i + k] == part for i in range(len(whole) - k + 1)) if k else True


@pytest.mark.parametrize("batch,workers,drop_last", [(1, 1, False), (1, 3, False), (2, 2, False), (3, 4, False),
                                                     (4, 3, True), (2, 5, False)])
def test_each_dataloader_worker_reads_a_contiguous_run_of_windows(batch, workers, drop_last):
    rng = random.Random(batch * 10 + workers)
    windows = _windows(rng)
    share = epoch_order(windows, 1, 0, True)
    out = worker_interleave(share, batch, workers, drop_last)
    assert sorted(out) == sorted(share)
    # what the DataLoader does: cut batches in order, hand batch j to worker j % N
    batches = [out[k:k + batch] for k in range(0, len(out), batch)]
    if drop_last and batches and len(batches[-1]) < batch:
        batches.pop()
    for w in range(workers):
        got = [i for j, b in enumerate(batches) if j % workers == w for i in b]
        assert _contiguous_in(got, share), (w, got, share)


def test_a_real_dataloader_gives_each_worker_a_contiguous_run():
    class Ids(torch.utils.data.Dataset):
        def __len__(self):
            return 40

        def __getitem__(self, i):
            return torch.tensor([i, torch.utils.data.get_worker_info().id])

    windows = [list(range(k, k + 5)) for k in range(0, 40, 5)]
    sampler = StepWindowSampler(windows, batch_size=3, num_workers=3, seed=1)
    by_worker = {}
    for b in torch.utils.data.DataLoader(Ids(), batch_size=3, num_workers=3, sampler=sampler):
        for i, w in b.tolist():
            by_worker.setdefault(w, []).append(i)
    share = epoch_order(windows, 0, 1, True)
    assert sorted(i for v in by_worker.values() for i in v) == list(range(40))
    assert all(_contiguous_in(v, share) for v in by_worker.values()), by_worker


def test_ranks_share_every_sample_in_equal_contiguous_runs_and_epochs_reshuffle():
    windows = _windows(random.Random(5), 11)
    n = sum(map(len, windows))
    order = epoch_order(windows, 0, 7, True)
    assert order == epoch_order(windows, 0, 7, True) != epoch_order(windows, 1, 7, True)
    assert sorted(order) == list(range(n))
    for world in (2, 3, 4):
        shares = [rank_share(order, r, world, False) for r in range(world)]
        assert len({len(s) for s in shares}) == 1 and set().union(*map(set, shares)) == set(range(n))
        dropped = [rank_share(order, r, world, True) for r in range(world)]
        assert all(len(s) == n // world for s in dropped) and len(set().union(*map(set, dropped))) == n // world * world
        sampler = StepWindowSampler(windows, rank=1, world_size=world, seed=7)
        assert len(list(sampler)) == len(sampler) == len(shares[1])


def test_each_window_is_read_together_and_runs_of_windows_in_dump_order():
    windows = _windows(random.Random(2), 20)
    order = epoch_order(windows, 3, 1, True, run=4)
    starts = []
    for w in windows:
        pos = sorted(order.index(i) for i in w)
        assert pos == list(range(pos[0], pos[0] + len(w)))
        starts.append(pos[0])
    for k in range(0, 20, 4):  # a run's windows follow each other
        run = starts[k:k + 4]
        assert run == sorted(run) and all(starts[k + j + 1] == starts[k + j] + len(windows[k + j]) for j in range(3))
    assert starts != sorted(starts)  # and the runs are shuffled


# ------------------------------------------------------------------ live


def _compare_to_transformers(model, item, tol=1e-4):
    ids = item["input_ids"].tolist()
    states, pre = hf_hidden_states(model, ids, prenorm=True)
    h = item["hidden_state"].shape[-1]
    aux = item["aux_hidden_state"].float().numpy()
    for k, layer in enumerate([2, 3, 5]):
        assert np.abs(aux[:, k * h:(k + 1) * h] - states[layer]).max() <= tol
    assert np.abs(item["hidden_state"].float().numpy() - states[NUM_LAYERS]).max() <= tol
    assert np.abs(item["prenorm_hidden_state"].float().numpy() - pre).max() <= tol


def test_a_reader_started_before_the_server_yields_every_sample_once_whole_as_it_is_captured(served_dump, tiny_model):
    # served_dump started two live readers before its server (tests/conftest.py): with the
    # dataset's lengths, and without (a request is whole once the rank wrote the next step)
    live, rows = served_dump["live"], served_dump["rows"]
    assert not any(r.error or r.is_alive() for r in live.values()), {n: r.error for n, r in live.items()}
    assert served_dump["seen_while_up"]["with dataset"] == len(rows)  # as captured, not after the close
    by_ids = {tuple(r["input_ids"]): r["id"] for r in rows}
    finished = DumpDataset(served_dump["dir"], served_dump["data"], keys="hscap")
    for name, reader in live.items():
        seen = [by_ids[tuple(item["input_ids"].tolist())] for item in reader.items]  # a partial one: KeyError
        assert sorted(seen) == sorted(r["id"] for r in rows), name  # once each
        for rid, item in zip(seen, reader.items):
            want = finished.by_id(rid)
            if name == "without":  # no dataset: all-ones loss masks, as merge without --dataset
                want = {**want, "loss_mask": torch.ones_like(want["loss_mask"])}
            _same(item, want, rid)  # what merge would write
    for item in live["with dataset"].items[::3]:
        _compare_to_transformers(tiny_model, item)


def test_a_follower_restarted_from_its_state_neither_repeats_nor_skips(served_dump):
    from torchdata.stateful_dataloader import StatefulDataLoader

    want = sorted(r["id"] for r in served_dump["rows"])
    rid_of = {tuple(r["input_ids"]): r["id"] for r in served_dump["rows"]}

    def loader(state=None):
        ds = DumpDataset(served_dump["dir"], served_dump["data"], keys="specforge", follow=True, poll_s=0.05)
        dl = StatefulDataLoader(ds, batch_size=None, num_workers=2, snapshot_every_n_steps=1)
        if state is not None:
            dl.load_state_dict(state)
        return dl

    first, it = [], iter(dl := loader())
    for _ in range(5):
        first.append(rid_of[tuple(next(it)["input_ids"].tolist())])
    state = dl.state_dict()
    del it, dl  # the trainer dies here
    rest = [rid_of[tuple(x["input_ids"].tolist())] for x in loader(state)]
    assert sorted(first + rest) == want, (first, rest)

    # and in one process, without a DataLoader
    ds = FollowingDumpDataset(served_dump["dir"], served_dump["data"], keys="hscap", poll_s=0.05)
    it = iter(ds)
    head = [next(it)["input_ids"] for _ in range(3)]
    again = FollowingDumpDataset(served_dump["dir"], served_dump["data"], keys="hscap", poll_s=0.05)
    again.load_state_dict(ds.state_dict())
    tail = [x["input_ids"] for x in again]
    assert sorted(rid_of[tuple(t.tolist())] for t in head + tail) == want
    assert run_dirs(served_dump["dir"])  # the run it followed had closed: both ended on their own


def test_a_live_dataset_is_a_dump_dataset_and_windows_count_the_stored_dtype(served_dump):
    ds = DumpDataset(served_dump["dir"], served_dump["data"], follow=True, window_bytes=1 << 20, poll_s=0.05)
    assert isinstance(ds, DumpDataset) and isinstance(ds, torch.utils.data.IterableDataset)
    assert ds.cache_bytes == 2 << 20
    with pytest.raises(TypeError, match="no length"):
        len(ds)
    fixed = DumpDataset(served_dump["dir"], served_dump["data"], window_bytes=1 << 20)
    assert fixed.plan.itemsize == 4  # the CPU server stores float32
    h, k = fixed.plan.hidden_size, len(fixed.plan.layers) + 1 + fixed.plan.prenorm
    assert fixed._token_bytes() == h * k * 4


def test_the_readme_snippets_run_as_written(served_dump):
    """docs/training.md "Train straight from the dump": both Python blocks (marked
    `<!-- dump-dataset -->`, README.md's and docs/'s), run as written, with the example paths
    pointed at this test's dump and dataset."""
    from tests.test_readme_commands import BLOCKS

    blocks = BLOCKS["snippets"]
    assert len(blocks) == 2
    for code in blocks:
        assert '"/data/hs"' in code and '"data.jsonl"' in code
        code = code.replace('"/data/hs"', repr(served_dump["dir"])).replace('"data.jsonl"', repr(served_dump["data"]))
        scope = {}
        exec(compile(code, "docs/training.md", "exec"), scope)
        assert isinstance(scope["ds"], DumpDataset)
    # the live block's loader, iterated: the run is closed, so every sample comes and it ends
    got = [item["input_ids"].tolist() for item in scope["loader"]]
    assert sorted(got) == sorted(r["input_ids"] for r in served_dump["rows"])
