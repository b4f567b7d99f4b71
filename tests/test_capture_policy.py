"""The capture policy's pure logic (dump/capture_policy.py) and the server's request picker
(server/requests.py) on plain objects; the real server's behaviour is test_production_capture's."""

import pytest

from hs_capture.dump.capture_policy import MARK, CapturePolicy, rid_fraction
from hs_capture.server.config import ConfigError, capture_policy
from hs_capture.dump.token_hash import prefix_hash
from hs_capture.server.captured_prefixes import CapturedPrefixes
from hs_capture.server.requests import RequestPicker


class Req:
    def __init__(self, rid, extra_key=None, ids=()):
        self.rid, self.extra_key, self.origin_input_ids, self.output_ids = rid, extra_key, list(ids), []


def test_the_hash_picks_about_the_fraction_and_the_same_rids_every_time():
    rids = [f"r{i}" for i in range(20000)]
    p = CapturePolicy(fraction=0.05)
    picked = [r for r in rids if p.picks(r)]
    assert 0.045 < len(picked) / len(rids) < 0.055
    assert picked == [r for r in rids if CapturePolicy(fraction=0.05).picks(r)]
    assert set(picked) <= {r for r in rids if CapturePolicy(fraction=0.25).picks(r)}  # nested fractions
    assert all(0 <= rid_fraction(r) < 1 for r in rids[:100])


def test_a_marked_request_is_always_picked_and_fraction_zero_picks_only_marked():
    p = CapturePolicy(fraction=0.0)
    assert not p.picks("a") and p.picks("a", MARK) and p.picks("a", MARK + ":tenant") and not p.picks("a", "other")
    assert CapturePolicy(fraction=1.0).picks(None)


def test_the_picker_gives_each_picked_request_a_namespace_of_its_own_only_with_the_radix_cache():
    picker = RequestPicker(CapturePolicy(fraction=0.0), radix_cache=True)
    reqs = [Req("same", MARK), Req("same", MARK), Req("other", None), Req("x", "tenant-a")]
    for r in reqs:
        picker.on_new_request(r)
    assert reqs[0].extra_key != reqs[1].extra_key and reqs[0].extra_key.startswith(MARK)  # a resend too
    assert reqs[2].extra_key is None and reqs[3].extra_key == "tenant-a"  # untouched: they keep the cache
    assert picker.select(["same", "other", None], 3) == [True, False, False]
    off = RequestPicker(CapturePolicy(fraction=0.0), radix_cache=False)
    r, own = Req("m", MARK), Req("k", MARK + ":tenant")
    off.on_new_request(r)
    off.on_new_request(own)
    # no namespace: the bare mark is taken off (the request shares the cache as an unmarked one)
    assert r.extra_key is None and own.extra_key == MARK + ":tenant" and off.select(["m", "n"], 2) == [True, False]
    assert RequestPicker(CapturePolicy(), radix_cache=False).select(["a"], 1) is None  # every request


def test_a_finished_request_is_forgotten():
    picker = RequestPicker(CapturePolicy(fraction=0.0), radix_cache=True)
    r = Req("gone", MARK)
    picker.on_new_request(r)
    assert picker.captured("gone")
    del r
    assert not picker.captured("gone")


@pytest.mark.parametrize("env,message", [
    ({"HSCAP_CAPTURE_FRACTION": "x"}, "HSCAP_CAPTURE_FRACTION='x' is not a number"),
    ({"HSCAP_CAPTURE_FRACTION": "-0.1"}, "HSCAP_CAPTURE_FRACTION=-0.1 is outside [0, 1]"),
    ({"HSCAP_CACHE_NAMESPACE": "yes"}, "HSCAP_CACHE_NAMESPACE='yes': choose 1"),
    ({"HSCAP_REUSE_CAPTURED": "on"}, "HSCAP_REUSE_CAPTURED='on': choose 1"),
    ({"HSCAP_FOLLOW": "1"}, "HSCAP_FOLLOW=1 needs HSCAP_REUSE_CAPTURED=1"),
])
def test_bad_policy_settings_are_one_line(env, message):
    with pytest.raises(ConfigError) as e:
        capture_policy(env)
    assert str(e.value).startswith(message)


