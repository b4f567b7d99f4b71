"""The request side of capture: each new SGLang request (`Req.__init__`, in the scheduler
process that also runs the model) is judged once by the capture policy; a picked request is
remembered by rid for the forward hook (capture.py) and, with the radix cache on, given a
radix-cache namespace of its own so that it is prefilled from position 0 (a prefix hit
would leave a hole in its capture) while every other request keeps its prefix reuse.

The namespace is the request's `extra_key` (SGLang keys its radix tree on it since 0.5.10)
with a counter appended: unique even when a rid is sent again (a resend must not hit the
first send's cache). Every tensor-parallel rank's scheduler builds the same requests in the
same order, so the counters agree and the ranks schedule alike.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Dict, List, Optional

from hs_capture.dump.capture_policy import MARK, CapturePolicy
from hs_capture.server.log import get_logger

log = get_logger()
_SUFFIX = "|hscap#"
_MAX_PLAIN = 1 << 20  # rids remembered without weak references (a Req that refuses them)


class RequestPicker:
    """Per process: which live requests the forward hook captures."""

    def __init__(self, policy: CapturePolicy, radix_cache: bool) -> None:
        self.policy = policy
        self.namespaces = policy.own_namespace and radix_cache
        self.radix_cache = radix_cache
        self._picked: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
        self._plain: Dict[str, bool] = {}
        self._count = itertools.count(1)
        self._lock = threading.Lock()

    def on_new_request(self, req: Any) -> None:
        rid = getattr(req, "rid", None)
        if not self.policy.picks(rid, getattr(req, "extra_key", None)):
            return
        key = getattr(req, "extra_key", None)
        if self.namespaces:
            with self._lock:
                n = next(self._count)
            req.extra_key = f"{key or ''}{_SUFFIX}{n}"
        elif key == MARK:  # the bare mark is ours: the request shares the cache as an unmarked one would
            req.extra_key = None
        if self.policy.everything or rid is None:
            return
        try:
            self._picked[str(rid)] = req
        except TypeError:  # no weak references to this Req: a bounded plain record
            if len(self._plain) >= _MAX_PLAIN:
                self._plain.pop(next(iter(self._plain)))
            self._plain[str(rid)] = True

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


_picker: Optional[RequestPicker] = None
_hooked = False


def set_hooked(on: bool) -> None:
    """The instrumentor says whether SGLang's request class carries our wrapper."""
    global _hooked
    _hooked = on


def is_hooked() -> bool:
    return _hooked


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
        _picker = RequestPicker(config.capture_policy(), radix)
    return _picker


def on_new_request(req: Any) -> None:
    """Req.__init__'s wrapper calls this after the request is built. Never raises: a request
    the policy cannot judge is served, not captured."""
    try:
        p = picker()
        if p is not None:
            p.on_new_request(req)
    except Exception as e:
        _fault(e)


_faults = 0


def _fault(e: BaseException) -> None:
    global _faults
    _faults += 1
    if _faults == 1 or _faults % 1000 == 0:
        log.error("judging a request for capture failed (%d so far; that request is not captured): %s: %s",
                  _faults, type(e).__name__, e)
