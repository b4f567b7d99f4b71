"""The request side of capture: each new SGLang request (`Req.__init__`, in the scheduler
process that also runs the model) is judged once by the capture policy; a picked request is
remembered by rid for the forward hook (capture.py) and, with the radix cache on, given a
radix-cache namespace of its own so that it is prefilled from position 0 (a prefix hit
would leave a hole in its capture) while every other request keeps its prefix reuse.

The namespace is the request's `extra_key` (SGLang keys its radix tree on it since 0.5.10)
with a counter appended: unique even when a rid is sent again (a resend must not hit the
first send's cache). Every tensor-parallel rank's scheduler builds the same requests in the
same order, so the counters agree and the ranks schedule alike.

With HSCAP_REUSE_CAPTURED=1 a captured request shares the cache instead, but its prefix match
is capped (Req._compute_max_prefix_len, from 0.5.15) at the longest prefix another captured
request was scheduled with (captured_prefixes.py); once matched (Req.init_next_round_input),
it records which request that prefix is borrowed from and the digest of the tokens it
matched, which its first captured piece carries into the index line. Only what no captured
request computed is prefilled again: the next turn of a captured conversation recomputes its
previous answer (decoded, never captured) and its new message.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from hs_capture.dump.capture_policy import MARK, CapturePolicy
from hs_capture.dump.token_hash import prefix_hash
from hs_capture.server.captured_prefixes import CapturedPrefixes
from hs_capture.server.forward_cost import SCHEDULER
from hs_capture.server.log import get_logger

log = get_logger()
_SUFFIX = "|hscap#"
_MAX_PLAIN = 1 << 20  # rids remembered without weak references (a Req that refuses them)


class RequestPicker:
    """Per process: which live requests the forward hook captures."""

    def __init__(self, policy: CapturePolicy, radix_cache: bool, can_reuse: bool = True) -> None:
        self.policy = policy
        self.reuse = CapturedPrefixes() if policy.reuse_captured and radix_cache and can_reuse else None
        self.follow = policy.follow and self.reuse is not None
        self.namespaces = policy.own_namespace and radix_cache and self.reuse is None
        self.radix_cache = radix_cache
        self._picked: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
        self._plain: Dict[str, bool] = {}
        self._count = itertools.count(1)
        self._lock = threading.Lock()

    def on_new_request(self, req: Any) -> None:
        rid = getattr(req, "rid", None)
        key = getattr(req, "extra_key", None)
        picked = self.policy.picks(rid, key)
        if not picked and not self.follow:
            return
        if picked:
            if self.namespaces:
                with self._lock:
                    n = next(self._count)
                req.extra_key = f"{key or ''}{_SUFFIX}{n}"
            elif key is not None and key == MARK + (getattr(req, "lora_id", None) or ""):
                # the bare mark is ours (SGLang appends a LoRA adapter's id to extra_key): the request
                # shares the cache as an unmarked one would
                req.extra_key = getattr(req, "lora_id", None)
        prompt = None
        # SGLang never matches a prompt with embedding overrides: it is prefilled whole and held by no one
        if self.reuse is not None and getattr(req, "positional_embed_overrides", None) is None:
            ns = (getattr(req, "extra_key", None), getattr(req, "cache_salt", None))  # its radix-cache namespace
            if picked:
                prompt = self.reuse.prompt(req.origin_input_ids, ns)
            else:
                prompt = self.reuse.continuing(req.origin_input_ids, ns)
                picked = prompt is not None
        if not picked:
            return
        if prompt is not None:
            req._hscap_prompt = prompt
        if (self.policy.everything and prompt is None) or rid is None:
            return
        try:
            self._picked[str(rid)] = req
        except TypeError:  # no weak references to this Req: a bounded plain record
            if len(self._plain) >= _MAX_PLAIN:
                self._plain.pop(next(iter(self._plain)))
            self._plain[str(rid)] = True

    def limit_prefix(self, req: Any, n: int) -> int:
        """The prefix length SGLang may match for `req` (it would allow n): a captured request
        reuses only what other captured requests hold."""
        prompt = getattr(req, "_hscap_prompt", None)
        if prompt is None or self.reuse is None:
            return n
        req._hscap_cap = None
        held, owner = self.reuse.limit(prompt, getattr(req, "rid", None))
        req._hscap_cap = (held, owner)
        return min(n, held)

    def after_match(self, req: Any) -> None:
        """SGLang matched `req`'s prefix (it may still wait to be prefilled): note what it
        borrows, from whom."""
        prompt = getattr(req, "_hscap_prompt", None)
        if prompt is None or self.reuse is None:
            return
        held, owner = getattr(req, "_hscap_cap", None) or (0, None)
        req._hscap_borrow = _Borrow(held, owner) if held > 0 and owner else None

    def on_batch(self, reqs: Any) -> None:
        """A prefill batch was formed: its captured requests hold what this chunk computes, and
        one put in a batch first since its match starts where it starts (HiCache may have
        loaded host hits onto what the match found; never past the cap)."""
        if self.reuse is None:
            return
        for req in reqs:
            prompt = getattr(req, "_hscap_prompt", None)
            if prompt is None or getattr(req, "rid", None) is None:
                continue
            b = getattr(req, "_hscap_borrow", None)
            if b is not None and b.start is None:
                b.start = matched_prefix(req)
                if 0 < b.start <= b.held:
                    self.reuse.lend(b.owner)
            self.reuse.add(prompt, str(req.rid), extend_end(req))

    def borrow_of(self, rid: Optional[str], prefix: int) -> Optional[Tuple[str, str]]:
        """(the request whose capture holds positions [0, prefix) of `rid`, the digest of
        those tokens) for the first piece of `rid`'s prefill when it starts from a borrowed
        prefix; else None."""
        req = self._picked.get(rid) if rid is not None else None
        b = getattr(req, "_hscap_borrow", None)
        if b is None or b.start != prefix or not 0 < prefix <= b.held:
            return None
        return b.owner, prefix_hash(_ids(req, prefix))

    def captured(self, rid: Optional[str]) -> bool:
        if self.policy.everything:
            return True
        return rid is not None and (rid in self._picked or rid in self._plain)

    def select(self, rids: Optional[List[Any]], count: int) -> Optional[List[bool]]:
        """Which of a batch's `count` sequences are captured; None: all of them."""
        if self.policy.everything:
            return None
        if rids is None:
            return [False] * count
        return [self.captured(None if r is None else str(r)) for r in rids]


