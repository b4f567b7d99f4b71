"""What hs_capture reads from SGLang's runtime, found by feature detection (never by
version string): ranks, server flags, the scheduler and CUDA-graph modes. Every probe
the hook runs is guarded: a missing helper means "try the next one", never an exception
into the host.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from hs_capture.dump.paths import RankId


def sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        return "unknown"


def _call(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)()
    except Exception:
        return None


def _attr(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name)
    except Exception:
        return None


@dataclass(frozen=True)
class ParallelInfo:
    rank: RankId
    attn_tp_rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    is_last_pp_rank: bool

    @property
    def writes(self) -> bool:
        """One writer per DP group: its attention-TP rank 0, on the last PP stage."""
        return self.attn_tp_rank == 0 and self.is_last_pp_rank

    def as_dict(self) -> Dict[str, int]:
        return {"dp_rank": self.rank.dp, "tp_rank": self.rank.tp, "pp_rank": self.rank.pp,
                "attn_tp_rank": self.attn_tp_rank, "tp_size": self.tp_size,
                "pp_size": self.pp_size, "dp_size": self.dp_size}


def parallel_info(pp_group: Any = None) -> ParallelInfo:
    """Ranks of this process. 0.5.15+: runtime_context.get_parallel(); older: the helpers."""
    par = _call("sglang.srt.runtime_context", "get_parallel")

    def first(*probes: Callable[[], Any], default: int = 0) -> int:
        for probe in probes:
            try:
                value = probe()
            except Exception:
                continue
            if isinstance(value, int):
                return value
        return default

    tp = first(lambda: par.tp_rank, lambda: _call("sglang.srt.distributed", "get_tensor_model_parallel_rank"))
    attn_tp = first(
        lambda: par.attn_tp_rank,
        lambda: _call("sglang.srt.layers.dp_attention", "get_attention_tp_rank"),
        default=tp,
    )
    dp = first(lambda: par.attn_dp_rank, lambda: _call("sglang.srt.layers.dp_attention", "get_attention_dp_rank"))
    pp = first(lambda: pp_group.rank_in_group, lambda: par.pp_rank)
    tp_size = first(lambda: par.tp_size, lambda: _call("sglang.srt.distributed", "get_tensor_model_parallel_world_size"), default=1)
    pp_size = first(lambda: pp_group.world_size, lambda: par.pp_size, default=1)
    dp_size = first(lambda: par.attn_dp_size, lambda: par.dp_size, default=1)
    last = _attr(pp_group, "is_last_rank")
    return ParallelInfo(RankId(dp, tp, pp), attn_tp, tp_size, pp_size, dp_size,
                        True if last is None else bool(last))


def server_args() -> Any:
    """The operator's server arguments, wherever this release keeps them (or None)."""
    for module, name in (
        ("sglang.srt.runtime_context", "get_server_args"),  # 0.5.15+
        ("sglang.srt.server_args", "get_global_server_args"),  # 0.5.x before the context
    ):
        value = _call(module, name)
        if value is not None:
            return value
    try:
        from sglang.srt.managers.schedule_batch import global_server_args_dict  # oldest

        return dict(global_server_args_dict)
    except Exception:
        return None


def flag(args: Any, name: str) -> Any:
    if isinstance(args, dict):
        return args.get(name)
    return _attr(args, name)


RELEVANT_FLAGS = (
    "model_path", "served_model_name", "dtype", "device", "tp_size", "pp_size", "dp_size",
    "enable_dp_attention", "disable_radix_cache", "chunked_prefill_size", "enable_mixed_chunk",
    "disable_cuda_graph", "disable_prefill_cuda_graph", "cuda_graph_backend_prefill",
    "enable_piecewise_cuda_graph", "disable_piecewise_cuda_graph", "enable_two_batch_overlap",
    "speculative_algorithm", "disable_overlap_schedule", "max_prefill_tokens", "nnodes",
)


