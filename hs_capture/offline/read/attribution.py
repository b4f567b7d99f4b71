"""Which captured requests are a user's. A merge without --dataset takes every captured rid;
some are not training data:
  - SGLang's health checks (rid HEALTH_CHECK_...): never planned (planning.plan);
  - SGLang's startup warmup (a 3-token or one-sentence prompt, rid = uuid4().hex, the first
    prefill of every writing rank; `hscap serve` turns it off with --skip-server-warmup):
    left out, and said;
  - any other request whose rid SGLang generated (the client gave none, so no dataset id can
    name it): kept, and reported as unattributed.
With --dataset only the dataset's ids are merged, so none of this applies."""

from __future__ import annotations

import re
from typing import Dict, List, Mapping, Sequence

_GENERATED = re.compile(r"[0-9a-f]{32}")  # uuid.uuid4().hex: SGLang's rid when the client sent none
WARMUP = "SGLang's startup warmup request (the rank's first prefill, an id SGLang generated); not user data"


def generated_by_sglang(rid: str) -> bool:
    return bool(_GENERATED.fullmatch(rid))


def warmups(samples: Mapping[str, Sequence]) -> Dict[str, str]:
    """rid -> why, for the samples (rid -> their pieces, by position) that are SGLang's
    startup warmup."""
    return {rid: WARMUP for rid, pcs in samples.items()
            if generated_by_sglang(rid) and pcs[0].step == 0 and pcs[0].prefix == 0}


def unattributed(samples: Mapping[str, Sequence]) -> List[str]:
    """The samples whose id SGLang generated: no dataset id can name them."""
    return sorted(rid for rid in samples if generated_by_sglang(rid))
