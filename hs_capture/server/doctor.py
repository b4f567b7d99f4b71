"""`hscap doctor`: run in the server's environment, before the server, to see what the hook
will find and do. Server-side (it imports sglang, lazily); the CLI calls it.

Each finding has a status: ok, info (what the hook will do), warn (capture will be thinner
than it could be), block (the server would refuse to start, or capture nothing)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence

from hs_capture.server import config as config_mod
from hs_capture.server.bootstrap import HOOK_DIR
from hs_capture.server.package import INSTRUMENTS
from hs_capture.server.targets import (COVERED, TARGETS, Target, checkpoint_architectures, checkpoint_config,
                                      for_architecture)

OK, INFO, WARN, BLOCK = "ok", "info", "warn", "block"


@dataclass
class Finding:
    topic: str
    status: str
    detail: str
    action: str = ""


def check_sglang() -> List[Finding]:
    try:
        import sglang  # noqa: F401
    except Exception as e:
        return [Finding("sglang", BLOCK, f"sglang does not import here: {type(e).__name__}: {e}",
                        "run doctor with the server's python")]
    from hs_capture.server.sglang_compat import sglang_version
    from hs_capture.server.versions import problem

    found = problem()
    if found:
        force = config_mod.forced()
        return [Finding("sglang", WARN if force else BLOCK, found,
                        "" if force else "use a supported sglang, or set HSCAP_FORCE=1 at your own risk")]
    return [Finding("sglang", OK, f"sglang {sglang_version()} (supported: {INSTRUMENTS[0]})")]


def target_problems(t: Target) -> List[str]:
    """Why this target cannot be patched in this environment (empty: it can)."""
    try:
        mod = importlib.import_module(t.module)
    except Exception as e:
        return [f"{t.module} does not import: {type(e).__name__}: {e}"]
    lm, model = getattr(mod, t.causal_lm, None), getattr(mod, t.model, None)
    problems = []
    if lm is None or "__init__" not in vars(lm):
        problems.append(f"{t.causal_lm}.__init__ not found")
    forward = getattr(model, "forward", None)  # may be inherited (Qwen3Model from Qwen2Model)
    if forward is None:
        problems.append(f"{t.model}.forward not found")
    elif "forward_batch" not in inspect.signature(forward).parameters:
        problems.append(f"{t.model}.forward takes no forward_batch")
    if lm is not None and not hasattr(lm, "set_eagle3_layers_to_capture"):
        problems.append(f"{t.causal_lm} has no set_eagle3_layers_to_capture (SGLang's capture is missing)")
    return problems


def check_targets() -> List[Finding]:
    """Each family: patchable or not. One that cannot be patched only matters if it is the
    family served (check_model); none patchable at all blocks."""
    out, usable = [], 0
    for t in TARGETS:
        problems = target_problems(t)
        usable += not problems
        if problems:
            out.append(Finding(f"target {t.causal_lm}", WARN, "; ".join(problems),
                               f"{t.family} models would be served without capture"))
        else:
            out.append(Finding(f"target {t.causal_lm}", OK, f"{t.family}: {t.causal_lm}.__init__ and "
                                                           f"{t.model}.forward can be wrapped ({t.select} selection)"))
    if not usable:
        out.append(Finding("targets", BLOCK, "no model family can be patched in this sglang"))
    for c in COVERED:
        try:
            cls = getattr(importlib.import_module(c.module), c.architecture, None)
        except Exception:
            cls = None
        out.append(Finding(f"covered {c.architecture}", OK if cls is not None else INFO,
                           f"present: captured through the {c.family} target ({c.how})" if cls is not None
                           else "not in this release"))
    return out


def check_model(model_path: str) -> List[Finding]:
    """Is the model the server is given captured at all? (local checkpoints only)"""
    archs = checkpoint_architectures(model_path)
    if archs is None:
        return [Finding("model", INFO, f"{model_path}: no local config.json to read; not judged")]
    if not archs:
        return [Finding("model", WARN, f"{model_path}/config.json names no architectures")]
    arch = archs[0]
    target = for_architecture(arch)
    if target is None:
        names = ", ".join([t.causal_lm for t in TARGETS] + [c.architecture for c in COVERED])
        return [Finding("model", BLOCK, f"{arch} is not a target: the server would run without capture",
                        f"hs_capture captures {names}")]
    problems = target_problems(target)
    if problems:
        return [Finding("model", BLOCK, f"{arch} is captured through {target.causal_lm}, which cannot be "
                                        f"patched here: {'; '.join(problems)}")]
    return [Finding("model", OK, f"{arch}: captured through the {target.family} target ({target.causal_lm})")]


def check_sitecustomize(path: Optional[Sequence[str]] = None) -> List[Finding]:
    """Is the hook first on the path, and which sitecustomize does it shadow (and chain to)?"""
    path = list(sys.path if path is None else path)
    found = [p for p in path if os.path.isfile(os.path.join(p or ".", "sitecustomize.py"))]
    ours = [p for p in found if os.path.realpath(os.path.join(p or ".", "sitecustomize.py"))
            == os.path.realpath(os.path.join(HOOK_DIR, "sitecustomize.py"))]
    pypath = os.environ.get("PYTHONPATH", "")
    if not ours:
        on_pp = any(os.path.realpath(p) == os.path.realpath(HOOK_DIR) for p in pypath.split(os.pathsep) if p)
        return [Finding("sitecustomize", BLOCK if not on_pp else WARN,
                        "the hook is not on this python's path: the server would start without capture",
                        f"export PYTHONPATH={HOOK_DIR}{os.pathsep}$PYTHONPATH (or run hscap serve)")]
    first = found[0]
    if first != ours[0]:
        return [Finding("sitecustomize", BLOCK, f"{os.path.join(first, 'sitecustomize.py')} comes first and "
                        "shadows the hook: Python imports only the first one",
                        f"put {HOOK_DIR} first on PYTHONPATH")]
    shadowed = [p for p in found[1:] if p not in ours]
    if shadowed:
        return [Finding("sitecustomize", OK, f"the hook comes first and chains to the one it shadows: "
                                             f"{os.path.join(shadowed[0], 'sitecustomize.py')}")]
    return [Finding("sitecustomize", OK, "the hook comes first; no other sitecustomize to chain to")]


def check_settings(env: Optional[Dict[str, str]] = None, ns: Any = None) -> List[Finding]:
    """The HSCAP_* settings, and what the server will use for the auto ones (`ns`: the parsed
    server flags, which say how many ranks write on one host)."""
    env = dict(os.environ if env is None else env)
    if not config_mod.dump_dir_from_env(env):
        return [Finding("settings", BLOCK, "HSCAP_DIR is not set: the hook stays inert",
                        "export HSCAP_DIR=/path/to/dumps")]
    env.setdefault("HSCAP_RUN_ID", "doctor")
    try:
        cfg = config_mod.load(env)
        config_mod.check_dump_dir(cfg.dump_dir, create=False)  # a check creates nothing
        # the model path and the layer set against a local checkpoint, as `hscap serve` checks them
        config_mod.check_model_path(getattr(ns, "model_path", None))
        config_mod.check_checkpoint_layers(env, getattr(ns, "model_path", None),
                                           getattr(ns, "json_model_override_args", None))
    except config_mod.ConfigError as e:
        return [Finding("settings", BLOCK, str(e))]
    writers = config_mod.writers_on_host(getattr(ns, "dp_size", 1), bool(getattr(ns, "enable_dp_attention", False)),
                                         getattr(ns, "nnodes", 1))
    threads = config_mod.writer_threads(cfg, writers)
    out = [Finding("settings", OK, f"dump dir {cfg.dump_dir} writable; layers {cfg.layers or 'EAGLE-3 default'}; "
                                   f"states stored {cfg.store} (HSCAP_STORE); codec {cfg.codec} level {cfg.level}; {threads}{'' if cfg.writer_threads else ' (auto)'} "
                                   f"writer threads per writing rank, {writers} writing rank(s) on this host, "
                                   f"{'each in a writer process of its own' if cfg.writer == 'process' else 'in the server process (HSCAP_WRITER=thread)'}")]
    out.append(Finding("capture policy", OK, f"{cfg.policy.describe()} (HSCAP_CAPTURE_FRACTION; hscap send marks "
                       "its requests)"))
    if not cfg.prenorm:  # said before serving, not first at merge time
        out.append(Finding("pre-norm state", INFO, "not captured: speculators trains on it, so merge --format "
                           "speculators would refuse this dump", "HSCAP_PRENORM=1 (hscap serve --prenorm)"))
    return out


def parse_server_flags(argv: Sequence[str]) -> Any:
    """The flags as sglang's own parser reads them (defaults included, no hardware probing)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    ns, _ = parser.parse_known_args(list(argv))
    return ns