def test_captured_prefixes_hold_whole_blocks_of_captured_prompts_for_other_requests():
    idx = CapturedPrefixes(block=4)
    system, a, b = list(range(100, 110)), [1, 2, 3, 4, 5, 6], [7, 8, 9]
    first = idx.prompt(system + a)
    assert idx.limit(first, "a") == (0, None)
    idx.add(first, "a")
    assert idx.limit(idx.prompt(system + a), "a") == (0, None)  # its own blocks: never borrowed from itself
    assert idx.limit(idx.prompt(system + a), "a2") == (16, "a")  # 16 tokens: its whole blocks
    assert idx.limit(idx.prompt(system + b), "b") == (8, "a")  # the shared system prompt's whole blocks
    assert idx.limit(idx.prompt([0] + system), "c") == (0, None)  # same tokens elsewhere: nothing
    assert idx.limit(idx.prompt(system + a, namespace=("lora-b", None)), "d") == (0, None)  # another cache
    idx.add(idx.prompt(system + b), "b")
    assert idx.limit(idx.prompt(system + b + [1]), "d") == (12, "b")
    assert idx.limit(idx.prompt(system[:8] + [0]), "d") == (8, "a")  # the first owner keeps a block
    # continuing a captured prompt: the whole of it and more, the tail past its last block included
    assert idx.continuing(system + a + [42, 43]) is not None
    assert idx.continuing(system + a) is None  # the same prompt again is no continuation
    assert idx.continuing(system + [1, 2, 3, 4, 5, 99, 42]) is None  # it differs inside the tail
    assert idx.continuing(system[:8] + [0, 0] + a) is None
    assert idx.continuing(system + a + [42], namespace=("lora-b", None)) is None
    # a chunk holds only what it computed; the prompt's end only once reached
    idx.add(idx.prompt(list(range(50, 70))), "z", upto=10)
    assert idx.limit(idx.prompt(list(range(50, 70))), "y") == (8, "z")
    assert idx.continuing(list(range(50, 72))) is None
    lender = CapturedPrefixes(block=4)
    lender.lends = 2
    lender.add(lender.prompt(system + a), "a")
    lender.lend("a")
    assert lender.limit(lender.prompt(system + b), "b") == (8, "a")
    lender.lend("a")  # lent as often as it may: the next request with the prefix prefills it again
    assert lender.limit(lender.prompt(system + b), "b") == (0, None)
    assert lender.continuing(system + a + [42]) is not None  # still a captured conversation to follow
    lender.add(lender.prompt(system + b), "b")
    assert lender.limit(lender.prompt(system + a), "c") == (8, "b")  # held again, by b
    small = CapturedPrefixes(block=4, max_blocks=3)
    small.add(small.prompt(list(range(40))), "x")
    assert small.limit(small.prompt(list(range(12))), "y") == (0, None)  # the oldest blocks went first
    assert small.limit(small.prompt(list(range(40))), "y") == (0, None)  # and with them every later one


