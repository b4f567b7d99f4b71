"""The server's scheduler and CUDA-graph modes, and the ones capture cannot be right under:
one rule for the hook's start-up (which refuses them) and for `hscap doctor` (which BLOCKs).

The overlap scheduler and decode CUDA graphs are right with capture on (checked on a GPU:
benchmarks/README.md, gpu/server.py). Prefill CUDA graphs are not (the forward wrapper runs only
while a graph is captured: captures vanish), nor is two-batch overlap (SGLang skips the
aux captures of layers >= first_k_dense_replace in its overlapped path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from hs_capture.server.sglang_compat import flag, decode_graph_state, overlap_scheduler, prefill_graph_state


@dataclass(frozen=True)
class Wrong:
    what: str  # the mode, as doctor names its finding
    why: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what} {self.why}; {self.fix}"


@dataclass(frozen=True)
class ServerModes:
    overlap: bool
    decode_graphs: Optional[str]  # backend name, None = eager
    prefill_graphs: Optional[str]  # mode name, None = eager
    two_batch_overlap: bool

    def describe(self) -> str:
        return (f"scheduler {'overlap (default)' if self.overlap else 'normal (--disable-overlap-schedule)'}; "
                f"decode CUDA graphs {self.decode_graphs or 'off'}; "
                f"prefill {'CUDA graphs ' + self.prefill_graphs if self.prefill_graphs else 'eager'}")

    def wrong(self, off_flags: str = "--disable-prefill-cuda-graph") -> List[Wrong]:
        """What would make capture wrong under these modes (empty: right). `off_flags`: what
        turns prefill graphs off in this release."""
        out = []
        if self.prefill_graphs:
            out.append(Wrong("prefill CUDA graphs", f"on ({self.prefill_graphs}): the forward hook would run only "
                             "at graph capture and captures would silently vanish",
                             f"add {off_flags} (hscap serve does)"))
        if self.two_batch_overlap:
            out.append(Wrong("two-batch overlap", "on: SGLang skips the captures of layers >= "
                             "first_k_dense_replace in its overlapped path",
                             "drop --enable-two-batch-overlap while extracting"))
        return out


def read_modes(args: Any) -> ServerModes:
    """The modes of a running server (its ServerArgs) or of parsed launch flags (doctor)."""
    return ServerModes(overlap=overlap_scheduler(args), decode_graphs=decode_graph_state(args),
                       prefill_graphs=prefill_graph_state(args),
                       two_batch_overlap=bool(flag(args, "enable_two_batch_overlap")))