def relevant_flags(args: Any) -> Dict[str, Any]:
    out = {}
    for name in RELEVANT_FLAGS:
        value = flag(args, name)
        if value is not None:
            out[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return out


PIECEWISE_DEFAULT_ON = ("piecewise prefill CUDA graphs, on by default in this release, which --disable-cuda-graph "
                        "leaves on: add --disable-piecewise-cuda-graph")


# the server-argument fields prefill_graph_off_flags decides by
PREFILL_GRAPH_FIELDS = ("disable_prefill_cuda_graph", "disable_piecewise_cuda_graph")


def prefill_graph_off_flags(server_args_fields: "set[str]") -> List[str]:
    """The flags that keep every prefill eager, and leave decode graphs on, in the release whose
    server-argument names are given. Decode is never captured, so its graphs can stay."""
    if "disable_prefill_cuda_graph" in server_args_fields:  # 0.5.15+: the prefill phase alone
        return ["--disable-prefill-cuda-graph"]
    if "disable_piecewise_cuda_graph" in server_args_fields:  # 0.5.10-0.5.14: the only prefill graphs
        return ["--disable-piecewise-cuda-graph"]
    return ["--disable-cuda-graph"]  # a release we cannot tell: the flag every release has


def server_arg_names() -> "set[str]":
    """Every server-argument name of the sglang in this process (dataclass or msgspec).
    Raises where sglang does not import (prefill_off_flags_here guards it)."""
    from sglang.srt.server_args import ServerArgs

    names = set(getattr(ServerArgs, "__dataclass_fields__", None) or ())
    names |= set(getattr(ServerArgs, "__struct_fields__", None) or ())
    names |= {k for k in vars(ServerArgs) if not k.startswith("_")}
    return names


def prefill_off_flags_here() -> List[str]:
    """prefill_graph_off_flags of the sglang in this process (the flag every release has, if it
    cannot tell)."""
    try:
        return prefill_graph_off_flags(server_arg_names())
    except Exception:
        return ["--disable-cuda-graph"]


def on_cuda(args: Any) -> bool:
    return str(flag(args, "device") or "cuda") in ("cuda", "gpu")


def _phase_backend(args: Any, phase: str) -> Optional[str]:
    """The CUDA-graph backend SGLang resolved for a phase ("decode"/"prefill"), where the release
    publishes one: 0.5.23 in runtime_context.get_exec(), 0.5.15 on the server args."""
    probes = (lambda: importlib.import_module("sglang.srt.runtime_context").get_exec().graph.cuda_graph_config,
              lambda: flag(args, "cuda_graph_config"))
    for probe in probes:
        try:
            cfg = probe()
        except Exception:
            continue
        backend = _attr(_attr(cfg, phase), "backend") if cfg is not None and not isinstance(cfg, (str, dict)) else None
        if backend is not None:
            return str(getattr(backend, "value", backend))
    return None


def prefill_graph_state(args: Any) -> Optional[str]:
    """Name of the prefill CUDA-graph mode in effect, or None when prefill runs eagerly.

    Under a prefill graph the forward wrapper runs only while the graph is captured,
    so captures would silently vanish. Resolved config first (0.5.15+), flags after.
    """
    if not on_cuda(args):
        return None  # graphs are CUDA-only; a CPU server always prefills eagerly
    backend = _phase_backend(args, "prefill")
    if backend is not None:
        return None if backend.lower() == "disabled" else f"cuda_graph_backend_prefill={backend}"
    if flag(args, "disable_prefill_cuda_graph"):
        return None
    piecewise_off = flag(args, "disable_piecewise_cuda_graph")
    if isinstance(piecewise_off, bool) and flag(args, "enable_piecewise_cuda_graph") is None:
        # 0.5.10-0.5.14: piecewise prefill graphs are on by default, and only their own flag
        # turns them off: --disable-cuda-graph leaves them on (model_runner checks only it)
        return None if piecewise_off else PIECEWISE_DEFAULT_ON
    if flag(args, "disable_cuda_graph"):
        return None
    if flag(args, "enable_piecewise_cuda_graph") and not flag(args, "disable_piecewise_cuda_graph"):
        return "enable_piecewise_cuda_graph"
    backend = flag(args, "cuda_graph_backend_prefill")
    if backend not in (None, "disabled", "DISABLED"):
        return f"cuda_graph_backend_prefill={backend}"
    return None


def decode_graph_state(args: Any) -> Optional[str]:
    """Name of the decode CUDA-graph mode in effect, or None when decode runs eagerly. Harmless
    to capture either way: decode is never captured, and a replay never enters the hook."""
    if not on_cuda(args):
        return None
    backend = _phase_backend(args, "decode")
    if backend is not None:
        return None if backend.lower() == "disabled" else backend
    if flag(args, "disable_cuda_graph") or flag(args, "disable_decode_cuda_graph"):
        return None
    backend = flag(args, "cuda_graph_backend_decode")
    if backend in ("disabled", "DISABLED"):
        return None
    return str(backend or "on")


def overlap_scheduler(args: Any) -> bool:
    """True when SGLang runs its (default) overlap scheduler: the next batch is prepared, and
    its inputs loaded, while this one still runs."""
    return not flag(args, "disable_overlap_schedule")
