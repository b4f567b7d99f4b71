"""verify --reference on the compact tier (HSCAP_STORE=fp8): a dump, and a merged output made
from one, holds states the server computed in bf16 and then quantized to FP8 e4m3, so each
token is allowed 4x transformers' own bf16 error PLUS QUANT_FACTOR x the FP8 storage error of
that token (quant.rel_error of transformers' float32 state). No server: the "server" here is
transformers' own bf16 forward with the eager attention kernel (another right bf16
implementation than the reference's sdpa), its states packed into steps as chunked prefill
packs them and written by the real ShardWriter, quantized by server/step.compact as the
hooked server does. A right capture passes; a wrong layer, rows shifted by one token and
another sample's states fail, and a bf16 dump is judged as before."""

import json
import os
import random
from typing import Dict, List, Optional

import numpy as np
import pytest
import torch

from hs_capture.dump import quant
from hs_capture.dump.paths import FINAL, PRENORM, RankId
from hs_capture.dump.schema import SCHEMA_COMPACT, RankMeta, SeqEntry, step_line
from hs_capture.offline.merge.merge import merge
from hs_capture.offline.verify import verify
from hs_capture.offline.verify.reference import QUANT_FACTOR
from hs_capture.server.config import CaptureConfig
from hs_capture.server.step import compact
from hs_capture.server.writer import ShardWriter
from tests.sglang_cpu.models import make_tiny

