"""Patching, isolated from logic (after OpenTelemetry's BaseInstrumentor).

`HsCaptureInstrumentor().instrument()` wraps, for each target, the CausalLM's
`__init__` and the Model's `forward` on the class that defines them, and SGLang's
request class (`Req.__init__`: the capture policy judges each request, requests.py);
a repeat call warns and does nothing; `uninstrument()` undoes every wrap one for one
and gives live models their original capture settings back.
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any, Callable, List, Optional, Tuple

import wrapt

from hs_capture.server.capture import setup_model
from hs_capture.server.config import ConfigError
from hs_capture.server.log import get_logger
from hs_capture.server import requests as requests_mod
from hs_capture.server.targets import REQUESTS, TARGETS, Target

log = get_logger()
# wrapt 2 moved the proxy base (FunctionWrapper no longer subclasses wrapt.ObjectProxy)
_PROXY = getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)


def is_wrapped(obj: Any) -> bool:
    return isinstance(obj, _PROXY)


def _defining_class(cls: type, attr: str) -> type:
    for klass in cls.__mro__:
        if attr in vars(klass):
            return klass
    raise AttributeError(f"{cls.__name__} has no {attr}")


def is_ours(obj: Any) -> bool:
    return is_wrapped(obj) and bool(getattr(obj, "_self_hscap_wrapper", False))


def _wrap(cls: type, attr: str, wrapper: Callable) -> str:
    """"wrapped", "shared" (another target already put our wrapper on the class that
    defines it: Qwen3Model.forward is Qwen2Model's in older releases) or "foreign"."""
    owner = _defining_class(cls, attr)
    current = vars(owner)[attr]
    if is_ours(current):
        return "shared"
    if is_wrapped(current):  # someone else's: never stack a second wrapper
        return "foreign"
    proxy = wrapt.FunctionWrapper(current, wrapper)
    setattr(owner, attr, proxy)
    proxy._self_hscap_wrapper = True
    return "wrapped"


def _forward_is_ours(model: Any) -> bool:
    try:
        return is_ours(vars(_defining_class(type(model), "forward"))["forward"])
    except AttributeError:
        return False


def _unwrap(cls: type, attr: str) -> None:
    owner = _defining_class(cls, attr)
    current = vars(owner)[attr]
    if is_ours(current):
        setattr(owner, attr, current.__wrapped__)


def _bind_config(args: tuple, kwargs: dict) -> Any:
    # __init__(self, config, quant_config=None, prefix=""): bind by name, callers vary
    return kwargs["config"] if "config" in kwargs else (args[0] if args else None)


class HsCaptureInstrumentor:
    _instance: Optional["HsCaptureInstrumentor"] = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
            cls._instance._instrumented = False
            cls._instance._done: List[Tuple[Target, type, type]] = []
            cls._instance._models = weakref.WeakSet()
            cls._instance._requests: Optional[type] = None
        return cls._instance

    @property
    def is_instrumented(self) -> bool:
        return self._instrumented


    def instrument(self, module: Any = None) -> bool:
        """Patch every target whose module is imported (or `module`, from a post-import hook)."""
        if self._instrumented and module is None:
            log.warning("instrument() called twice: already instrumented")
            return False
        for target in TARGETS:
            mod = module if module is not None and module.__name__ == target.module else sys.modules.get(target.module)
            if mod is None or any(t is target for t, _, _ in self._done):
                continue
            self._patch(target, mod)
        mod = module if module is not None and module.__name__ == REQUESTS.module else sys.modules.get(REQUESTS.module)
        if mod is not None and self._requests is None:
            self._patch_requests(mod)
        self._instrumented = bool(self._done) or self._requests is not None
        return self._instrumented

    def uninstrument(self) -> None:
        if not self._instrumented:
            log.warning("uninstrument() called but nothing is instrumented")
            return
        for model in list(self._models):
            state = model.__dict__.pop("_hscap_state", None)
            if state is not None:
                state.restore(model)
        for target, causal_lm, model_cls in self._done:
            _unwrap(causal_lm, "__init__")
            _unwrap(model_cls, "forward")
        self._done.clear()
        if self._requests is not None:
            _unwrap(self._requests, "__init__")
            self._requests = None
            requests_mod.set_hooked(False)
        self._instrumented = False

    # ------------------------------------------------------------- internals
    def _patch(self, target: Target, mod: Any) -> None:
        causal_lm = getattr(mod, target.causal_lm)
        model_cls = getattr(mod, target.model)
        models = self._models

        def init_wrapper(wrapped, instance, args, kwargs):
            wrapped(*args, **kwargs)
            inner = getattr(instance, "model", None)
            if inner is not None and "_hscap_state" in inner.__dict__:
                return  # a subclass's __init__ ran ours twice: one capture per model
            if hasattr(inner, "layers_to_capture") and not _forward_is_ours(inner):
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

        def forward_wrapper(wrapped, instance, args, kwargs):
            state = instance.__dict__.get("_hscap_state") if instance is not None else None
            if state is None:
                return wrapped(*args, **kwargs)
            return state.forward(wrapped, instance, args, kwargs)

        for cls, attr, wrapper in ((causal_lm, "__init__", init_wrapper), (model_cls, "forward", forward_wrapper)):
            if _wrap(cls, attr, wrapper) == "foreign":
                log.warning("%s.%s is already wrapped: left as it is", cls.__name__, attr)
        self._done.append((target, causal_lm, model_cls))
        log.debug("instrumented %s", target.module)


    def _patch_requests(self, mod: Any) -> None:
        req_cls = getattr(mod, REQUESTS.cls)

        def req_init_wrapper(wrapped, instance, args, kwargs):
            wrapped(*args, **kwargs)
            requests_mod.on_new_request(instance)

        if _wrap(req_cls, "__init__", req_init_wrapper) == "foreign":
            log.warning("%s.__init__ is already wrapped: left as it is (every request is captured, the "
                        "radix cache cannot be kept for captured requests)", req_cls.__name__)
            return
        self._requests = req_cls
        requests_mod.set_hooked(True)


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
        log.info("hooks installed on %s (pid %d)", module.__name__, os.getpid())
    except Exception as e:
        log.error("ERROR: could not install hooks on %s: %s: %s", module.__name__, type(e).__name__, e)
