"""What the sitecustomize hook runs in every Python process that has it on PYTHONPATH.

Inert (imports nothing heavy, patches nothing) unless capture is opted into with
HSCAP_DIR. Then it fixes one run id for the whole server (children inherit the
environment through multiprocessing spawn) and registers lazy wrapt post-import
hooks: torch and the writer load only in processes that import the model module,
whether SGLang was imported before or after this runs.
"""

from __future__ import annotations

import os
import sys

from hs_capture.server import config
from hs_capture.dump.paths import new_run_id

PREFLIGHT_MODULE = "sglang.srt.server_args"
# The directory to put on PYTHONPATH: the package's sitecustomize/, which imports this module.
HOOK_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sitecustomize")


def run() -> bool:
    """Returns True when hooks were registered."""
    if not config.is_enabled():
        return False
    if not os.environ.get("HSCAP_RUN_ID"):
        os.environ["HSCAP_RUN_ID"] = new_run_id()
    import wrapt

    from hs_capture.server.targets import REQUESTS, TARGETS

    # Fail fast in the launching process, before any model loads.
    wrapt.register_post_import_hook("hs_capture.server.bootstrap:preflight", PREFLIGHT_MODULE)
    for module in {t.module for t in TARGETS} | {REQUESTS.module}:
        wrapt.register_post_import_hook(on_target_import, module)
    return True


def on_target_import(module: object) -> None:
    """A target module was imported: patch it. A hook that raises fails the host's import, so
    a hook that cannot even load (a broken install) says so and leaves capture off; only the
    instrumentor's deliberate refusal (an unsupported sglang) stops the server."""
    try:
        from hs_capture.server.instrumentor import on_import
    except Exception as e:
        sys.stderr.write(f"[HS_DUMP] ERROR: capture is OFF in this process: the hook cannot load: "
                         f"{type(e).__name__}: {e}\n")
        return
    on_import(module)


def preflight(module: object = None) -> None:
    """Check the settings that need no model (syntax, writable dir) as soon as SGLang's
    server arguments load; a bad one stops the server with one line, before hours of
    serving with no capture. Nothing is created here: a start refused later (the layer
    check at model load) must leave no empty dump dir behind."""
    try:
        cfg = config.load()
        config.check_dump_dir(cfg.dump_dir, create=False)
    except config.ConfigError as e:
        raise SystemExit(f"[HS_DUMP] ERROR: {e}") from None
    if module is not None:
        _check_layers_when_args_parse(module)


def _check_layers_when_args_parse(module: object) -> None:
    """Check the layer set against a local checkpoint's config.json as soon as the launching
    process has parsed its arguments: a bad set then stops the server with one line, before
    SGLang starts its processes (at model load it is a scheduler traceback and a SIGKILL).
    Any fault of this check itself is ignored: the model-load check still runs."""
    if not callable(getattr(module, "prepare_server_args", None)):
        return
    import wrapt

    def check(wrapped, instance, args, kwargs):
        server_args = wrapped(*args, **kwargs)
        try:
            config.check_checkpoint_layers(os.environ, getattr(server_args, "model_path", None),
                                           getattr(server_args, "json_model_override_args", None))
        except config.ConfigError as e:
            raise SystemExit(f"[HS_DUMP] ERROR: {e}") from None
        except Exception:  # never stop a server for a fault of this early check
            pass
        return server_args

    try:
        wrapt.wrap_function_wrapper(module, "prepare_server_args", check)
    except Exception:  # as above: the model-load check is the one that must hold
        pass