def check_flags(ns: Any) -> List[Finding]:
    """What the parsed server flags (parse_server_flags) do to capture."""
    from hs_capture.server.modes import read_modes
    from hs_capture.server.sglang_compat import flag, on_cuda, prefill_off_flags_here

    out = []
    modes = read_modes(ns)
    off = " ".join(prefill_off_flags_here())
    out.append(Finding("scheduler", OK, "overlap (SGLang's default): right, the batch's inputs are copied on the "
                       "forward's stream before the next batch refills them" if modes.overlap else
                       "normal (--disable-overlap-schedule): right, but ~7% slower than overlap; the flag is not needed"))
    out.append(Finding("decode CUDA graphs", OK, f"{modes.decode_graphs}: kept (decode is never captured)"
                       if modes.decode_graphs else "off: not needed for capture (decode is never captured)"))
    wrong = modes.wrong(off)
    out += [Finding(w.what, BLOCK, f"{w.why}: the hook refuses to start", w.fix) for w in wrong]
    if modes.prefill_graphs:
        pass  # blocked above
    elif on_cuda(ns) and not (flag(ns, "disable_cuda_graph") or flag(ns, "disable_prefill_cuda_graph")
                                            or str(flag(ns, "cuda_graph_backend_prefill")).lower() == "disabled"):
        out.append(Finding("prefill CUDA graphs", WARN, "not disabled: SGLang 0.5.15+ turns breakable prefill "
                           "graphs on for some models on Hopper (off for MLA), and the hook would then refuse to start",
                           f"add {off} (hscap serve does)"))
    else:
        out.append(Finding("prefill CUDA graphs", OK, "off: every prefill runs the hook"))
    if not flag(ns, "disable_radix_cache"):
        try:
            policy = config_mod.capture_policy()
            own, reuse = policy.own_namespace, policy.reuse_captured
        except config_mod.ConfigError:
            own = reuse = False  # the settings finding says why
        if reuse and int(flag(ns, "pp_size") or 1) > 1:
            out.append(Finding("radix cache", WARN, "HSCAP_REUSE_CAPTURED=1 is not taken with pipeline parallelism "
                               "(a stage's scheduler may match prefixes the others never see): captured requests "
                               + ("get a cache namespace of their own" if own else "share the cache, hits incomplete"),
                               "unset HSCAP_REUSE_CAPTURED, or serve without --pp-size"))
        elif reuse:
            out.append(Finding("radix cache", OK, "on and shared: captured requests reuse only prefixes captured "
                               "requests computed (HSCAP_REUSE_CAPTURED=1, SGLang 0.5.15 or later: the server log "
                               "says when it is not taken), merge joins them; the other requests keep their "
                               "prefix reuse"))
        elif own:
            out.append(Finding("radix cache", OK, "on: each captured request gets a cache namespace of its own and "
                               "is prefilled whole; the other requests keep their prefix reuse"))
        else:
            out.append(Finding("radix cache", WARN, "on and shared by captured requests (HSCAP_CACHE_NAMESPACE=0): a "
                               "prefix hit is never recomputed, so that sample's capture starts past 0 and it is "
                               "reported incomplete", "unset HSCAP_CACHE_NAMESPACE, or add --disable-radix-cache"))
    else:
        out.append(Finding("radix cache", OK, "off"))
    pp = int(flag(ns, "pp_size") or 1)
    if pp > 1:
        out.append(Finding("pipeline parallel", INFO, f"pp {pp}: only the last stage holds the captures and writes"))
    if flag(ns, "enable_dp_attention"):
        out.append(Finding("dp attention", INFO, f"dp {flag(ns, 'dp_size')}: one writer per DP group "
                           "(its attention-TP rank 0); files named dp<d>-tp<t>-pp<p>"))
    elif int(flag(ns, "tp_size") or 1) > 1:
        out.append(Finding("tensor parallel", INFO, f"tp {flag(ns, 'tp_size')}: TP rank 0 writes; the others only "
                           "compute (SGLang's capture is taken after the all-reduce)"))
    if flag(ns, "enable_mixed_chunk"):
        out.append(Finding("mixed chunk", INFO, "MIXED batches also carry one decode token per running request; "
                           "send max_new_tokens=1 (hscap send does)"))
    return out


