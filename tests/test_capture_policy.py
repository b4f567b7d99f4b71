"""The capture policy's pure logic (dump/capture_policy.py) and the server's request picker
(server/requests.py) on plain objects; the real server's behaviour is test_production_capture's."""

import pytest

from hs_capture.dump.capture_policy import MARK, CapturePolicy, rid_fraction
from hs_capture.server.config import ConfigError, capture_policy
from hs_capture.server.requests import RequestPicker


class Req:
    def __init__(self, rid, extra_key=None):
        self.rid, self.extra_key = rid, extra_key


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
])
def test_bad_policy_settings_are_one_line(env, message):
    with pytest.raises(ConfigError) as e:
        capture_policy(env)
    assert str(e.value).startswith(message)
