"""Patching, isolated from logic (after OpenTelemetry's BaseInstrumentor).

`HsCaptureInstrumentor().instrument()` wraps, for each target, the CausalLM's
`__init__` and the Model's `forward` on the class that defines them, and SGLang's
request class (`Req.__init__`: the capture policy judges each request, requests.py);
a repeat call warns and does nothing; `uninstrument()` undoes every wrap one for one
and gives live models their original capture settings back. The wrapping itself is
hs_capture.patching's Instrumentor, the trainers' patches' too: someone else's wrapper is
refused with a warning, never stacked on, and the rest is patched.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from typing import Any, List, Optional, Tuple

import wrapt

from hs_capture.patching import REFUSED, Instrumentor, defining_class, owner_of
from hs_capture.patching import is_ours, is_wrapped  # noqa: F401  (importable from here, as before)
from hs_capture.server.capture import setup_model
from hs_capture.server.config import ConfigError
from hs_capture.server.log import get_logger
from hs_capture.server import requests as requests_mod
from hs_capture.server.targets import REQUESTS, TARGETS, Target

log = get_logger()


def _bind_config(args: tuple, kwargs: dict) -> Any:
    # __init__(self, config, quant_config=None, prefix=""): bind by name, callers vary
    return kwargs["config"] if "config" in kwargs else (args[0] if args else None)


def _forward_wrapper(wrapped, instance, args, kwargs):
    # every forward of the server: a dict lookup on a model that is not captured
    state = instance.__dict__.get("_hscap_state") if instance is not None else None
    if state is None:
        return wrapped(*args, **kwargs)
    return state.forward(wrapped, instance, args, kwargs)


class HsCaptureInstrumentor(Instrumentor):
    log = log
    _instance: Optional["HsCaptureInstrumentor"] = None

    def __new__(cls):
        if cls._instance is None:  # one per process: the hooks of every target module share it
            inst = super().__new__(cls)
            Instrumentor.__init__(inst)
            inst._done: List[Tuple[Target, type, type]] = []
            inst._models = weakref.WeakSet()
            inst._requests: Optional[type] = None
            cls._instance = inst
        return cls._instance

    def __init__(self) -> None:
        pass  # its state is made once, in __new__

    def instrument(self, module: Any = None) -> bool:
        """Patch every target whose module is imported (or `module` too, from a post-import hook:
        then an instrumented server patches what it has not yet)."""
        return super().instrument() if module is None else self.extend(module=module)

    def _instrument(self, module: Any = None) -> bool:
        for target in TARGETS:
            mod = module if module is not None and module.__name__ == target.module else sys.modules.get(target.module)
            if mod is None or any(t is target for t, _, _ in self._done):
                continue
            self._patch(target, mod)
        mod = module if module is not None and module.__name__ == REQUESTS.module else sys.modules.get(REQUESTS.module)
        if mod is not None and self._requests is None:
            self._patch_requests(mod)
        return bool(self._done) or self._requests is not None

    def _uninstrument(self) -> None:
        # the base then puts back every original it wrapped, one for one
        for model in list(self._models):
            state = model.__dict__.pop("_hscap_state", None)
            if state is not None:
                state.restore(model)
        self._done.clear()
        if self._requests is not None:
            self._requests = None
            requests_mod.set_hooked(False)
            requests_mod.set_reuse_hooked(False)

    # ------------------------------------------------------------- internals
    def _patch(self, target: Target, mod: Any) -> None:
        causal_lm = getattr(mod, target.causal_lm)
        model_cls = getattr(mod, target.model)
        models = self._models

        def forward_is_ours(model: Any) -> bool:
            try:
                return owner_of(vars(defining_class(type(model), "forward"))["forward"]) is self
            except AttributeError:
                return False

        def init_wrapper(wrapped, instance, args, kwargs):
            wrapped(*args, **kwargs)
            inner = getattr(instance, "model", None)
            if inner is not None and "_hscap_state" in inner.__dict__:
                return  # a subclass's __init__ ran ours twice: one capture per model
            if hasattr(inner, "layers_to_capture") and not forward_is_ours(inner):
                # a subclass built another Model around our __init__ (Llama4 over Llama, say)
                log.info("%s: %s.forward is not a patched target: not captured", type(instance).__name__,
                         type(inner).__name__)
                return
            try:
                state = setup_model(instance, _bind_config(args, kwargs), target)
            except ConfigError as e:
                log.error("ERROR: %s", e)
                raise RuntimeError(f"[HS_DUMP] ERROR: {e}") from None
            except Exception as e:  # capture was asked for: serving blind for hours is the failure to avoid
                log.error("ERROR: could not turn capture on: %s: %s", type(e).__name__, e)
                raise
            if state is not None:
                models.add(instance.model)

        # __init__ through wrap(): inert once uninstrumented, even where a later wrapper keeps
        # ours in place. The forward is the hot path: replace() puts _forward_wrapper in the
        # FunctionWrapper itself, with no on/off layer; it is inert on its own once
        # uninstrumented (only a model given a state goes to the capture, and _uninstrument
        # takes every state away, the init wrapper giving none). A Model another target wrapped
        # already is shared (Qwen3Model.forward is Qwen2Model's in older releases); someone
        # else's wrapper is refused with a warning (on_refused) and the rest is patched.
        self.wrap(causal_lm, "__init__", init_wrapper)
        self.replace(model_cls, "forward", lambda original: wrapt.FunctionWrapper(original, _forward_wrapper))
        self._done.append((target, causal_lm, model_cls))
        log.debug("instrumented %s", target.module)

    def _patch_requests(self, mod: Any) -> None:
        req_cls = getattr(mod, REQUESTS.cls)

        def req_init_wrapper(wrapped, instance, args, kwargs):
            wrapped(*args, **kwargs)
            requests_mod.on_new_request(instance)

        if self.wrap(req_cls, "__init__", req_init_wrapper, note="every request is captured, the radix cache "
                     "cannot be kept for captured requests") == REFUSED:
            return
        self._requests = req_cls
        requests_mod.set_hooked(True)
        if not hasattr(req_cls, "_compute_max_prefix_len"):  # before 0.5.15: no cap to set
            return

        def max_prefix_wrapper(wrapped, instance, args, kwargs):
            return requests_mod.limit_prefix(instance, wrapped(*args, **kwargs))

        def next_round_wrapper(wrapped, instance, args, kwargs):
            out = wrapped(*args, **kwargs)
            if kwargs.get("tree_cache", args[0] if args else None) is not None:  # a chunk's next round matches nothing
                requests_mod.after_match(instance)
            return out

        def extend_batch_wrapper(wrapped, instance, args, kwargs):
            out = wrapped(*args, **kwargs)
            requests_mod.on_batch(instance.reqs)
            return out

        batch_cls = getattr(mod, "ScheduleBatch", None)
        note = "captured requests cannot reuse captured prefixes: each is prefilled whole"
        if batch_cls is not None and \
                self.wrap(req_cls, "_compute_max_prefix_len", max_prefix_wrapper, note=note) != REFUSED and \
                self.wrap(req_cls, "init_next_round_input", next_round_wrapper, note=note) != REFUSED and \
                self.wrap(batch_cls, "prepare_for_extend", extend_batch_wrapper, note=note) != REFUSED:
            requests_mod.set_reuse_hooked(True)


def on_import(module: Any) -> None:
    """wrapt post-import hook for a target module. Must never raise into the host's import,
    except to stop a server whose capture cannot work (version refused)."""
    from hs_capture.server.versions import check_host

    problem = check_host()
    if problem:
        log.error("ERROR: %s (set HSCAP_FORCE=1 to try anyway)", problem)
        raise RuntimeError(f"[HS_DUMP] ERROR: {problem}")
    try:
        HsCaptureInstrumentor().instrument(module)
        # the request class loads in every SGLang process, the launcher's too: the model
        # modules' lines are the ones that say capture is live
        log.log(logging.DEBUG if module.__name__ == REQUESTS.module else logging.INFO,
                "hooks installed on %s (pid %d)", module.__name__, os.getpid())
    except Exception as e:
        log.error("ERROR: could not install hooks on %s: %s: %s", module.__name__, type(e).__name__, e)
