"""Capture settings, read from the environment once per process.

Every variable is documented in docs/settings.md. Parsing errors raise ConfigError, whose
message is the one line the server prints before it refuses to start.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence

from hs_capture.dump.capture_policy import CapturePolicy
from hs_capture.dump.codec import CODECS

DIR_VARS = ("HSCAP_DIR", "SGLANG_HS_DUMP_DIR")  # the second is the seed deployment's name
ON_FULL_POLICIES = ("block", "drop")
BACKLOG_POLICIES = ("raw", "off")
WRITERS = ("process", "thread")
HANDOFFS = ("thread", "forward")


class ConfigError(ValueError):
    """A setting that must stop the server at start rather than serve without capture."""


@dataclass(frozen=True)
class CaptureConfig:
    dump_dir: str
    run_id: str
    layers: Optional[List[int]] = None  # None: the model's EAGLE-3 default
    codec: str = "bytegroup"
    level: int = 1
    writer_threads: int = 0  # 0: sized at model load from the cores and the writers on the host
    max_inflight_bytes: int = 0  # 0: sized at model load from the threads and the step (inflight_budget)
    on_full: str = "block"
    # where the writing runs: a process of the rank's own (its threads off the scheduler's
    # interpreter lock), or threads of the server's process
    writer: str = "process"
    # how a step reaches the writer process: a thread of the server's process waits for each
    # step's copy and sends it ("thread"), or the forwards send the steps whose copies are done,
    # with no thread of ours waking per step ("forward"; a timer sends the last ones)
    handoff: str = "thread"
    # when the writer is behind (store.StoreWorkers says when), write raw (crc-checked, every
    # byte kept) until it catches up: cheaper than blocking the forward; "off" always compresses
    on_backlog: str = "raw"
    fsync: bool = True
    prewarm_steps: int = 0  # 0: pin as many full steps as the in-flight budget holds
    prenorm: bool = False  # also capture the final norm's input (speculators trains on it)
    min_free_bytes: int = 1 << 30  # capture stops (serving goes on) below this much free space
    flush_timeout_s: float = 120.0  # how long SIGTERM waits for queued steps
    policy: CapturePolicy = CapturePolicy()  # which requests are captured (dump/capture_policy.py)
    store: str = "lossless"  # or "fp8": the compact tier (dump/quant.py), quantized on the device

    @property
    def run_dir(self) -> str:
        return os.path.join(self.dump_dir, self.run_id)


def dump_dir_from_env(env: Mapping[str, str] = os.environ) -> Optional[str]:
    for name in DIR_VARS:
        value = env.get(name, "").strip()
        if value:
            return value
    return None


def forced(env: Mapping[str, str] = os.environ) -> bool:
    """HSCAP_FORCE=1: run on an sglang outside the supported range."""
    return env.get("HSCAP_FORCE", "").strip() in ("1", "true", "yes")


def prenorm(env: Mapping[str, str] = os.environ) -> bool:
    """HSCAP_PRENORM=1: also capture the final norm's input (what speculators trains on)."""
    return env.get("HSCAP_PRENORM", "0") in ("1", "true", "yes")


def is_enabled(env: Mapping[str, str] = os.environ) -> bool:
    """Capture is opted into with HSCAP_DIR; HSCAP_DISABLE=1 is the kill switch."""
    return dump_dir_from_env(env) is not None and env.get("HSCAP_DISABLE", "") not in ("1", "true", "yes")


