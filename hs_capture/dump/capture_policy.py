"""Which requests a server captures: the one rule, shared by the server's hook (which picks)
and the offline tools (which can say what a policy picked). Pure logic, torch-free.

A request is captured when a client marks it (its `extra_key` starts with MARK: a field of
SGLang's /generate and OpenAI requests since 0.5.10 that reaches the scheduler, which an
HTTP header does not) or when the hash of its rid falls under the fraction. A hash, not a
random draw: a retry of the same rid is picked again, and every tensor-parallel rank (each
with its own scheduler) picks the same requests without talking to the others.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Dict, Optional

MARK = "hscap"


def rid_fraction(rid: str) -> float:
    """Where a rid falls in [0, 1): the first 8 bytes of its BLAKE2b digest."""
    digest = hashlib.blake2b(str(rid).encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / float(1 << 64)


def is_marked(extra_key: Optional[str]) -> bool:
    return isinstance(extra_key, str) and extra_key.startswith(MARK)


@dataclass(frozen=True)
class CapturePolicy:
    fraction: float = 1.0  # of unmarked requests, by rid hash
    # give each captured request a radix-cache namespace of its own, so that it is prefilled
    # from position 0 while the rest of the traffic keeps its prefix reuse
    own_namespace: bool = True
    # instead: share the cache, but reuse only prefixes earlier captured requests hold, and
    # record which request each borrowed prefix comes from (merge joins them)
    reuse_captured: bool = False
    # also capture each request that continues a captured prompt (the next turn of a captured
    # conversation; only with reuse_captured, whose index knows the captured prompts)
    follow: bool = False

    @property
    def everything(self) -> bool:
        return self.fraction >= 1.0

    def picks(self, rid: Optional[str], extra_key: Optional[str] = None) -> bool:
        if self.everything or is_marked(extra_key):
            return True
        return rid is not None and self.fraction > 0.0 and rid_fraction(rid) < self.fraction

    def describe(self) -> str:
        share = "every request" if self.everything else (
            f"{self.fraction:.4g} of requests by rid hash and" if self.fraction > 0 else "only")
        marked = "" if self.everything else f" requests marked extra_key={MARK}*"
        follow = " and the requests that continue a captured prompt" if self.follow and not self.everything else ""
        return f"{share}{marked}{follow}"

    def as_meta(self, radix_cache: bool, namespaced: bool, reusing: bool = False) -> Dict[str, Any]:
        """What the run metadata records of the policy (FORMAT.md)."""
        out = {"fraction": self.fraction, "mark": f"extra_key starts with {MARK!r}", "radix_cache": radix_cache,
               "own_namespace": namespaced}
        if reusing:
            out.update(reuse_captured=True, follow=self.follow)
        return out