def test_the_picker_caps_a_captured_request_at_the_prefix_captured_requests_hold_and_follows_conversations():
    picker = RequestPicker(CapturePolicy(fraction=0.0, reuse_captured=True, follow=True), radix_cache=True)
    turn0 = Req("t0", MARK, range(100, 170))
    picker.on_new_request(turn0)
    assert turn0.extra_key is None  # the bare mark comes off: captured requests share the cache
    assert picker.limit_prefix(turn0, 69) == 0  # nothing captured yet
    turn0.prefix_len = 0
    picker.after_match(turn0)
    assert turn0._hscap_borrow is None
    follower = Req("t1", None, list(range(100, 170)) + [5, 6, 7])
    picker.on_new_request(follower)
    assert not picker.captured("t1")  # t0 only waited: it holds nothing until it is in a batch
    turn0.extend_end = 70
    picker.on_batch([turn0])
    turn1 = Req("t1", None, list(range(100, 170)) + [5, 6, 7])  # unmarked, not picked: it continues t0
    picker.on_new_request(turn1)
    assert picker.captured("t1") and not picker.captured("other")
    assert picker.limit_prefix(turn1, 72) == 64  # t0's whole blocks (32 tokens each)
    turn1.prefix_len = 0  # the match found it all in host memory (HiCache) ...
    picker.after_match(turn1)
    turn1.prefix_len, turn1.extend_end = 62, 73  # ... and loaded 62 tokens back before the batch
    picker.on_batch([turn1])
    assert picker.borrow_of("t1", 62) == ("t0", prefix_hash(range(100, 162)))
    assert picker.borrow_of("t1", 60) is None and picker.borrow_of("t0", 0) is None
    turn1.prefix_len = 64
    picker.on_batch([turn1])  # its next chunk
    assert picker.borrow_of("t1", 64) is None  # only the prefill's first piece borrows
    stranger = Req("s", None, range(100, 140))
    picker.on_new_request(stranger)
    assert not picker.captured("s")  # shares t0's start but does not continue it
    plain = RequestPicker(CapturePolicy(fraction=0.0, reuse_captured=True), radix_cache=True, can_reuse=False)
    r = Req("m", MARK, range(10))
    plain.on_new_request(r)
    assert plain.reuse is None and r.extra_key.startswith(MARK + "|")  # no cap to set: a namespace of its own


def test_two_pickers_fed_the_same_calls_cap_alike_however_often_they_are_asked():
    """Tensor-parallel ranks: each scheduler asks for the cap as often as it sorts its queue
    (not the same on every rank); only forming a batch changes the index."""
    import random

    rng = random.Random(3)
    system = [rng.randrange(1000) for _ in range(96)]
    reqs = [(f"r{i}", system + [rng.randrange(1000) for _ in range(rng.randrange(5, 80))]) for i in range(40)]
    caps = []
    for asks in (1, 5):
        picker = RequestPicker(CapturePolicy(fraction=0.5, reuse_captured=True, follow=True), radix_cache=True)
        picker.reuse.max_blocks = 16  # evictions too
        out = []
        for rid, ids in reqs:
            r = Req(rid, None, ids)
            picker.on_new_request(r)
            for _ in range(asks):
                cap = picker.limit_prefix(r, len(ids) - 1)
            out.append((picker.captured(rid), cap))
            r.extend_end = len(ids)
            picker.on_batch([r])
        caps.append(out)
    assert caps[0] == caps[1] and any(c for _, c in caps[0])


def test_a_captured_prompt_shorter_than_a_block_is_followed_and_one_block_tells_others_apart():
    idx = CapturedPrefixes(block=8)
    system = list(range(100, 132))  # 4 blocks every prompt shares
    idx.add(idx.prompt([1, 2, 3]), "tiny")
    assert idx.continuing([1, 2, 3, 4]) is not None  # shorter than a block, continuing one
    assert idx.continuing([1, 2, 3] + list(range(40, 60))) is not None
    assert idx.continuing([1, 2, 4, 5]) is None
    assert idx.continuing([1, 2, 3], ("other", None)) is None  # another cache namespace
    idx.add(idx.prompt(system + [7] * 12), "a")
    for k in range(20):  # conversations that share the system prompt with "a", never its message
        assert idx.continuing(system + [k, 9] * 10) is None
    assert idx.continuing(system + [7] * 12 + [8]) is not None
    idx.max_ends = 1
    idx.add(idx.prompt(system + [6] * 12), "b")  # the other two ends are forgotten
    assert idx.continuing([1, 2, 3, 4]) is None and idx.continuing(system + [7] * 12 + [8]) is None
    assert idx.continuing(system + [6] * 12 + [8]) is not None
    assert not idx._tiny and len(idx._heads) == 1 and len(idx._recorded) == 1


