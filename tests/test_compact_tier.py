"""The compact tier on the REAL CPU server (`hscap serve --store fp8`): each state quantized
where the forward left it, stored FP8 with one scale per token, handed to trainers as bfloat16.

- The dump says what it is: the server log, the run metadata (schema 2, `store`), the index
  lines' dtype and every state file (version 2, its scale named).
- Every sample is whole and, against transformers' float32 forward, off by exactly what
  quantizing transformers' own states gives (the server's float32 forward adds ~nothing).
- merge's native output and DumpDataset hand out the same bfloat16 values.
- The files take less than half of what the bfloat16 states would.
- `hscap verify --reference` passes the dump by the fp8 rule; its states taken from another
  sample, one row late or from another layer fail it.
The pure logic (scales, bounds, the file's rules): tests/test_quant.py.
"""

import json
import os

import numpy as np
import pytest
import torch

from hs_capture import DumpDataset, HsCaptureDataset
from hs_capture.dump import hst, quant
from hs_capture.dump.paths import index_path, rank_meta_path, rank_tags, run_dirs
from tests.sglang_cpu.harness import REPO, hf_hidden_states, serve_and_send, server_env, write_jsonl

LAYERS = [2, 3, 5]


@pytest.fixture(scope="module")
def fp8_dump(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("compact")
    rng = np.random.default_rng(3)
    rows = [{"id": f"c{i}", "input_ids": [int(x) for x in rng.integers(2, 1000, n)]}
            for i, n in enumerate([3, 40, 130, 260, 77, 500])]
    data = write_jsonl(root / "data.jsonl", rows)
    d = str(root / "dump")
    srv = serve_and_send(tiny_model, server_env(d, HSCAP_LAYERS="2,3,5", HSCAP_PRENORM="1", HSCAP_STORE="fp8"),
                         root, ["--chunked-prefill-size", "128", "--disable-radix-cache"], data, len(rows),
                         concurrency=4, warmup=False)
    return {"dir": d, "rows": rows, "data": data, "log": srv.log(), "root": root}


def test_the_dump_says_it_is_fp8(fp8_dump):
    assert "stored fp8 (the compact tier" in fp8_dump["log"]
    (run,) = run_dirs(fp8_dump["dir"])
    (tag,) = rank_tags(run)
    meta = json.load(open(rank_meta_path(run, tag)))
    assert meta["schema"] == 2 and meta["store"] == quant.SCHEME
    lines = [json.loads(x) for x in open(index_path(run, tag))]
    assert lines and {x["dtype"] for x in lines} == {quant.STORED_DTYPE}
    for x in lines[:3]:
        for part, ref in x["files"].items():
            with hst.opened(os.path.join(run, ref["path"])) as (_, h):
                e = h.tensors["hidden"]
                assert e.dtype == quant.STORED_DTYPE and e.scale == "hidden_scale", part
                assert h.tensors["hidden_scale"].shape == e.shape[:1]


def test_every_sample_is_transformers_within_the_fp8_rounding(fp8_dump, tiny_model):
    ds = DumpDataset(fp8_dump["dir"], fp8_dump["data"], keys="hscap")
    assert ds.rids == [r["id"] for r in fp8_dump["rows"]]
    assert ds.plan.itemsize == 2  # decoding is sized by what is read: bfloat16, not the stored byte
    h = None
    for i, row in enumerate(fp8_dump["rows"]):
        item = ds[i]
        ref, pre = hf_hidden_states(tiny_model, row["input_ids"], prenorm=True)
        h = ref[0].shape[-1]
        assert item["aux_hidden_state"].dtype == torch.bfloat16
        got = {**{f"L{k}": item["aux_hidden_state"][:, j * h:(j + 1) * h] for j, k in enumerate(LAYERS)},
               "final": item["hidden_state"], "prenorm": item["prenorm_hidden_state"]}
        want = {**{f"L{k}": ref[k] for k in LAYERS}, "final": ref[-1], "prenorm": pre}
        for name, g in got.items():
            g, w = g.float().numpy(), want[name]
            rel = np.linalg.norm(g - w, axis=1) / np.linalg.norm(w, axis=1)
            q = quant.rel_error(w)  # quantizing transformers' own state
            # the float32 server is transformers to ~1e-6: what is left is the rounding to fp8,
            # the same rounding (ties aside) that quantizing transformers' own state gives
            assert (rel <= q + 1e-3).all() and (rel >= 0.5 * q).all(), (row["id"], name, rel.max(), q.max())


def test_merge_hands_out_what_the_dataset_does(fp8_dump, tmp_path):
    import subprocess
    import sys

    out = str(tmp_path / "merged")
    p = subprocess.run([sys.executable, "-m", "hs_capture.cli", "merge", fp8_dump["dir"], "-o", out, "--format",
                        "hscap", "--dataset", fp8_dump["data"], "-j", "1"], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    merged = HsCaptureDataset(out)
    ds = DumpDataset(fp8_dump["dir"], fp8_dump["data"], keys="hscap")
    for i, rid in enumerate(ds.rids):
        a, b = ds[i], merged.by_id(rid)
        for k in ("aux_hidden_state", "hidden_state", "prenorm_hidden_state"):
            assert a[k].dtype == b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]), (rid, k)


def test_the_states_take_less_than_half_of_bfloat16(fp8_dump):
    (run,) = run_dirs(fp8_dump["dir"])
    (tag,) = rank_tags(run)
    stored = tokens = 0
    for x in map(json.loads, open(index_path(run, tag))):
        tokens += x["num_tokens"]
        stored += sum(ref["bytes"] for ref in x["files"].values())
    h = json.load(open(rank_meta_path(run, tag)))["hidden_size"]
    states = len(LAYERS) + 2
    ids_and_positions = 16 * tokens  # int64 each, stored beside the final state
    assert (stored - ids_and_positions) < 0.5 * tokens * states * h * 2


def test_verify_reference_passes_the_dump_and_fails_wrong_states_in_it(fp8_dump, tiny_model):
    """`hscap verify --reference` on the server's own fp8 dump passes by the fp8 rule; the same
    dump's states taken from another sample, one row late or from another layer fail it."""
    from hs_capture.offline.verify.reference import Reference
    from tests.sglang_cpu.stored import changed, reference_findings, stored_samples
    from tests.test_verify import verify

    code, doc = verify(fp8_dump["dir"], "--dataset", fp8_dump["data"], "--reference", tiny_model,
                       "--reference-samples", "6")
    assert code == 0, doc["findings"]
    assert doc["stats"]["reference_dtypes"] == [quant.STORED_DTYPE]
    assert all(s["worst_vs_bound"] < 1 and s["quant_median_rel"] > 0.015
               for s in doc["stats"]["reference_states"].values()), doc["stats"]["reference_states"]

    good = stored_samples(fp8_dump["dir"], quant.STORED_DTYPE)
    ref = Reference(tiny_model)
    a, b = good["c2"], good["c3"]  # 130 and 260 tokens
    n = a.input_ids.size
    assert reference_findings(ref, [a]) == []
    bad = {"another sample's": changed(a, {k: b.layers[k][:n] for k in LAYERS}),
           "one row late": changed(a, {k: np.roll(v, 1, axis=0) for k, v in a.layers.items()}),
           "another layer's": changed(a, {3: a.layers[5]})}
    for what, sample in bad.items():
        found = reference_findings(ref, [sample])
        assert found and all("plus the fp8 storage error" in m for m in found), (what, found)