@dataclass
class _Borrow:
    """What a captured request's match may borrow: up to `held` tokens, from `owner`; `start`:
    where its prefill began, once it is in a batch."""
    held: int
    owner: str
    start: Optional[int] = None


_picker: Optional[RequestPicker] = None
_hooked = False
_reuse_hooked = False


def _ids(req: Any, n: int) -> Any:
    """A request's first n token ids (a retracted request prefilled again: its output so far too)."""
    ids = req.origin_input_ids
    return ids[:n] if n <= len(ids) else (list(ids) + list(req.output_ids))[:n]


def extend_end(req: Any) -> int:
    """Where the chunk a prefill batch computes of `req` ends: `extend_end` from 0.5.23,
    `extend_range` in 0.5.15."""
    end = getattr(req, "extend_end", None)
    if isinstance(end, int):
        return end
    r = getattr(req, "extend_range", None)
    return int(r.end) if r is not None else len(req.get_fill_ids())


def matched_prefix(req: Any) -> int:
    """How many of a request's tokens SGLang took from the cache: `prefix_len` from 0.5.23,
    the matched KV indices before."""
    n = getattr(req, "prefix_len", None)
    return n if isinstance(n, int) else len(req.prefix_indices)


def set_hooked(on: bool) -> None:
    """The instrumentor says whether SGLang's request class carries our wrapper."""
    global _hooked
    _hooked = on


def is_hooked() -> bool:
    return _hooked


def set_reuse_hooked(on: bool) -> None:
    """The instrumentor says whether the request class's prefix match carries our cap."""
    global _reuse_hooked
    _reuse_hooked = on


def reusing() -> bool:
    """Captured requests reuse captured prefixes here (what the run metadata records)."""
    p = picker() if is_hooked() else None
    return p is not None and p.reuse is not None


def namespacing() -> bool:
    """Each captured request gets a cache namespace of its own here: the request class is
    hooked, the radix cache on and the policy asks for it (what the run metadata records)."""
    p = picker() if is_hooked() else None
    return p is not None and p.namespaces


def picker() -> Optional[RequestPicker]:
    """This process's picker, made on first use from the settings and the server's flags;
    None when capture is off here."""
    global _picker
    if _picker is None:
        from hs_capture.server import config
        from hs_capture.server.sglang_compat import flag, server_args

        if not config.is_enabled():
            return None
        args = server_args()
        radix = args is not None and flag(args, "disable_radix_cache") is False
        _picker = RequestPicker(config.capture_policy(), radix, _reuse_hooked and not _pipelined(args))
    return _picker


def reuse_refused() -> Optional[str]:
    """Why captured requests cannot reuse captured prefixes here though the policy asks, or None."""
    if not _reuse_hooked:
        return ("this SGLang has no Req._compute_max_prefix_len to cap a prefix match with (0.5.15 or later "
                "has), or its request classes carry someone else's wrapper")
    from hs_capture.server.sglang_compat import server_args

    if _pipelined(server_args()):
        return "with pipeline parallelism a stage's scheduler may match prefixes the others never see"
    return None


def _pipelined(args: Any) -> bool:
    from hs_capture.server.sglang_compat import flag

    return args is not None and int(flag(args, "pp_size") or 1) > 1


def _guarded(method: str, default: Any, *args: Any) -> Any:
    """This process's picker's `method`, or `default` where capture is off here or it fails:
    these run inside SGLang's scheduler, which must never see our exception. A request the
    policy cannot judge is served, not captured; one whose cap fails matches as SGLang would
    (a hole, reported, never a wrong borrow)."""
    t0 = time.perf_counter()
    try:
        p = picker()
        return default if p is None else getattr(p, method)(*args)
    except Exception as e:
        _fault(e)
        return default
    finally:
        SCHEDULER.add(_CALLS[method], time.perf_counter() - t0)


_CALLS = {"on_new_request": "pick", "limit_prefix": "cap", "after_match": "match", "on_batch": "batch"}


def on_new_request(req: Any) -> None:
    """Req.__init__'s wrapper calls this after the request is built."""
    _guarded("on_new_request", None, req)


def limit_prefix(req: Any, n: int) -> int:
    """Req._compute_max_prefix_len's wrapper calls this with SGLang's answer."""
    return _guarded("limit_prefix", n, req, n)


def after_match(req: Any) -> None:
    """Req.init_next_round_input's wrapper calls this once SGLang matched the prefix."""
    _guarded("after_match", None, req)


def on_batch(reqs: Any) -> None:
    """ScheduleBatch.prepare_for_extend's wrapper calls this with the batch's requests."""
    _guarded("on_batch", None, reqs)


_faults = 0


def _fault(e: BaseException) -> None:
    global _faults
    _faults += 1
    if _faults == 1 or _faults % 1000 == 0:
        log.error("capture's request bookkeeping failed (%d so far; serving goes on, that request may not be "
                  "captured or not whole): %s: %s", _faults, type(e).__name__, e)