def capture_policy(env: Mapping[str, str] = os.environ) -> CapturePolicy:
    """HSCAP_CAPTURE_FRACTION (0 to 1, default 1: every request; marked requests always) and
    HSCAP_CACHE_NAMESPACE (default 1: a captured request gets a radix-cache namespace of its
    own; 0: it shares the cache, and a prefix hit leaves its capture incomplete),
    HSCAP_REUSE_CAPTURED (default 0; 1: captured requests share the cache but reuse only
    prefixes captured requests computed, instead of a namespace each) and HSCAP_FOLLOW
    (default 0; 1, with HSCAP_REUSE_CAPTURED=1: a request continuing a captured prompt is
    captured too)."""
    fraction = _number(env, "HSCAP_CAPTURE_FRACTION", 1.0, 0.0, 1.0, float)
    own = _choice(env, "HSCAP_CACHE_NAMESPACE", "1", ("0", "1"),
                  "choose 1 (captured requests get their own cache namespace) or 0") == "1"
    reuse = _switch(env, "HSCAP_REUSE_CAPTURED", "captured requests reuse only prefixes captured requests computed")
    follow = _switch(env, "HSCAP_FOLLOW", "requests continuing a captured prompt are captured too")
    if follow and not reuse:
        raise ConfigError("HSCAP_FOLLOW=1 needs HSCAP_REUSE_CAPTURED=1 (its index of captured prompts)")
    return CapturePolicy(fraction=fraction, own_namespace=own, reuse_captured=reuse, follow=follow)


def _switch(env: Mapping[str, str], name: str, what: str) -> bool:
    return _choice(env, name, "0", ("0", "1"), f"choose 1 ({what}) or 0") == "1"


def parse_layers(text: str) -> Optional[List[int]]:
    """'2,30,58' -> [2, 30, 58]; '' or 'default' -> None. Sorted, no duplicates."""
    text = text.strip()
    if text in ("", "default"):
        return None
    out = []
    for part in text.replace(" ", "").split(","):
        try:
            value = int(part)
        except ValueError:
            raise ConfigError(f"HSCAP_LAYERS={text!r}: {part!r} is not a layer index") from None
        if value < 0:
            raise ConfigError(f"HSCAP_LAYERS={text!r}: layer indices are >= 0")
        out.append(value)
    if len(set(out)) != len(out):
        raise ConfigError(f"HSCAP_LAYERS={text!r}: a layer is listed twice")
    return sorted(out)