def diagnose(server_argv: Sequence[str] = ()) -> List[Finding]:
    findings = check_sglang()
    if findings[0].status == BLOCK and "does not import" in findings[0].detail:
        return findings + check_sitecustomize() + check_settings()
    findings += check_targets() + check_sitecustomize()
    if not server_argv:
        return findings + check_settings()
    try:
        ns = parse_server_flags(server_argv)
    except SystemExit:
        return findings + check_settings() + [Finding("flags", WARN, "sglang's parser rejected the flags given after --")]
    except Exception as e:
        return findings + check_settings() + [
            Finding("flags", WARN, f"could not read the server flags: {type(e).__name__}: {e}")]
    findings += check_settings(ns=ns) + check_flags(ns) + check_speculative(ns)
    if getattr(ns, "model_path", None):
        findings += check_model(ns.model_path)
    return findings


def check_speculative(ns: Any, env: Optional[Dict[str, str]] = None) -> List[Finding]:
    """On a speculating server, both layer sets: the ones the drafter gets (its config's
    ids through this SGLang's rule for the target's family) and the ones the hook captures."""
    from hs_capture.dump.layer_ids import sglang_rule
    from hs_capture.server.sglang_compat import flag, sglang_version

    algo = flag(ns, "speculative_algorithm")
    if not algo:
        return []
    base = f"{algo}: draft passes (draft extend, target verify) are never captured"
    if str(algo).upper() != "EAGLE3":
        return [Finding("speculative decoding", INFO, f"{base}; {algo} asks the target for no aux layers: "
                        "the hook's are its own")]
    env = dict(os.environ if env is None else env)
    model = getattr(ns, "model_path", None)
    try:
        ours = config_mod.check_checkpoint_layers(env, model, getattr(ns, "json_model_override_args", None))
    except config_mod.ConfigError:
        ours = None  # check_settings says why
    archs = checkpoint_architectures(model) if model else None
    target = for_architecture(archs[0]) if archs else None
    num_layers = config_mod.checkpoint_num_layers(model) if model else None
    draft = flag(ns, "speculative_draft_model_path")
    ids = _draft_layer_ids(draft)
    if target is None or num_layers is None or ids is False:
        theirs = "read from the drafter's config when the server loads it (the server log names them)"
    else:
        version = sglang_version()
        layers = (sglang_rule(target.family, version).apply(ids) if ids is not None
                  else [2, num_layers // 2, num_layers - 3])
        how = (f"its ids {ids} under sglang {version}'s {target.family} rule" if ids is not None
               else "SGLang's default [2, N//2, N-3]: the drafter names no ids")
        theirs = f"layers {layers} ({how})"
    hook = f"layers {ours}" if ours is not None else "the layers the server log names"
    return [Finding("speculative decoding", INFO, f"{base}; the drafter gets {theirs}, handed to it alone; "
                    f"the hook captures {hook}")]


def _draft_layer_ids(draft: Optional[str]):
    """The aux-layer ids a local EAGLE-3 draft's config names; None when it names none (SGLang
    then uses its default); False when there is no local config to read."""
    cfg = checkpoint_config(draft) if draft else None
    if cfg is None:
        return False
    eagle = cfg.get("eagle_config")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    return [int(i) for i in ids] if isinstance(ids, list) and all(isinstance(i, int) for i in ids) else None


def as_dicts(findings: List[Finding]) -> List[Dict[str, str]]:
    return [asdict(f) for f in findings]