@pytest.mark.parametrize("max_ends,recorded", [(1 << 16, None), (7, None), (1 << 16, 40)])
def test_continuing_reuses_recent_walks_and_judges_as_a_full_walk_does(max_ends, recorded, monkeypatch):
    """The digests a request shares with a recent request are taken from that request's walk,
    and most requests are told apart by one block; whatever the order of prompts, namespaces
    and captures, and however many captured ends are forgotten, the answer is a full walk's."""
    import random
    from collections import Counter

    from hs_capture.server import captured_prefixes

    if recorded is not None:  # past this many recorded blocks, ends go unrecorded
        monkeypatch.setattr(captured_prefixes, "RECORDED", recorded)
    rng = random.Random(3)
    systems = [[rng.randrange(500) for _ in range(n)] for n in (0, 5, 64, 300)]
    fast, slow = CapturedPrefixes(block=8, max_ends=max_ends), CapturedPrefixes(block=8, max_ends=max_ends)
    slow._remember = lambda *a: None  # never reuses a walk: every request hashed from its start
    slow._differs = lambda *a: False  # nor told apart by one block
    told = []
    differs = fast._differs
    fast._differs = lambda *a: told.append(differs(*a)) or told[-1]
    convs, followed = [], 0
    for i in range(60):
        conv = rng.choice(systems) + [rng.randrange(500) for _ in range(rng.randrange(1, 40))]
        ns = rng.choice([None, ("a", None)])
        convs.append((conv, ns))
        upto = rng.choice([None, None, len(conv) // 2])
        for idx in (fast, slow):
            idx.add(idx.prompt(conv, ns), f"r{i}", upto=upto)
        for _ in range(6):
            c, ns2 = rng.choice(convs)
            r = c[:rng.randrange(len(c) + 1)] if rng.random() < 0.3 else c + [rng.randrange(500) for _ in range(rng.randrange(20))]
            ns2 = ns2 if rng.random() < 0.8 else rng.choice([None, ("a", None)])
            got, want = fast.continuing(r, ns2), slow.continuing(r, ns2)
            assert (got is None) == (want is None)
            if got is not None:
                followed += 1
                full = fast.prompt(r, ns2)
                assert (got.data, got.chain, got.seed) == (full.data, full.chain, full.seed)
        # what the one-block test reads is exactly what the ends still held recorded
        assert set(fast._recorded) == set(fast._ends)
        recorded = list(fast._recorded.values())
        assert fast._blocks == Counter(h for _, first, _, keys in recorded if first is not None for h in keys)
        assert {h: dict(n.count) for h, n in fast._heads.items()} == {
            h: dict(Counter(k for seed, first, k, _ in recorded if (seed, first) == h))
            for h in {(seed, first) for seed, first, _, _ in recorded if first is not None}}
        assert all(n.least == min(n.count) for n in fast._heads.values())
        assert fast._tiny == Counter(seed for seed, first, _, _ in recorded if first is None)
    assert followed > (50 if max_ends > 7 else 5) and fast._walks
    assert sum(told) > (50 if recorded is None else 5)  # told apart without a full walk


def test_reuse_and_follow_asked_with_the_radix_cache_off_say_they_are_not_taken(monkeypatch, caplog, tmp_path):
    import logging

    from hs_capture.server import capture
    from hs_capture.server import requests as requests_mod
    from hs_capture.server.config import CaptureConfig

    policy = capture_policy({"HSCAP_CAPTURE_FRACTION": "0", "HSCAP_REUSE_CAPTURED": "1", "HSCAP_FOLLOW": "1"})
    assert policy.reuse_captured and policy.follow
    picker = RequestPicker(policy, radix_cache=False)
    monkeypatch.setattr(requests_mod, "is_hooked", lambda: True)
    monkeypatch.setattr(requests_mod, "picker", lambda: picker)
    with caplog.at_level(logging.INFO):
        capture._policy_picker(CaptureConfig(dump_dir=str(tmp_path), run_id="run-test", policy=policy),
                               {"disable_radix_cache": True})
    assert "HSCAP_REUSE_CAPTURED=1 and HSCAP_FOLLOW=1 are not taken: the radix cache is off" in caplog.text
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("capture policy:"))
    assert line == f"capture policy: only requests marked extra_key={MARK}*; radix cache off"