def _number(env: Mapping[str, str], name: str, default, low, high, kind=int):
    """A setting parsed as `kind` (int or float) within [low, high], or a ConfigError naming it."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not low <= value <= high:
        raise ConfigError(f"{name}={value:g} is outside [{low:g}, {high:g}]")
    return value


def _choice(env: Mapping[str, str], name: str, default: str, choices: Sequence[str], hint: str) -> str:
    value = env.get(name, default).strip() or default
    if value not in choices:
        raise ConfigError(f"{name}={value!r}: {hint}")
    return value


def _int(env: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    return _number(env, name, default, low, high, int)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 2


def writers_on_host(dp_size: int = 1, dp_attention: bool = False, nnodes: int = 1) -> int:
    """Writing ranks sharing one host's cores: one per DP group under DP attention (one in
    all otherwise), spread over the nodes."""
    writers = max(1, int(dp_size or 1)) if dp_attention else 1
    return max(1, -(-writers // max(1, int(nnodes or 1))))


def writer_threads(cfg: "CaptureConfig", writers: int = 1) -> int:
    """The one decision of how many threads a writing rank gets: HSCAP_WRITER_THREADS, or
    when it is auto (0), default_writer_threads for `writers` writing ranks on the host."""
    return cfg.writer_threads or default_writer_threads(writers)


def default_writer_threads(writers_on_host: int = 1) -> int:
    """The usable cores less 4 for the server's own processes (scheduler, tokenizer,
    detokenizer), shared by the writing ranks on this host; 2 to 12. One writer on a 16-core
    host gets 12, more than a GPU server's prefill produces (the writer's rate by threads and
    the server's rate of states: benchmarks/README.md, gpu/capture.py and gpu/server.py)."""
    return max(2, min(12, (usable_cores() - 4) // max(1, writers_on_host)))


_MIN_INFLIGHT = 4 << 30
_SPARE_STEPS = 4  # steps that may wait for a thread before the forward does


def host_memory() -> Optional[int]:
    """The host's memory in bytes (None where unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def inflight_budget(threads: int, step_bytes: int) -> int:
    """The default in-flight budget: every thread busy on a full step with a few more waiting
    (so that all of them can compress at once: a fixed 4 GiB holds only a few full prefill
    steps of a large model, too few for 12 threads; benchmarks/README.md, gpu/sustained.py),
    capped at an eighth of the host's memory but never below 4 GiB: the floor wins on a host
    with less than 32 GiB (e.g. 4 GiB on 23 GiB)."""
    want = max(_MIN_INFLIGHT, (threads + _SPARE_STEPS) * max(0, step_bytes))
    ram = host_memory()
    if ram is None:
        return want
    return max(_MIN_INFLIGHT, min(want, ram // 8))


def load(env: Mapping[str, str] = os.environ) -> CaptureConfig:
    dump_dir = dump_dir_from_env(env)
    if dump_dir is None:
        raise ConfigError("HSCAP_DIR is not set")
    run_id = env.get("HSCAP_RUN_ID", "").strip()
    if not run_id:
        raise ConfigError("HSCAP_RUN_ID is not set (the bootstrap sets it in the launching process)")
    codec = _choice(env, "HSCAP_CODEC", "bytegroup", CODECS, f"choose one of {', '.join(CODECS)}")
    on_full = _choice(env, "HSCAP_ON_FULL", "block", ON_FULL_POLICIES, "choose block (lossless) or drop (counted)")
    on_backlog = _choice(env, "HSCAP_ON_BACKLOG", "raw", BACKLOG_POLICIES,
                         "choose raw (write raw while the writer is behind) or off (always compress)")
    writer = _choice(env, "HSCAP_WRITER", "process", WRITERS, "choose process (the default) or thread")
    handoff = _choice(env, "HSCAP_HANDOFF", "thread", HANDOFFS, "choose thread (the default) or forward")
    return CaptureConfig(
        dump_dir=os.path.abspath(dump_dir),
        run_id=run_id,
        layers=parse_layers(env.get("HSCAP_LAYERS", "")),
        codec=codec,
        level=_int(env, "HSCAP_LEVEL", 1, -7, 22),
        writer_threads=_int(env, "HSCAP_WRITER_THREADS", 0, 0, 64),
        max_inflight_bytes=_int(env, "HSCAP_MAX_INFLIGHT_MB", 0, 0, 1 << 20) << 20,
        on_full=on_full,
        writer=writer,
        handoff=handoff,
        on_backlog=on_backlog,
        fsync=env.get("HSCAP_FSYNC", "1") not in ("0", "false", "no"),
        prewarm_steps=_int(env, "HSCAP_PREWARM_STEPS", 0, 0, 1024),
        prenorm=prenorm(env),
        min_free_bytes=_min_free(env),
        flush_timeout_s=_number(env, "HSCAP_FLUSH_TIMEOUT_S", 120.0, 0.0, 86400.0, float),
        policy=capture_policy(env),
        store=store(env),
    )


STORES = ("lossless", "fp8")


def store(env: Mapping[str, str] = os.environ) -> str:
    """HSCAP_STORE: lossless (the default: every state as the server computed it) or fp8 (the
    compact tier: FP8 e4m3 with one scale per token, quantized on the device)."""
    value = env.get("HSCAP_STORE", "lossless").strip().lower() or "lossless"
    if value not in STORES:
        raise ConfigError(f"HSCAP_STORE={value!r}: choose lossless (the default) or fp8")
    return value


def _min_free(env: Mapping[str, str]) -> int:
    text = env.get("HSCAP_MIN_FREE_GB", "1").strip() or "1"
    try:
        gb = float(text)
        if not 0 <= gb < 1e6:
            raise ValueError
    except ValueError:
        raise ConfigError(f"HSCAP_MIN_FREE_GB={text!r}: expected a number of GB >= 0") from None
    return int(gb * (1 << 30))


def check_dump_dir(path: str, create: bool = True) -> None:
    """Make the dump dir (and prove it writable) or raise ConfigError.

    create=False proves the same and leaves nothing on disk (a start that is refused later
    must not leave an empty dump dir behind): a missing dir is probed in its nearest
    existing parent, the one directory makedirs would need to write in.
    """
    try:
        where = path
        if create:
            os.makedirs(path, exist_ok=True)
        else:
            where = os.path.abspath(path)
            while not os.path.lexists(where):
                where = os.path.dirname(where)
            if not os.path.isdir(where):
                raise NotADirectoryError(f"{where} is not a directory")
        probe = os.path.join(where, f".hscap-probe-{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"dump dir {path!r} is not writable: {e.strerror or e}") from None


def resolve_layers(requested: Optional[List[int]], num_layers: int) -> List[int]:
    """The layers to capture in the entering-layer convention, checked against the model.

    Index i is the residual stream entering decoder layer i (transformers'
    hidden_states[i]); the final state is always captured separately. The default
    is SGLang's EAGLE-3 default [2, N//2, N-3], deduplicated for tiny models.
    """
    if num_layers < 2:  # the default would clamp to layer 0, outside the rule below
        raise ConfigError(f"this {num_layers}-layer model has no layer 1..{num_layers - 1} to capture "
                          "(index i = input of decoder layer i)")
    if requested is None:
        return sorted({min(max(i, 1), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)})
    bad = [i for i in requested if not 1 <= i < num_layers]
    if bad:
        raise ConfigError(
            f"HSCAP_LAYERS has {bad} outside 1..{num_layers - 1} for this {num_layers}-layer model "
            f"(index i = input of decoder layer i; the final state is always captured)"
        )
    return list(requested)


# Where a multimodal wrapper keeps its language model's config: the captured model is built
# from it (KimiK25ForConditionalGeneration and KimiVL: text_config; DeepseekVL2: language_config).
_TEXT_CONFIG_KEYS = ("text_config", "language_config")


def checkpoint_num_layers(model_path: str) -> Optional[int]:
    """The decoder layer count of a local checkpoint (its config.json; a multimodal
    wrapper's text model), or None when it is not knowable before the model loads: a hub
    id, no or unreadable config.json, no layer count in it."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isdir(model_path) or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(body, dict):
        return None
    for key in _TEXT_CONFIG_KEYS:
        if isinstance(body.get(key), dict):
            body = body[key]
            break
    n = body.get("num_hidden_layers")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def check_model_path(model_path: Optional[str]) -> None:
    """A local checkpoint path (absolute, or starting with . or ~; a hub id never does) that
    is not a directory holding a config.json: ConfigError, before SGLang starts."""
    if not model_path or not model_path.startswith(("/", ".", "~")):
        return
    path = os.path.expanduser(model_path)
    if not os.path.isdir(path):
        raise ConfigError(f"--model-path {model_path}: {'not a directory' if os.path.exists(path) else 'no such directory'}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"--model-path {model_path}: holds no config.json (not a model checkpoint)")


def check_checkpoint_layers(env: Mapping[str, str], model_path: Optional[str],
                            model_override_args: Optional[str] = None) -> Optional[List[int]]:
    """The layers HSCAP_LAYERS (or the default) asks of the checkpoint at `model_path`, by
    the rule the model load applies (resolve_layers), found before a server starts; None
    when the layer count is not knowable here. ConfigError: a malformed or impossible set."""
    requested = parse_layers(env.get("HSCAP_LAYERS", ""))
    if not model_path:
        return None
    # SGLang applies --json-model-override-args to the config: a count given there wins over
    # the file, so the file says nothing certain
    if isinstance(model_override_args, str) and "num_hidden_layers" in model_override_args:
        return None
    num_layers = checkpoint_num_layers(model_path)
    return None if num_layers is None else resolve_layers(requested, num_layers)
