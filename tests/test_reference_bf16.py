"""verify --reference on a bfloat16 dump from the REAL CPU server: with no tolerance flags a
right capture passes (each token within transformers' own bf16 error, on the same weights),
and wrong states fail: another sample's, rows shifted by one, another layer."""

import random

import numpy as np
import pytest

from hs_capture.offline.verify.reference import Reference, _row_rel
from tests.sglang_cpu.harness import make_tiny_deepseek, serve_and_send, server_env, write_jsonl
from tests.sglang_cpu.stored import changed, reference_findings, stored_samples
from tests.test_verify import verify


@pytest.fixture(scope="module")
def bf16_dump(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16")
    model = make_tiny_deepseek(str(root / "model"), layers=6, dtype="bfloat16", fixed_routing=True)
    rng = random.Random(3)
    rows = [{"id": f"s{i}", "input_ids": [rng.randrange(2, 1000) for _ in range(n)]}
            for i, n in enumerate([40, 170, 300, 90])]
    data = write_jsonl(root / "data.jsonl", rows)
    dump = str(root / "dump")
    serve_and_send(model, server_env(dump, HSCAP_LAYERS="2,3,5"), root,
                   ["--dtype", "bfloat16", "--chunked-prefill-size", "128", "--disable-radix-cache"], data, len(rows),
                   warmup=False)
    return {"model": model, "dump": dump, "data": data, "rows": rows}


def test_a_right_bf16_dump_passes_with_no_tolerance_flags(bf16_dump):
    code, doc = verify(bf16_dump["dump"], "--dataset", bf16_dump["data"], "--reference", bf16_dump["model"],
                       "--reference-samples", "4")
    assert code == 0, doc["findings"]
    st = doc["stats"]
    assert st["reference_dtypes"] == ["bfloat16"] and st["reference_samples"] == 4
    states = st["reference_states"]
    assert set(states) == {"layer 2", "layer 3", "layer 5", "final (post-norm)"}
    for s in states.values():  # bf16 noise is real, and the capture's error is of its size
        assert 0 < s["ref_max_rel"] and s["max_rel"] < 4 * s["ref_max_rel"] + 0.002
        assert 0 < s["median_vs_ref"] < 2 and 0 < s["worst_vs_bound"] <= 1, s
    # the fixed float32 bound fails this right dump: the tolerance has to follow the dtype
    code, doc = verify(bf16_dump["dump"], "--reference", bf16_dump["model"], "--reference-samples", "2",
                       "--atol", "1e-4")
    assert code == 1 and {f["check"] for f in doc["findings"]} == {"reference"}


def test_wrong_bf16_states_fail(bf16_dump):
    ref = Reference(bf16_dump["model"])
    good = stored_samples(bf16_dump["dump"], "bfloat16")
    assert reference_findings(ref, good.values()) == []
    a, b = good["s1"], good["s2"]  # 170 and 300 tokens
    n = a.input_ids.size
    other = changed(a, {k: b.layers[k][:n] for k in a.layers}, b.final[:n])
    shifted = changed(a, {k: np.roll(v, 1, axis=0) for k, v in a.layers.items()})
    layer = changed(a, {3: a.layers[5]})
    one_row = changed(a)
    one_row.layers[3][100] = b.layers[3][100]
    for bad, where in ((other, "layer 2"), (shifted, "layer 2"), (layer, "layer 3"), (one_row, "layer 3")):
        found = reference_findings(ref, [bad])
        assert found and any(m.startswith(where) for m in found), (where, found)
    assert any("1 of 170 tokens" in m and "position 100" in m for m in reference_findings(ref, [one_row]))
    # the finding follows that token through every state: far off at the one state that is
    # wrong, within the rule before and after it (a capture fault, not arithmetic parting)
    msg = next(m for m in reference_findings(ref, [one_row]) if m.startswith("layer 3"))
    trail = dict(x.rsplit(" ", 1) for x in msg.split("error over transformers' own x4: ")[1].split(", "))
    assert set(trail) == {"layer 2", "layer 3", "layer 5", "final (post-norm)"}, msg
    assert float(trail["layer 3"]) > 10 and max(float(v) for k, v in trail.items() if k != "layer 3") < 1, msg
    # every token a little off (4.5x transformers' own median error: within the level of its
    # worst 1% of tokens): far more tokens over their pairing than the tail allows
    hs, _ = ref.states(a.input_ids, prenorm=False)
    low, _ = ref.states(a.input_ids, prenorm=False, dtype="bfloat16")
    med = float(np.median(_row_rel(low[3] - hs[3], hs[3])))
    d = np.random.default_rng(0).standard_normal(hs[3].shape).astype(np.float32)
    d *= (4.5 * med * np.linalg.norm(hs[3], axis=-1) / np.linalg.norm(d, axis=-1))[:, None]
    drift = changed(a, {3: hs[3] + d})
    found = reference_findings(ref, [drift])
    assert len(found) == 1 and found[0].startswith("layer 3: ") and "where 2 may (the tail)" in found[0], found
    assert int(found[0].split(": ")[1].split(" of ")[0]) > 20, found
    # a wrong token at a piece's first position is named as such: the server's prefill boundary
    starts = sorted(a.pieces)
    assert len(starts) > 1, a.pieces  # 170 tokens, chunked prefill of 128
    at = changed(a, pieces=True)
    at.layers[3][starts[1]] = b.layers[3][starts[1]]
    assert any(f"position {starts[1]}, the first token of the piece captured at step {a.pieces[starts[1]]}" in m
               for m in reference_findings(ref, [at])), reference_findings(ref, [at])


def test_a_bf16_capture_merges_for_specforge_with_no_warning_and_its_target_head_takes_it(bf16_dump, tmp_path):
    import os

    import torch

    from tests.test_merge import run_merge, specforge_target_head

    out = str(tmp_path / "sf")
    s = run_merge(bf16_dump["dump"], "-o", out, "--format", "specforge", "--dataset", bf16_dump["data"])
    assert s["warnings"] == [] and s["written"] == len(bf16_dump["rows"])
    head = specforge_target_head(bf16_dump["model"], tmp_path)
    for name in sorted(os.listdir(out)):
        if name.endswith(".ckpt"):
            hidden = torch.load(os.path.join(out, name))["hidden_state"]
            assert hidden.dtype == torch.bfloat16
            assert head(hidden).shape == (*hidden.shape[:2], head.vocab_size)
