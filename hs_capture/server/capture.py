"""What to take from a target's forward, and how to hand SGLang back what it expects.

Patching lives in instrumentor.py; this module is the logic behind the two wrappers of
every target (targets.py): `setup_model` (after `<Family>ForCausalLM.__init__`) and
`ModelCapture.forward` (around `<Family>Model.forward`). SGLang's own capture does the
work on the GPU: the layers it is told to capture make the forward return `(hidden, aux)`,
taken after the fused all-reduce, so it is right under TP > 1.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import threading
import time
import weakref
from dataclasses import asdict, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from hs_capture.version import __version__

from hs_capture.server import config as config_mod
from hs_capture.server.config import CaptureConfig, ConfigError
from hs_capture.server.log import get_logger
from hs_capture.server.modes import ServerModes, read_modes
from hs_capture.dump.layer_ids import served_ids
from hs_capture.server.sglang_compat import parallel_info, prefill_off_flags_here, relevant_flags, server_args, sglang_version
from hs_capture.server.targets import LAYER_FLAGS, LIST, Target, checkpoint_architectures
from hs_capture.dump import quant
from hs_capture.dump.schema import SCHEMA_COMPACT, SCHEMA_LOSSLESS, RankMeta
from hs_capture.server.forward_cost import AllocatorCounters, ForwardCost, SchedulerCost, ServerThreads
from hs_capture.server import requests as requests_mod
from hs_capture.server.step import compact, take_step
from hs_capture.server.writer import ShardWriter

log = get_logger()

# Real prefill only: not decode, idle, verify or draft passes (their tokens are not the prompt's).
CAPTURED_MODES = frozenset({"EXTEND", "MIXED"})
_ERROR_LOG_EVERY = 100
_writers: "weakref.WeakSet[ShardWriter]" = weakref.WeakSet()


class ModelCapture:
    """Per-Model (`DeepseekV2Model`, `LlamaModel`, ...) state. Kept in the instance __dict__
    as `_hscap_state`."""

    def __init__(self, layers: List[int], host_layers: List[int], hidden_size: int,
                 writer: Optional[ShardWriter], parent: Any, select: str = LIST, store: str = "lossless") -> None:
        self.layers = layers
        self.store = store  # "fp8": each step's states go to the compact tier on the device
        self.layer_flags = select == LAYER_FLAGS
        self.host_layers = host_layers  # what SGLang itself asked for (EAGLE-3, DFlash)
        self.host_flag = bool(getattr(parent, "capture_aux_hidden_states", False))
        self.hidden_size = hidden_size
        self.writer = writer
        self._parent = weakref.ref(parent)
        self._last_set: Optional[List[int]] = None
        self._lists: Optional[tuple] = None  # (ours + host's, host's only)
        self.errors = 0
        self.steps = 0
        self._graph_skips = 0
        self._want_prenorm = False
        self._prenorm: Optional[torch.Tensor] = None
        self.prenorm_hooked = False
        self.picker: Optional[requests_mod.RequestPicker] = None  # which requests (None: all)
        # (rid, prefix) -> (the rid it borrowed [0, prefix) from, their digest), with reuse on
        self.borrows: Optional[Callable[[Optional[str], int], Optional[Tuple[str, str]]]] = None

    def hook_prenorm(self, norm: Any) -> None:
        """Capture the final norm's input. Called as norm(hidden, residual) it returns
        (normed, hidden + residual): the updated residual IS the pre-norm state, taken
        after any fused all-reduce; called as norm(hidden), the input is."""

        def after_norm(module, inputs, output):
            if self._want_prenorm:
                pre = output[1] if isinstance(output, tuple) and len(output) > 1 else inputs[0]
                self._prenorm = pre.detach().clone()  # borrowed storage: own a copy

        self._prenorm_handle = norm.register_forward_hook(after_norm)
        self.prenorm_hooked = True

    # The host may call set_eagle3_layers_to_capture after us, possibly with the very layers
    # we chose: it always assigns a new list, so a list object we did not set is theirs.
    def _sync_host(self, current: List[int]) -> None:
        if self._last_set is not None and current is not self._last_set:
            host = sorted(set(current))
            if host != self.host_layers:
                self.host_layers = host
                self.log_layer_sets()
            self._lists = None

    def log_layer_sets(self) -> None:
        """Both layer sets, whenever the host's changes: a speculating server's log shows its
        drafter keeps its own layers while the hook captures others."""
        if self.host_layers:
            log.info("layer sets: SGLang's own capture (a speculative drafter, or its aux-state flag) takes "
                     "layers %s, handed to it alone; the hook captures %s", self.host_layers, self.layers)

    def layers_for(self, model: Any, capturing: bool) -> List[int]:
        """Set (and return) the layers SGLang captures in this forward. The two lists are
        built once per host change, not per forward: decode steps run this too."""
        self._sync_host(model.layers_to_capture)
        if self._lists is None:
            self._lists = (sorted(set(self.host_layers) | set(self.layers)), list(self.host_layers))
        want = self._lists[0] if capturing else self._lists[1]
        if self.layer_flags and want is not self._last_set:
            _flag_layers(model, want)
        model.layers_to_capture = want
        self._last_set = want
        return want

    def forward(self, wrapped, model: Any, args: tuple, kwargs: dict):
        fb = kwargs.get("forward_batch", args[2] if len(args) > 2 else None)
        mode = getattr(getattr(fb, "forward_mode", None), "name", None)
        capturing = self.writer is not None and not self.writer.stopped and mode in CAPTURED_MODES
        keep = None
        if capturing and self.picker is not None:
            try:
                keep = self.picker.select(getattr(fb, "rids", None), len(fb.extend_seq_lens_cpu))
            except Exception as e:  # never let bookkeeping break serving
                self._error("request selection", e)
                keep = []
            if keep is not None:
                capturing = any(keep)
                keep = None if all(keep) else keep
        if capturing and _graph_capturing():
            # Under CUDA-graph capture this Python runs once, on placeholder inputs, and never
            # again on replay: take nothing (and add no layer to the graph), say so once.
            capturing = False
            self._graph_skips += 1
            if self._graph_skips == 1:
                log.warning("a %s forward ran under CUDA-graph capture: not captured (its replays "
                            "would never reach this hook); disable prefill CUDA graphs", mode)
        try:
            current = self.layers_for(model, capturing)
        except Exception as e:  # never let bookkeeping break serving
            self._error("layer bookkeeping", e)
            capturing, current = False, list(model.layers_to_capture)
        self._want_prenorm = capturing and self.prenorm_hooked
        try:
            out = wrapped(*args, **kwargs)
        finally:
            self._want_prenorm = False
        hidden, aux = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
        if capturing and aux is not None:
            try:
                self._capture(fb, mode, hidden, aux, current, keep)
            except Exception as e:
                self._error("capture", e)
        return self._host_output(hidden, aux, current)

    def _host_output(self, hidden: Any, aux: Any, current: List[int]):
        """Exactly what the CausalLM would get without us."""
        parent = self._parent()
        wants_tuple = bool(getattr(parent, "capture_aux_hidden_states", False))
        if not wants_tuple:
            return hidden
        if aux is None or not self.host_layers:
            return hidden, None
        if current == self.host_layers:
            return hidden, aux
        idx = [current.index(i) for i in self.host_layers]
        if isinstance(aux, torch.Tensor):
            h = self.hidden_size
            return hidden, torch.cat([aux[..., j * h:(j + 1) * h] for j in idx], dim=-1)
        return hidden, [aux[j] for j in idx]

    def _capture(self, fb: Any, mode: str, hidden: torch.Tensor, aux: Any, current: List[int],
                 keep: Optional[List[bool]] = None) -> None:
        pre = None
        if self.prenorm_hooked:
            pre, self._prenorm = self._prenorm, None
            if pre is None:
                raise ValueError("the final norm's input was not seen in this forward")
        t0 = time.perf_counter()
        line, tensors, aux_layers = take_step(fb, mode, hidden, aux, current, self.layers, self.hidden_size, pre,
                                              keep, self.borrows)
        self.writer.cost.add("step_line", time.perf_counter() - t0)
        if self.store == "fp8":
            t0 = time.perf_counter()
            line, tensors, aux_layers = compact(line, tensors, aux_layers, self.hidden_size)
            self.writer.cost.add("quantize", time.perf_counter() - t0)
        self.writer.submit(line, tensors, aux_layers)
        self.steps += 1
        if self.steps == 1:
            log.info("rank %s: first prefill captured (%d tokens, %d sequences, %s)",
                     self.writer.rank.tag, line.num_tokens, len(line.seqs), line.dtype)

    def _error(self, what: str, e: BaseException) -> None:
        self.errors += 1
        if self.errors == 1 or self.errors % _ERROR_LOG_EVERY == 0:
            log.error("%s failed (%d so far), serving continues: %s: %s", what, self.errors, type(e).__name__, e)

    def restore(self, model: Any) -> None:
        """Give SGLang back the capture settings it had before us."""
        model.layers_to_capture = list(self.host_layers)
        if self.layer_flags:
            _flag_layers(model, self.host_layers)
        if self.prenorm_hooked:
            self._prenorm_handle.remove()
            self.prenorm_hooked = False
        parent = self._parent()
        if parent is not None:
            parent.capture_aux_hidden_states = self.host_flag or bool(self.host_layers)


def _flag_layers(model: Any, layers: List[int]) -> None:
    """The layer-flag families read `_is_layer_to_capture` on each decoder layer."""
    wanted = set(layers)
    for i, layer in enumerate(model.layers):
        if bool(getattr(layer, "_is_layer_to_capture", False)) != (i in wanted):
            setattr(layer, "_is_layer_to_capture", i in wanted)


def _graph_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def setup_model(causal_lm: Any, hf_config: Any, target: Optional[Target] = None) -> Optional[ModelCapture]:
    """Turn capture on for a freshly built CausalLM. ConfigError stops the server."""
    model = getattr(causal_lm, "model", None)
    if model is None or not hasattr(model, "layers_to_capture"):
        log.info("%s has no layers_to_capture (a NextN/MTP draft?): not captured", type(causal_lm).__name__)
        return None
    par = parallel_info(getattr(causal_lm, "pp_group", None))
    if not par.is_last_pp_rank:
        log.info("pp rank %d is not the last stage: it holds no captures", par.rank.pp)
        return None
    cfg = config_mod.load()
    num_layers = int(hf_config.num_hidden_layers)
    layers = config_mod.resolve_layers(cfg.layers, num_layers)
    args = server_args()
    modes = read_modes(args)
    wrong = modes.wrong(" ".join(prefill_off_flags_here()))
    if wrong:
        raise ConfigError("; ".join(str(w) for w in wrong))
    writer = None
    if par.writes:
        config_mod.check_dump_dir(cfg.run_dir)
        flags = relevant_flags(args)
        writers = config_mod.writers_on_host(par.dp_size, bool(flags.get("enable_dp_attention")), flags.get("nnodes") or 1)
        cfg = replace(cfg, writer_threads=config_mod.writer_threads(cfg, writers))
        meta = _run_meta(cfg, hf_config, layers, flags, par, modes, target)
        rows = full_step_rows(flags)
        writer = ShardWriter(cfg, par.rank, meta, expected_rows=rows,
                             step_sizes=_step_bytes(rows, int(hf_config.hidden_size), len(layers), hf_config,
                                                    cfg.prenorm, cfg.store))
        writer.start()
        _writers.add(writer)
        writer.prewarm()
        _install_shutdown(cfg.flush_timeout_s)
    state = ModelCapture(layers, sorted(model.layers_to_capture), int(hf_config.hidden_size), writer, causal_lm,
                         target.select if target is not None else LIST, cfg.store)
    if cfg.prenorm and writer is not None:
        state.hook_prenorm(model.norm)
    if writer is not None:
        picker = _policy_picker(cfg, flags)
        state.picker = None if picker is None or picker.policy.everything else picker
        state.borrows = picker.borrow_of if picker is not None and picker.reuse is not None else None
    model.__dict__["_hscap_state"] = state  # plain attribute: nn.Module.__setattr__ would not do
    state.log_layer_sets()
    state.layers_for(model, capturing=True)
    causal_lm.capture_aux_hidden_states = True
    where = (f"writing {cfg.run_dir} as {par.rank.tag} ({writer.cfg.writer_threads} threads in "
             f"{'a writer process' if writer.cfg.writer == 'process' else 'this process'}, "
             f"{writer.cfg.max_inflight_bytes / 2 ** 30:.1f} GiB in flight)") if writer else f"rank {par.rank.tag} does not write (attention-TP rank {par.attn_tp_rank})"
    log.info("%s: layers_to_capture=%s (%s); final state post-norm%s; stored %s; %s",
             type(causal_lm).__name__, layers, "entering-layer convention",
             " and pre-norm" if cfg.prenorm else "",
             "lossless" if cfg.store == "lossless" else "fp8 (the compact tier: FP8 e4m3, one scale per token)", where)
    in_memory = writer.in_memory() if writer is not None else None
    if in_memory:
        log.info("rank %s: %s", par.rank.tag, in_memory)
    log.info("CausalLM: capture_aux_hidden_states=True")
    log.info("server modes: %s", modes.describe())
    unservable = served_ids(layers, "sglang", target.family if target else None, sglang_version()).problem()
    if writer is not None and unservable:  # the data is right; a drafter trained on it would be served wrong
        log.warning("WARNING: %s", unservable)
    return state


def _policy_picker(cfg: CaptureConfig, flags: Dict[str, Any]) -> Optional["requests_mod.RequestPicker"]:
    """The requests picker the forward asks (None: every request), and the server log's line
    saying which policy runs and what the radix cache does to it."""
    radix = flags.get("disable_radix_cache") is False
    picker = requests_mod.picker() if requests_mod.is_hooked() else None
    if picker is None and (radix or not cfg.policy.everything):
        log.warning("WARNING: SGLang's request class is not hooked here: every request is captured and "
                    "captured requests share the radix cache")
    # what runs, not what was asked: following needs the index that reuse keeps
    policy = replace(picker.policy, follow=picker.follow).describe() if picker is not None else "every request"
    own = requests_mod.namespacing()
    reuse = picker is not None and picker.reuse is not None
    if not radix and cfg.policy.reuse_captured and picker is not None:
        follow = cfg.policy.follow and not cfg.policy.everything
        log.warning("WARNING: %s not taken: the radix cache is off, so captured requests are prefilled "
                    "whole%s (hscap serve --reuse-captured keeps the cache)",
                    "HSCAP_REUSE_CAPTURED=1 and HSCAP_FOLLOW=1 are" if cfg.policy.follow else "HSCAP_REUSE_CAPTURED=1 is",
                    " and the requests that continue them are not captured" if follow else "")
    if radix and cfg.policy.reuse_captured and not reuse and picker is not None:
        log.warning("WARNING: HSCAP_REUSE_CAPTURED=1 is not taken (SGLang %s): %s; captured requests %s",
                    sglang_version(), requests_mod.reuse_refused(), "get a cache namespace of their own instead"
                    if own else "share the cache as HSCAP_CACHE_NAMESPACE=0 says")
    log.info("capture policy: %s; %s", policy, "radix cache off" if not radix else (
        "radix cache on: captured requests reuse only prefixes that captured requests computed (merge joins "
        "them), the rest keep their prefix reuse" if reuse else
        "radix cache on: each captured request gets a cache namespace of its own (prefilled whole), the rest "
        "keep their prefix reuse" if own else "radix cache on and shared by captured requests"))
    if radix and not own and not reuse:
        log.warning("WARNING: the radix cache is on and captured requests share it: a prefix hit is never "
                    "recomputed, so that sample's capture starts past position 0; such samples are detected and "
                    "reported incomplete (hscap send resumes them only after a restart). Keep "
                    "HSCAP_CACHE_NAMESPACE=1, or use --disable-radix-cache")
    return picker


def full_step_rows(flags: Dict[str, Any]) -> int:
    """The most tokens one forward holds: the chunked-prefill size, or with chunking off (-1)
    the prefill budget (a single longer request is still admitted alone: pinned when it comes)."""
    for key in ("chunked_prefill_size", "max_prefill_tokens"):
        rows = int(flags.get(key) or 0)
        if rows > 0:
            return rows
    return 0


def _step_bytes(rows: int, hidden: int, k: int, hf_config: Any, prenorm: bool = False,
                store: str = "lossless") -> List[int]:
    """Host bytes of one full step: packed aux (or, in the compact tier, each layer's state and
    scale), final, the pre-norm state when captured, input_ids, positions. Every tensor the
    step holds: the pinned buffers are cut to this."""
    if rows <= 0:
        return []
    if store == "fp8":
        return [rows * hidden, rows * 4] * (k + 1 + int(prenorm)) + [rows * 8, rows * 8]
    dtype = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    itemsize = 4 if str(dtype).endswith("float32") else 2
    states = [rows * hidden * k * itemsize, rows * hidden * itemsize] + ([rows * hidden * itemsize] if prenorm else [])
    return states + [rows * 8, rows * 8]


def _run_meta(cfg: CaptureConfig, hf_config: Any, layers: List[int], flags: Dict[str, Any], par: Any,
              modes: ServerModes, target: Optional[Target]) -> RankMeta:
    return RankMeta(
        run_id=cfg.run_id,
        layers=layers,
        hidden_size=int(hf_config.hidden_size),
        num_layers=int(hf_config.num_hidden_layers),
        prenorm=cfg.prenorm,
        model_path=flags.get("model_path"),
        family=target.family if target is not None else None,
        architectures=list(getattr(hf_config, "architectures", None) or []),
        # a wrapper (Kimi-K2.5) builds the captured CausalLM from its text_config, whose
        # architectures name only the inner class: record what the checkpoint says too
        served_architectures=checkpoint_architectures(flags.get("model_path")) or [],
        sglang_version=sglang_version(),
        hs_capture_version=__version__,
        parallel=par.as_dict(),
        schema=SCHEMA_COMPACT if cfg.store == "fp8" else SCHEMA_LOSSLESS,
        extra={
            "torch_version": torch.__version__,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "model_type": getattr(hf_config, "model_type", None),
            "dtype_requested": flags.get("dtype"),
            "sglang_layers_to_capture": layers,  # SGLang's own numbering is ours (entering layer)
            "server_flags": flags,
            "server_modes": asdict(modes),
            "codec": cfg.codec,
            "level": cfg.level,
            "store": cfg.store if cfg.store == "lossless" else quant.SCHEME,
            "writer_threads": cfg.writer_threads,
            "writer": cfg.writer,
            "on_full": cfg.on_full,
            "capture_policy": cfg.policy.as_meta(flags.get("disable_radix_cache") is False,
                                                 requests_mod.namespacing(), requests_mod.reusing()),
        },
    )


# ----------------------------------------------------------------- shutdown
_shutdown_installed = False


def close_all(timeout: float = 600.0) -> None:
    for w in list(_writers):
        done = w.close(timeout)
        s, f = w.stats, w.forward_stats()
        log.info("rank %s: closed%s: %d steps, %d tokens, %.1f MB raw -> %.1f MB on disk, %d dropped, %d failed; "
                 "%s; %s; %s%s", w.rank.tag, "" if done else " (TIMED OUT, some steps unwritten)", s["steps_written"],
                 s["tokens_written"], s["raw_bytes"] / 1e6, s["file_bytes"] / 1e6, s["steps_dropped"],
                 s["steps_failed"], ForwardCost.describe(f["forward_cost"]), ServerThreads.describe(f["server_threads"]),
                 SchedulerCost.describe(f["scheduler_cost"]), AllocatorCounters.describe(f["cuda_allocator"]))


def _install_shutdown(flush_timeout_s: float) -> None:
    """Flush on normal exit and on SIGTERM (then hand the signal to whoever had it)."""
    global _shutdown_installed
    if _shutdown_installed:
        return
    _shutdown_installed = True
    atexit.register(close_all)
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
    except Exception:
        return

    def on_sigterm(signum, frame):
        close_all(flush_timeout_s)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except Exception as e:
        log.warning("could not install the SIGTERM flush: %s", e)