LAYERS = [1, 2, 3]  # of a 5-layer Llama: hidden_states[1..3]; [5] is the final (post-norm) state
NUM_LAYERS = 5
STEP = 128  # rows per forward: samples are cut across steps as chunked prefill cuts them
LENGTHS = [40, 170, 300, 90, 130]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random Llama (float32), its samples and what a bf16 server computes for them."""
    root = tmp_path_factory.mktemp("fp8")
    model = make_tiny("llama", str(root / "model"), layers=NUM_LAYERS)
    rng = random.Random(5)
    ids = {f"s{i}": [rng.randrange(2, 1000) for _ in range(n)] for i, n in enumerate(LENGTHS)}
    return {"root": root, "model": model, "ids": ids, "states": served_states(model, ids)}


def served_states(model_dir: str, ids: Dict[str, List[int]]) -> Dict[str, Dict[str, torch.Tensor]]:
    """Per sample, per part (every layer's L01.., final, prenorm): the [T, H] bf16 states a bf16
    server stores, from transformers' bf16 forward with eager attention (the reference: sdpa)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="eager").eval()
    seen = {}
    m.model.norm.register_forward_pre_hook(lambda mod, a: seen.__setitem__("pre", a[0][0]))
    out = {}
    with torch.no_grad():
        for rid, toks in ids.items():
            hs = m(torch.tensor([toks]), output_hidden_states=True).hidden_states
            out[rid] = {**{f"L{k:02d}": hs[k][0] for k in range(1, NUM_LAYERS)}, FINAL: hs[-1][0],
                        PRENORM: seen["pre"]}
    return out


def write_dump(root: str, states: Dict[str, Dict[str, torch.Tensor]], ids: Dict[str, List[int]],
               store: str = "fp8", fault: Optional[str] = None) -> str:
    """The samples back to back, cut into steps of STEP rows, written by the real ShardWriter
    (quantized on the way as the hooked server does, store="fp8"). fault: "layer" (each layer's
    part holds the next layer's state: the layer's output for its input), "shift" (every state
    one token late), "other" (s1's states are s2's first 170: another sample's)."""
    os.makedirs(root, exist_ok=True)
    cfg = CaptureConfig(dump_dir=root, run_id=f"run-{store}-{fault}", layers=LAYERS, fsync=False, writer="thread",
                        min_free_bytes=0, prenorm=True, store=store)
    meta = _run_meta(cfg, next(iter(states.values()))[FINAL].shape[1])
    w = ShardWriter(cfg, RankId(), meta)
    w.start()
    rows = [(rid, pos) for rid in ids for pos in range(len(ids[rid]))]
    for a in range(0, len(rows), STEP):
        cut = rows[a:a + STEP]
        seqs, parts = [], {p: [] for p in [f"L{k:02d}" for k in LAYERS] + [FINAL, PRENORM]}
        for rid in dict.fromkeys(r for r, _ in cut):
            pos = [p for r, p in cut if r == rid]
            seqs.append(SeqEntry(rid, len(pos), pos[0], sum(e.len for e in seqs)))
            held = _faulty(states, rid, fault)
            for part in parts:
                parts[part].append(held[part][pos[0]:pos[-1] + 1])
        tensors = {p: torch.cat(v) for p, v in parts.items()}
        n = len(cut)
        tensors["aux"] = torch.cat([tensors.pop(f"L{k:02d}") for k in LAYERS], dim=1)
        tensors["tokens"] = torch.tensor([ids[r][p] for r, p in cut])
        tensors["positions"] = torch.tensor([p for _, p in cut])
        line = step_line("EXTEND", n, n, "bfloat16", seqs)
        aux_layers = LAYERS
        if store == "fp8":
            line, tensors, aux_layers = compact(line, tensors, aux_layers, meta.hidden_size)
        assert w.submit(line, tensors, aux_layers=aux_layers)
    assert w.close()
    return root


def _run_meta(cfg: CaptureConfig, hidden: int) -> RankMeta:
    """The run metadata as the hooked server writes it (an fp8 run: schema 2, its store named)."""
    meta = RankMeta(layers=LAYERS, hidden_size=hidden, num_layers=NUM_LAYERS, prenorm=True, run_id=cfg.run_id)
    if cfg.store == "fp8":
        meta.schema, meta.extra["store"] = SCHEMA_COMPACT, quant.SCHEME
    return meta


def _faulty(states, rid: str, fault: Optional[str]) -> Dict[str, torch.Tensor]:
    s = dict(states[rid])
    if fault == "layer":
        s.update({f"L{k:02d}": s[f"L{k + 1:02d}"] for k in LAYERS})
    elif fault == "shift":  # each state one token late: row t holds token t-1's (row 0 its own)
        s = {p: torch.cat([t[:1], t[:-1]]) for p, t in s.items()}
    elif fault == "other" and rid == "s1":
        s = {p: states["s2"][p][:len(t)] for p, t in s.items()}
    return s


def _verify(path: str, model: str, **kw):
    """Every check, with --reference on every sample."""
    return verify([path], reference=model, reference_samples=len(LENGTHS), jobs=1, **kw)


def _reference_findings(rep) -> List[str]:
    return [f"{f.rid} {f.message}" for f in rep.findings if f.check == "reference"]


def _as_bf16(rep_path: str) -> None:
    """A merged output's report without its stored_as: what a lossless source's says."""
    with open(rep_path) as f:
        doc = json.load(f)
    del doc["stored_as"]
    with open(rep_path, "w") as f:
        json.dump(doc, f)


def test_a_right_fp8_dump_passes_with_its_storage_error_allowed(target, tmp_path):
    d = write_dump(str(tmp_path / "dump"), target["states"], target["ids"])
    rep = _verify(d, target["model"])
    assert rep.findings == [] and rep.stats["samples_complete"] == len(LENGTHS)
    assert rep.stats["reference_dtypes"] == [quant.STORED_DTYPE]
    states = rep.stats["reference_states"]
    assert set(states) == {"layer 1", "layer 2", "layer 3", "final (pre-norm)", "final (post-norm)"}
    for what, st in states.items():
        # really quantized: the stored error is the FP8 one, several times transformers' bf16 error
        assert 0.015 < st["quant_median_rel"] < 2.0 ** -4 and st["quant_factor"] == QUANT_FACTOR, what
        assert st["median_rel"] > 2 * st["ref_median_rel"], what
        # the margin: a right capture's worst token at about half its bound (measured 0.41-0.50)
        assert st["worst_vs_bound"] < 0.7 and st["tail_tokens"] == 0, (what, st)


def test_the_fp8_dump_fails_the_bf16_rule_so_the_storage_error_is_what_passes_it(target, tmp_path):
    """Stored.dtype comes from the index lines: the same states taken for a bf16 capture fail."""
    from hs_capture.offline.read.planning import plan
    from hs_capture.offline.verify import _dump_samples
    from hs_capture.offline.verify.reference import Reference, Tolerance, compare
    from hs_capture.offline.verify.report import Report

    d = write_dump(str(tmp_path / "dump"), target["states"], target["ids"])
    samples = list(_dump_samples(plan([d]), len(LENGTHS), random.Random(0)))
    assert {s.dtype for s in samples} == {quant.STORED_DTYPE}
    for s in samples:
        s.dtype = "bfloat16"
    rep = Report([d])
    compare(rep, Reference(target["model"]), samples, Tolerance())
    found = _reference_findings(rep)
    assert found and not any("fp8" in f for f in found), found


@pytest.mark.parametrize("fault, rids, state", [
    ("layer", {"s0", "s1", "s2", "s3", "s4"}, "layer 1"),  # each layer's part holds the next layer's
    ("shift", {"s0", "s1", "s2", "s3", "s4"}, "layer 1"),  # every state one token late
    ("other", {"s1"}, "layer 1"),  # s1's states are s2's
])
def test_wrong_fp8_states_fail_clearly(target, tmp_path, fault, rids, state):
    d = write_dump(str(tmp_path / "dump"), target["states"], target["ids"], fault=fault)
    rep = _verify(d, target["model"])
    found = [f for f in rep.findings if f.check == "reference"]
    assert not rep.ok and {f.rid for f in found} == rids, [f.line() for f in found]
    first = next(f.message for f in found if f.rid == min(rids))
    assert first.startswith(f"{state}:") and "plus the fp8 storage error at that token" in first, first
    assert "fp8 storage" in first and f"x{QUANT_FACTOR:g})" in first, first
    # far beyond the bound, not at its edge (measured: 5.6x and more on the least detectable state)
    worst = rep.stats["reference_states"][state]["worst_vs_bound"]
    assert worst > 5, worst


def test_a_merged_output_of_an_fp8_dump_says_so_and_is_judged_by_the_fp8_rule(target, tmp_path):
    d = write_dump(str(tmp_path / "dump"), target["states"], target["ids"])
    out = str(tmp_path / "merged")
    merge([d], out, "hscap")
    rep_path = os.path.join(out, "merge_report.json")
    with open(rep_path) as f:
        assert json.load(f)["stored_as"] == quant.SCHEME
    rep = _verify(out, target["model"])
    assert rep.findings == [], [f.line() for f in rep.findings]
    assert rep.stats["reference_dtypes"] == [quant.STORED_DTYPE]
    assert rep.stats["merge_reports"][0]["stored_as"] == quant.SCHEME
    assert all(st["worst_vs_bound"] < 0.7 and st["quant_median_rel"] > 0.015
               for st in rep.stats["reference_states"].values()), rep.stats["reference_states"]
    # the values tell, not the record: without it (a report lost, or an older release's) the
    # merged states are still exact FP8 values, judged by the fp8 rule
    _as_bf16(rep_path)
    rep = _verify(out, target["model"])
    assert rep.findings == [] and rep.stats["reference_dtypes"] == [quant.STORED_DTYPE]


def test_a_merge_of_an_fp8_and_a_lossless_dump_is_judged_sample_by_sample(target, tmp_path):
    """The report says fp8 (one source was); the lossless samples still get the bf16 rule."""
    fp8 = {r: target["ids"][r] for r in ("s0", "s1", "s2")}
    lossless = {r: target["ids"][r] for r in ("s3", "s4")}
    d1 = write_dump(str(tmp_path / "fp8"), target["states"], fp8)
    d2 = write_dump(str(tmp_path / "lossless"), target["states"], lossless, store="lossless")
    out = str(tmp_path / "merged")
    merge([d1, d2], out, "hscap")
    rep = _verify(out, target["model"])
    assert rep.findings == [], [f.line() for f in rep.findings]
    assert sorted(rep.stats["reference_dtypes"]) == ["bfloat16", quant.STORED_DTYPE]
    from hs_capture.offline.verify import _merged_dtype
    from hs_capture.offline.verify.merged import discover, load_item
    from hs_capture.offline.verify.report import Report

    items, _ = discover(out, Report([out]), None)
    for it in items:
        s = load_item(it, {})
        want = quant.STORED_DTYPE if s.rid in fp8 else "bfloat16"
        layers = list(torch.from_numpy(s.aux).split(s.hidden_size, dim=1))  # a scale per token and layer
        assert _merged_dtype(s.dtype, [*[t.numpy() for t in layers], s.final, s.prenorm]) == want, s.rid


def test_a_merged_output_of_a_wrong_fp8_dump_fails(target, tmp_path):
    d = write_dump(str(tmp_path / "dump"), target["states"], target["ids"], fault="layer")
    out = str(tmp_path / "merged")
    merge([d], out, "hscap")
    rep = _verify(out, target["model"])
    found = _reference_findings(rep)
    assert not rep.ok and _failed(found) == {(f"s{i}", k) for i in range(len(LENGTHS)) for k in LAYERS}, found
    assert all("plus the fp8 storage error" in f for f in found), found
    assert all(rep.stats["reference_states"][f"layer {k}"]["worst_vs_bound"] > 5 for k in LAYERS)


def _failed(found: List[str]) -> set:
    """(rid, layer) of each layer finding ("s0 layer 2: ...")."""
    return {(f.split()[0], int(f.split()[2].rstrip(":"))) for f in found if f.split()[1] == "layer"}


def test_a_bf16_dump_and_its_merged_output_are_judged_as_before(target, tmp_path):
    d = write_dump(str(tmp_path / "dump"), target["states"], target["ids"], store="lossless")
    out = str(tmp_path / "merged")
    merge([d], out, "hscap")
    with open(os.path.join(out, "merge_report.json")) as f:
        assert "stored_as" not in json.load(f)  # a lossless source's report as it was
    for path in (d, out):
        rep = _verify(path, target["model"])
        assert rep.findings == [] and rep.stats["reference_dtypes"] == ["bfloat16"], path
        for st in rep.stats["reference_states"].values():
            assert not {"quant_median_rel", "quant_max_rel", "quant_factor"} & set(st)
            assert st["worst_vs_bound"] < 1 and 0.5 < st["median_vs_ref"] < 2, st
        assert "stored_as" not in (rep.stats.get("merge_reports") or [{}])[0]
    bad = write_dump(str(tmp_path / "bad"), target["states"], target["ids"], store="lossless", fault="layer")
    found = _reference_findings(_verify(bad, target["model"]))
    assert _failed(found) == {(f"s{i}", k) for i in range(len(LENGTHS)) for k in LAYERS}, found
    assert all("transformers' own bfloat16 error" in f and "fp8" not in f for f in found), found


def test_the_bf16_rule_is_the_fp8_rule_without_its_storage_term():
    """The same tokens: without `quant` the bound is 4x transformers' own error, exactly; with
    it, that plus QUANT_FACTOR x the storage error, for the pairing and the tail alike."""
    from hs_capture.offline.verify.reference import NOISE_FACTOR, Tolerance, _judge_noisy, _limits, _Noisy

    r = np.random.default_rng(0)
    noise = 0.01 * np.exp(r.standard_normal(500) * 0.5)
    q = 0.02 + 0.01 * r.random(500)
    rel = 0.8 * noise
    rel[7] = 1.2 * NOISE_FACTOR * noise[7]  # over its own pairing: within the bf16 tail
    bf16 = _Noisy("layer 1", "bfloat16", rel, noise)
    j = _judge_noisy(bf16, _limits([bf16])[("layer 1", "bfloat16")], {})
    own = np.maximum(noise, np.median(noise))
    np.testing.assert_array_equal(j.pairing, rel / (NOISE_FACTOR * own))
    assert j.tail_tokens == 1 and j.problem is None
    fp8 = _Noisy("layer 1", quant.STORED_DTYPE, rel + q, noise, q)
    j = _judge_noisy(fp8, _limits([fp8])[("layer 1", quant.STORED_DTYPE)], {})
    np.testing.assert_allclose(j.pairing, (rel + q) / (NOISE_FACTOR * own + QUANT_FACTOR * q), rtol=1e-12)
    assert j.problem is None
    fp8.rel[9] = 0.5  # another sample's state at one token
    j = _judge_noisy(fp8, _limits([fp8])[("layer 1", quant.STORED_DTYPE)], {})
    assert j.row == 9 and "plus the fp8 storage error at that token" in j.problem, j.problem
    # the fp8 tier is judged by the noise rule, not float32's fixed bound; --atol still forces that
    assert Tolerance().fixed(quant.STORED_DTYPE) is None and Tolerance(atol=1.0).fixed(quant.STORED_DTYPE)
