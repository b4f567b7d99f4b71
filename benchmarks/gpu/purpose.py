"""Capture -> train -> serve on a machine with an NVIDIA GPU: does a drafter trained on
hs_capture's dump speed up the target it was captured from?

One run, every step resumable (a step whose result is in the results file is skipped):
  target     a Kimi-K2.5-shaped target trained on a seeded synthetic language (language.py)
             until its greedy predictions are confident
  capture    the real SGLang serving it: `off` = the plain server (the flags `hscap serve`
             adds, no hook), `on` = `hscap serve --layers 2,3,5 --prenorm` (SGLang's defaults:
             overlap scheduler, decode CUDA graphs), same load: the training and held-out texts
             (prefill tokens/s) and greedy generations one at a time (decode tokens/s), and
             each hooked server's writer counters (`writer`: how long, and by which limit, the
             writer held its forwards); `wrong` = the hook on layers 1,2,4 (one below each: the
             wrong-layers control's data)
  verify     `hscap verify --dataset --reference` of the `on` dump (transformers on the GPU)
  data       merge (SpecForge format): train, held-out, wrong layers; from the train files, the
             shifted control (every state one token late: the off-by-one a capture bug gives)
             and the permuted one (the layers concatenated in another order)
  train      SpecForge's own `specforge train`, a 1-layer EAGLE-3 drafter each, evaluated by
             SpecForge's own evaluator on the held-out merge (`eval/avg_acc`: top-1 agreement
             with the target's next token): right (merged), right (straight from the dump via
             `hscap train specforge`), shifted, wrong layers, layers in another order, untrained
             (one step at lr 1e-10); beside them speculators' own `speculators train` on merge's
             speculators output of its own prepared dataset (sp_prepare; its validation split)
  serve      SGLang's own EAGLE-3 (`--speculative-algorithm EAGLE3`) with the trained and the
             untrained drafter, the same generations as `off` (the no-speculation baseline):
             accept length, decode tokens/s, greedy outputs compared
  spec_hooked  the trained drafter's server again, with the hook on layers 1,4 (not the
             drafter's 2,3,5): accept length and decode tokens/s beside spec_right's, greedy
             outputs, and `hscap verify --dataset --reference` of what it captured
  int4_*     the routed experts packed as Kimi-K2.5 ships them (int4.py): the hooked and the
             plain server, verify against transformers on the dequantized weights
  rule       verify's bf16 rule measured on the `on` dump (benchmarks/reference_rule.py): the
             server and transformers' eager-attention bf16 forward, beside faults

usage: python benchmarks/gpu/purpose.py --root DIR --site SITE --out RESULTS.json [--steps ...]
(bash benchmarks/gpu/device.sh purpose ... stages SITE and runs it; benchmarks/README.md)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import signal
import time
import urllib.request
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "lib"))
import language  # noqa: E402
from serving import HSCAP, REPO, SERVER_FLAGS, Server, free_port, hscap_json, plain_command, read_jsonl  # noqa: E402

RIGHT, WRONG, SPEC_HOOK = "2,3,5", "1,2,4", "1,4"
EVERY = "1,2,3,4,5"  # every layer of the 6-layer target after the embeddings (outlier steps)
SPEC_FLAGS = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
              "--speculative-num-draft-tokens", "4"]


LIVE: List[subprocess.Popen] = []  # trainers running now: stopped with this script


def _on_sigterm(signum, frame) -> None:
    """A restarted run stops this one: its trainers die, and unwinding runs every `finally`
    (which stops the server in hand: each server runs in a process group of its own)."""
    for p in LIVE:
        p.kill()
    sys.exit(143)


WRITER_KEYS = ("steps_written", "steps_written_raw", "tokens_written", "raw_bytes", "file_bytes", "forward_waited_s", "held_by_budget_s",
               "held_by_pinned_s", "pinned_buffers", "pinned_bytes", "pinned_allocs_in_forward",
               "peak_inflight_bytes", "writer_threads")


def writer_figures(dump: str) -> Dict[str, object]:
    """Each rank's closing counters of the newest run in `dump`, and its disk-bound report if it
    made one: whether this server's forwards were held, and by which limit (the bytes in flight,
    every pinned buffer in flight, the disk)."""
    from hs_capture.dump.paths import rank_meta_path, rank_tags, run_dirs

    try:
        run = run_dirs(dump)[-1]
        out: Dict[str, object] = {}
        for tag in rank_tags(run):
            with open(rank_meta_path(run, tag)) as f:
                meta = json.load(f)
            stats = meta.get("stats") or {}
            out[tag] = {**{k: stats.get(k) for k in WRITER_KEYS}, "disk_bound": meta.get("disk_bound")}
        return out
    except (OSError, ValueError, IndexError) as e:  # a figure missing never fails the step
        return {"error": f"{type(e).__name__}: {e}"}


class Run:
    def __init__(self, a) -> None:
        self.a = a
        self.root = a.root
        self.model = os.path.join(a.root, "model")
        self.data = os.path.join(a.root, "data")
        self.work = os.path.join(a.root, "work")
        os.makedirs(self.data, exist_ok=True)
        os.makedirs(self.work, exist_ok=True)
        self.res: Dict[str, object] = {}
        if os.path.exists(a.out):
            with open(a.out) as f:
                self.res = json.load(f)
        site = a.site
        base = {k: v for k, v in os.environ.items() if not k.startswith("HSCAP_")}
        # the server's packages (sglang's bundle) only where a server runs: the trainers keep the
        # machine's own transformers
        self.server_env = {**base, "PYTHONPATH": os.pathsep.join(
            p for p in (site, site and os.path.join(site, "nvidia_cutlass_dsl", "python_packages"), REPO) if p)}
        self.tool_env = {**base, "PYTHONPATH": REPO}

    def save(self) -> None:
        self.res["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        with open(self.a.out + ".tmp", "w") as f:
            json.dump(self.res, f, indent=1)
        os.replace(self.a.out + ".tmp", self.a.out)

    def step(self, name: str, fn) -> bool:
        """Run one step unless its result is here without an error; True when it ran."""
        if name in self.res and "error" not in self.res[name]:
            print(f"== {name}: done earlier", flush=True)
            return False
        print(f"== {name}", flush=True)
        t0 = time.time()
        try:
            self.res[name] = fn()
        except Exception as e:  # one step's failure is a result: the others still run
            self.res[name] = {"error": f"{type(e).__name__}: {str(e)[-3000:]}"}
            print(self.res[name]["error"], flush=True)
        if isinstance(self.res[name], dict):
            self.res[name]["wall_s"] = round(time.time() - t0, 1)
        self.save()
        return True

    # -- target and load ---------------------------------------------------------------------
    def target(self) -> dict:
        if not os.path.exists(os.path.join(self.model, "target_training.json")):
            language.train(self.model, self.a.target_steps, self.a.target_size)
        with open(os.path.join(self.model, "target_training.json")) as f:
            out = json.load(f)
        g = language.Grammar(0)
        language.write_jsonl(os.path.join(self.data, "train.jsonl"), g, "train", self.a.samples, 256, 512, 1)
        language.write_jsonl(os.path.join(self.data, "heldout.jsonl"), g, "held", 64, 256, 512, 2)
        rng = random.Random(3)
        with open(os.path.join(self.data, "prompts.jsonl"), "w") as f:
            for i in range(self.a.prompts):
                f.write(json.dumps({"id": f"gen-{i}", "input_ids": g.text(rng, 64)}) + "\n")
        return out

    # -- servers -----------------------------------------------------------------------------
    def flags(self, port: int, model: str) -> List[str]:
        return ["--model-path", model, *self.a.server_flags.split(), "--trust-remote-code",
                "--host", "127.0.0.1", "--port", str(port)]

    def serve(self, kind: str, dump: Optional[str] = None, layers: str = "", spec: Optional[str] = None,
              send: bool = True, generate: bool = True, model: Optional[str] = None,
              texts: Optional[str] = None, prenorm: bool = False, store: str = "") -> dict:
        """texts: send only this file (no warm-up, no timed send) instead of the held-out and train texts.
        prenorm: the hook also captures the final norm's input. store: `hscap serve --store`.
        A speculating server generates at temperature 0 and then 1."""
        model = model or self.model
        port = free_port()
        spec_flags = SPEC_FLAGS + ["--speculative-draft-model-path", spec] if spec else []
        if dump is None:
            cmd = plain_command(os.path.join(self.work, "unused"), self.flags(port, model), self.server_env) + spec_flags
        else:  # a step run again captures afresh: never two runs of one step in its dump
            shutil.rmtree(dump, ignore_errors=True)
            cmd = [*HSCAP, "serve", "-d", dump, "--layers", layers, *(["--prenorm"] if prenorm else []),
                   *(["--store", store] if store else []), "--", *self.flags(port, model), *spec_flags]
        env = {**self.server_env}
        log_path = os.path.join(self.work, f"server-{kind}.log")
        srv = Server(cmd, env, log_path, port)
        res: Dict[str, object] = {"command": " ".join(x if not x.startswith("/") else os.path.basename(x)
                                                      for x in cmd)[:600]}
        try:
            res["startup_s"] = round(srv.wait_healthy(), 1)
            # the held-out texts warm SGLang's kernels up (and are captured); the generations
            # come before the timed send, so no writer is still busy with 2 GB beside them
            if texts:  # one at a time: each sample in a batch of its own
                res["send"] = self.send(srv.url, texts, concurrency=1)
                send = generate = False
            if send:
                res["send_heldout"] = self.send(srv.url, os.path.join(self.data, "heldout.jsonl"))
            if generate:
                res["generate"] = self.generate(srv.url, kind)
            if generate and spec:  # sampling: the drafter's whole distribution must match, not its top token
                res["generate_t1"] = self.generate(srv.url, kind + "-t1", temperature=1.0)
            if send:
                res["send_train"] = self.send(srv.url, os.path.join(self.data, "train.jsonl"))
            sp = os.path.join(self.data, "sp")
            if kind == "on" and os.path.isdir(sp):  # speculators' own dataset of the train texts
                res["send_sp"] = self.send(srv.url, sp)
        finally:
            res["stop_s"] = round(srv.stop(), 1)
            log = srv.log()
            # from the tag on (a progress bar may share the line), whole: a warning is read in full
            res["hs_dump_lines"] = [x[x.index("[HS_DUMP]"):][:400] for x in log.splitlines()
                                    if "[HS_DUMP]" in x and "hooks installed" not in x][:12]
            res["accept_lines"] = [x[-220:] for x in log.splitlines() if "accept len" in x.lower()][-3:]
            if dump is not None:
                res["writer"] = writer_figures(dump)
            if self.a.out_dir:
                shutil.copy(log_path, os.path.join(self.a.out_dir, f"server-{kind}.log"))
        return res

    def send(self, url: str, data: str, concurrency: int = 64) -> dict:
        s = hscap_json("send", data, "--url", url, "-c", str(concurrency), env=self.tool_env)
        return {k: s.get(k) for k in ("sent", "failed", "tokens", "tokens_per_s", "wall_s") if k in s} or s

    def generate(self, url: str, kind: str, temperature: float = 0.0) -> dict:
        """Generations, one request at a time (where speculation pays most), after 4 warm-up
        requests: decode tokens/s, accept length from SGLang's own counters, and (greedy) how
        many outputs equal the plain server's (`off`) token for token."""
        rows = read_jsonl(os.path.join(self.data, "prompts.jsonl"))

        def one(row):
            body = json.dumps({"input_ids": row["input_ids"], "sampling_params": {
                "max_new_tokens": self.a.new_tokens, "temperature": temperature, "ignore_eos": True}}).encode()
            req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                return json.loads(r.read())

        for row in rows[:4]:
            one(row)
        outs, t0 = [], time.monotonic()
        for row in rows:
            outs.append(one(row))
        wall = time.monotonic() - t0
        toks = sum(o["meta_info"]["completion_tokens"] for o in outs)
        verify = [o["meta_info"].get("spec_verify_ct") for o in outs]
        res = {"requests": len(outs), "new_tokens": toks, "wall_s": round(wall, 2),
               "decode_tokens_per_s": round(toks / wall, 1)}
        if all(v for v in verify):
            res["accept_length"] = round(toks / sum(verify), 3)
        ids = [o.get("output_ids") for o in outs]
        with open(os.path.join(self.work, f"outputs-{kind}.json"), "w") as f:
            json.dump(ids, f)
        base = os.path.join(self.work, "outputs-off.json")
        if kind != "off" and not temperature and os.path.exists(base):
            with open(base) as f:
                res["outputs_equal_off"] = f"{sum(a == b for a, b in zip(ids, json.load(f)))}/{len(ids)}"
        return res

    def sent(self, path: str) -> str:
        with open(path, "w") as f:
            for name in ("train", "heldout"):
                with open(os.path.join(self.data, f"{name}.jsonl")) as g:
                    f.write(g.read())
        return path

    def verify(self, kind: str = "on", model: Optional[str] = None, dataset: Optional[str] = None,
               samples: int = 8) -> dict:
        doc = hscap_json("verify", os.path.join(self.work, f"dump-{kind}"), "--dataset",
                         dataset or self.sent(os.path.join(self.data, "sent.jsonl")), "-j", "16", "--reference",
                         os.path.join(model or self.model, "text_model"), "--reference-samples", str(samples),
                         "--reference-device", self.a.reference_device, "--max-findings", "5", env=self.tool_env)
        st = doc.get("stats", {})
        found = doc.get("findings", [])
        return {"ok": doc.get("ok"), "samples_complete": st.get("samples_complete"),
                "samples_incomplete": st.get("samples_incomplete"), "fidelity": st.get("reference_states"),
                "findings": [f.get("message", "")[:400] for f in found][:6],
                # the samples a token of which left the rule: the outlier steps serve them again
                "finding_rids": sorted({f["rid"] for f in found if f.get("check") == "reference" and f.get("rid")})}

    def outlier(self, prefix: str = "", model: Optional[str] = None) -> dict:
        """The samples `{prefix}verify`'s reference check failed on, served alone by a hooked server
        capturing every layer (and the pre-norm state), then verified again: the first state
        that leaves the rule is the layer where that token parts from transformers', and
        whether it fails at all alone says if it depends on the batch it was served in."""
        verified, kind = prefix + "verify", prefix + "outlier"
        done = self.res.get(verified) or {}
        if not done or "error" in done:
            raise RuntimeError(f"{verified} has no result to take its failing samples from")
        if "finding_rids" not in done:  # a result from before verify kept them: ask it again
            done = self.verify(prefix + "on", model)
        rids = set(done.get("finding_rids") or [])
        if not rids:
            return {"skipped": f"{verified} named no sample out of the reference rule"}
        texts = os.path.join(self.data, f"{kind}.jsonl")
        with open(self.sent(os.path.join(self.data, "sent.jsonl"))) as f, open(texts, "w") as g:
            g.writelines(line for line in f if json.loads(line)["id"] in rids)
        dump = os.path.join(self.work, f"dump-{kind}")
        res = {"rids": sorted(rids), "layers": EVERY,
               "serve": self.serve(kind, dump, EVERY, model=model, texts=texts, prenorm=True)}
        res["verify"] = self.verify(kind, model, dataset=texts, samples=len(rids))
        return res

    def rule(self, kind: str = "on", model: Optional[str] = None) -> dict:
        """verify's bf16 rule measured on this dump (benchmarks/reference_rule.py): the server
        and a second right bf16 forward (transformers' eager attention) against the rule and the
        per-token pairing it replaced, beside faults made from the dump."""
        out = os.path.join(self.work, f"rule-{kind}.json")
        cmd = [sys.executable, os.path.join(REPO, "benchmarks", "reference_rule.py"), "--dump",
               os.path.join(self.work, f"dump-{kind}"), "--model", os.path.join(model or self.model, "text_model"),
               "--samples", "64", "--device", self.a.reference_device, "--out", out]
        try:  # 132 samples took 88 s on a 2-core CPU: a hang must not hold the steps after it
            p = subprocess.run(cmd, cwd=REPO, env=self.tool_env, capture_output=True, text=True, timeout=1800)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"reference_rule.py still running after {e.timeout:.0f} s: stopped") from None
        if p.returncode != 0:
            raise RuntimeError(f"reference_rule.py exited {p.returncode}: {p.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)

    # -- training data -----------------------------------------------------------------------
    def merge(self, dump: str, out: str, dataset: str, fmt: str = "specforge") -> dict:
        doc = hscap_json("merge", dump, "-o", out, "--format", fmt, "--dataset", dataset, "-j", "8",
                         "--overwrite", env=self.tool_env)
        with open(os.path.join(out, "trainer_settings.json")) as f:
            settings = json.load(f)
        return {"written": doc.get("written", doc.get("stats")), "trainer_settings": settings}

    def controls(self, makers: Dict[str, object]) -> int:
        """Each control's SpecForge files (sf-<tag>), made from the train files; returns how many."""
        import torch

        for tag in makers:
            os.makedirs(os.path.join(self.work, f"sf-{tag}"), exist_ok=True)
        n = 0
        for path in glob.glob(os.path.join(self.work, "sf-train", "**", "*.ckpt"), recursive=True):
            d = torch.load(path)
            for tag, make in makers.items():
                torch.save(make(d), os.path.join(self.work, f"sf-{tag}", os.path.basename(path)))
            n += 1
        return n

    def data_step(self) -> dict:
        sf = lambda n: os.path.join(self.work, f"sf-{n}")  # noqa: E731
        out = {"train": self.merge(os.path.join(self.work, "dump-on"), sf("train"), os.path.join(self.data, "train.jsonl")),
               "heldout": self.merge(os.path.join(self.work, "dump-on"), sf("heldout"),
                                     os.path.join(self.data, "heldout.jsonl")),
               "wrong": self.merge(os.path.join(self.work, "dump-wrong"), sf("wrong"),
                                   os.path.join(self.data, "train.jsonl"))}
        # the controls, from the train files: every state one token late (a position off by
        # one), and the layers concatenated in another order (5,2,3 for 2,3,5)
        hidden = int(json.load(open(os.path.join(self.model, "text_model", "config.json")))["hidden_size"])
        n = self.controls({"shifted": shift_one_token, "permuted": lambda d: rotate_layers(d, hidden)})
        out["shifted"] = out["permuted"] = {"written": n}
        sp = os.path.join(self.data, "sp")
        if os.path.isdir(sp):
            out["speculators"] = self.merge(os.path.join(self.work, "dump-on"), os.path.join(sp, "hidden_states"), sp,
                                            "speculators")
        return out

    # -- drafters ----------------------------------------------------------------------------
    def draft_config(self) -> str:
        with open(os.path.join(self.model, "text_model", "config.json")) as f:
            t = json.load(f)
        # the ids merge printed for the captured layers (SGLang serves the drafter on them)
        settings = self.res["data"]["train"]["trainer_settings"]["settings"]
        eagle_ids = settings["eagle_config.eagle_aux_hidden_state_layer_ids"]
        path = os.path.join(self.work, "draft.json")
        with open(path, "w") as f:
            json.dump({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                       "hidden_size": t["hidden_size"], "intermediate_size": 2816, "num_attention_heads": 8,
                       "num_key_value_heads": 8, "num_hidden_layers": 1, "vocab_size": t["vocab_size"],
                       "draft_vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
                       "hidden_act": "silu", "pad_token_id": 0, "rope_theta": 10000.0, "tie_word_embeddings": False,
                       "torch_dtype": "bfloat16", "eagle_config": {"eagle_aux_hidden_state_layer_ids": eagle_ids}}, f)
        return path

    def specforge_start(self, tag: str, data: str, steps: int, lr: float, port: int, from_dump: bool = False,
                        seed: int = 0):
        """Start SpecForge's own trainer on DATA (its own torchrun master port: the drafters
        train side by side on the one GPU); returns what specforge_finish needs."""
        out_dir = os.path.join(self.work, f"sf-out-{tag}")
        shutil.rmtree(out_dir, ignore_errors=True)
        draft = self.draft_config()
        with open(draft) as f:
            ids = json.load(f)["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        cfg = os.path.join(self.work, f"sf-{tag}.yaml")
        with open(cfg, "w") as f:
            f.write(f"""model:
  target_model_path: {self.model}/text_model
  aux_hidden_state_layer_ids: {json.dumps(ids)}
  torch_dtype: bfloat16
  draft_model_config: {draft}
data:
  hidden_states_path: {data}
  eval_hidden_states_path: {self.work}/sf-heldout
  cache_dir: {self.work}/sf-cache-{tag}
deployment:
  trainer:
    nproc_per_node: 1
    master_port: {port}
training:
  batch_size: {self.a.batch}
  num_epochs: 100
  max_steps: {steps}
  learning_rate: {lr}
  eval_interval: {steps}
  save_interval: {steps}
  log_interval: 50
  seed: {seed}
output_dir: {out_dir}
""")
        cmd = (["specforge", "train", "--config", cfg] if not from_dump else
               [*HSCAP, "train", "specforge", "--dataset", os.path.join(self.data, "train.jsonl"), "--", "--config", cfg])
        run = self.launch(cmd, os.path.join(self.work, f"sf-{tag}.log"), self.tool_env)
        return {**run, "tag": tag, "out_dir": out_dir, "draft": draft,
                "res": {"steps": steps, "lr": lr, "data": os.path.basename(data), "from_dump": from_dump, "seed": seed}}

    def launch(self, cmd: List[str], log: str, env: Dict[str, str]) -> dict:
        """A trainer in the background, its output in LOG; stopped with this script."""
        f = open(log, "w")
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        LIVE.append(p)
        return {"proc": p, "logf": f, "log": log, "t0": time.time()}

    def collect(self, run: dict) -> Tuple[dict, str]:
        """Wait for a launched trainer: ({exit, train_s (its own)}, its log's text); the log is
        also copied to --out-dir."""
        rc = run["proc"].wait()
        run["logf"].close()
        with open(run["log"]) as f:
            text = f.read()
        if self.a.out_dir:
            shutil.copy(run["log"], os.path.join(self.a.out_dir, os.path.basename(run["log"])))
        return {"exit": rc, "train_s": round(run.get("t1", time.time()) - run["t0"], 1)}, text

    def specforge_finish(self, run: dict) -> dict:
        """Wait for the trainer; SpecForge's own held-out evaluation; export for SGLang."""
        done, text = self.collect(run)
        res = {**run["res"], **done}
        metas = glob.glob(os.path.join(run["out_dir"], "*.best_meta.json"))
        if res["exit"] or not metas:
            res["log_tail"] = text[-2500:]
            return res
        with open(metas[0]) as f:
            m = json.load(f)["metrics"]
        res.update(heldout_top1=round(m["eval/avg_acc"], 4),
                   per_position_acc=[round(x, 4) for x in m.get("eval/per_position_acc", [])],
                   simulated_acc_len=round(m.get("eval/simulated_acc_len", 0), 3),
                   eval_loss=round(m.get("eval/avg_loss", 0), 4))
        exported = os.path.join(self.work, f"drafter-{run['tag']}")
        shutil.rmtree(exported, ignore_errors=True)
        e = subprocess.run(["specforge", "export", "--to", "sglang", "--checkpoint", run["out_dir"], "--draft-config",
                            run["draft"], "--output-dir", exported], capture_output=True, text=True, env=self.tool_env)
        res["export_exit"] = e.returncode
        if e.returncode:
            res["export_tail"] = (e.stdout + e.stderr)[-2000:]
        return res

    def head_index(self) -> None:
        index = os.path.join(self.model, "text_model", "model.safetensors.index.json")
        if not os.path.exists(index):  # SpecForge finds the target's head through the index
            from safetensors import safe_open

            with safe_open(os.path.join(self.model, "text_model", "model.safetensors"), "pt") as f:
                json.dump({"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}, open(index, "w"))

    def train(self) -> dict:
        """The drafters, side by side: right (merged), right straight from the dump, the
        shifted, wrong-layer and permuted controls, an untrained one (a single step at lr
        1e-10), and speculators' own trainer when its data was captured."""
        w, n, lr = self.work, self.trained_steps(), self.a.lr
        self.head_index()
        jobs = [("right", os.path.join(w, "sf-train"), n, lr, False),
                ("dump", os.path.join(w, "dump-on"), n, lr, True),
                ("shifted", os.path.join(w, "sf-shifted"), n, lr, False),
                ("wrong", os.path.join(w, "sf-wrong"), n, lr, False),
                ("permuted", os.path.join(w, "sf-permuted"), n, lr, False),
                ("untrained", os.path.join(w, "sf-train"), 1, 1e-10, False)]
        runs = [self.specforge_start(tag, data, steps, rate, 29500 + 7 * i, dump)
                for i, (tag, data, steps, rate, dump) in enumerate(jobs)]
        sp = self.speculators_start()  # speculators' own trainer on merge's output, beside them
        _wait_all(runs + ([sp] if sp else []))
        out = {run["tag"]: self.specforge_finish(run) for run in runs}
        if sp is not None:
            out["speculators"] = self.speculators_finish(sp)
        failed = [t for t, r in out.items() if r.get("exit") or r.get("export_exit")
                  or (t != "speculators" and "heldout_top1" not in r)]
        if failed:  # a rerun trains them again
            out["error"] = f"failed: {failed}"
        return out

    # -- the compact tier (hscap serve --store fp8) ---------------------------------------------
    def compact_data(self) -> dict:
        """SpecForge's data from the lossless dump (train, held-out, the shifted control) and
        from the fp8 dump (train: bfloat16 again, as merge hands every trainer), and the bytes
        each dump took per token."""
        sf = lambda n: os.path.join(self.work, f"sf-{n}")  # noqa: E731
        train, held = os.path.join(self.data, "train.jsonl"), os.path.join(self.data, "heldout.jsonl")
        out = {"train": self.merge(os.path.join(self.work, "dump-on"), sf("train"), train),
               "heldout": self.merge(os.path.join(self.work, "dump-on"), sf("heldout"), held),
               "train_fp8": self.merge(os.path.join(self.work, "dump-on_fp8"), sf("train-fp8"), train)}
        out["shifted"] = {"written": self.controls({"shifted": shift_one_token})}
        out["bytes"] = {k: writer_figures(os.path.join(self.work, f"dump-{k}")) for k in ("on", "on_fp8")}
        return out

    def compact_bytes(self) -> dict:
        """benchmarks/compact_tier.py on the lossless dump of the trained target: bytes per
        token of each tier, and the entropy coder's rates per core, on this host's CPU."""
        out = os.path.join(self.work, "compact_tier.json")
        p = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "compact_tier.py"), "--dump",
                            os.path.join(self.work, "dump-on"), "--label", "the trained target's states (purpose.py "
                            "dump-on: layers 2,3,5, final, pre-norm)", "--files", "48", "--out", out],
                           cwd=REPO, env=self.tool_env, capture_output=True, text=True, timeout=1200)
        if p.returncode != 0:
            raise RuntimeError(f"compact_tier.py exited {p.returncode}: {p.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)

    def compact_train(self) -> dict:
        """Side by side: two drafters from the lossless dump with different seeds (their
        difference is the noise), one from the fp8 dump, and the shifted control."""
        w, n, lr = self.work, self.trained_steps(), self.a.lr
        self.head_index()
        self.res.setdefault("data", self.res.get("compact_data"))  # draft_config reads merge's layer ids
        jobs = [("right", "sf-train", 0), ("right_s1", "sf-train", 1), ("fp8", "sf-train-fp8", 0),
                ("shifted", "sf-shifted", 0)]
        runs = [self.specforge_start(tag, os.path.join(w, data), n, lr, 29500 + 7 * i, seed=seed)
                for i, (tag, data, seed) in enumerate(jobs)]
        _wait_all(runs)
        out = {run["tag"]: self.specforge_finish(run) for run in runs}
        failed = [t for t, r in out.items() if r.get("exit") or r.get("export_exit") or "heldout_top1" not in r]
        if failed:
            out["error"] = f"failed: {failed}"
        return out

    def sp_prepare(self) -> dict:
        """speculators' own prepared dataset of the train texts (sent to the hooked server too)."""
        text = os.path.join(self.model, "text_model")
        for name in ("tokenizer.json", "tokenizer_config.json"):  # its tokenizer is the wrapper's
            if not os.path.exists(os.path.join(text, name)):
                shutil.copy(os.path.join(self.model, name), text)
        out = os.path.join(self.data, "sp")
        shutil.rmtree(out, ignore_errors=True)
        p = subprocess.run(["speculators", "prepare-data", "--model", text, "--data",
                            os.path.join(self.data, "train.jsonl"), "--output", out],
                           capture_output=True, text=True, env=self.tool_env)
        if p.returncode:
            shutil.rmtree(out, ignore_errors=True)
            raise RuntimeError(f"speculators prepare-data exited {p.returncode}: {(p.stdout + p.stderr)[-1500:]}")
        return {"input_rows": len(read_jsonl(os.path.join(self.data, "train.jsonl"))), "output": out}

    def speculators_start(self):
        sp = os.path.join(self.data, "sp")
        if not os.path.isdir(os.path.join(sp, "hidden_states")):
            return None
        cmd = ["speculators", "train", "--verifier-name-or-path", os.path.join(self.model, "text_model"),
               "--data-path", sp, "--target-layer-ids", *RIGHT.split(","), "--hidden-states-dtype", "bfloat16",
               "--epochs", str(self.a.epochs), "--total-seq-len", "2048", "--num-workers", "2", "--log-freq", "50",
               "--save-path", os.path.join(self.work, "sp-out"),
               # its fused (Triton) loss fails under torch 2.11's compile (benchmarks/README.md)
               "--loss-implementation", "eager"]
        return self.launch(cmd, os.path.join(self.work, "sp-train.log"), {**self.tool_env, "MASTER_PORT": "29650"})

    def speculators_finish(self, run) -> dict:
        import re

        res, text = self.collect(run)
        last = lambda key: (re.findall(rf"val/{key}=([0-9.e+-]+)", text) or [None])[-1]  # noqa: E731
        res.update(val_full_acc_0=last("full_acc_0_epoch"), val_loss=last("loss_epoch"))
        if res["exit"]:
            res["log_tail"] = text[-2500:]
        return res

    def quantized(self) -> str:
        import int4

        out = os.path.join(self.root, "model-int4")
        if not os.path.exists(os.path.join(out, "config.json")):
            self.res["int4"] = int4.main(self.model, out)
        return out

    def trained_steps(self) -> int:
        # the texts written (a stage run may have written them with other settings)
        return self.a.epochs * len(read_jsonl(os.path.join(self.data, "train.jsonl"))) // self.a.batch


def _wait_all(runs: List[dict]) -> None:
    """Until every trainer has exited, noting when each did (its own train_s)."""
    while any("t1" not in r for r in runs):
        for r in runs:
            if "t1" not in r and r["proc"].poll() is not None:
                r["t1"] = time.time()
        time.sleep(1)


def shift_one_token(d: dict) -> dict:
    """A SpecForge sample whose states are one token late: token t carries token t-1's states
    (row 0 repeated), what a capture with positions off by one would give."""
    import torch

    out = dict(d)
    for k in ("aux_hidden_state", "hidden_state"):
        t = d[k]
        out[k] = torch.cat([t[:, :1], t[:, :-1]], dim=1).contiguous()
    return out


def rotate_layers(d: dict, hidden: int) -> dict:
    """A SpecForge sample whose aux layers are concatenated in another order (the last first)."""
    import torch

    aux = d["aux_hidden_state"]
    blocks = list(aux.split(hidden, dim=-1))
    return {**d, "aux_hidden_state": torch.cat(blocks[-1:] + blocks[:-1], dim=-1).contiguous()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True, help="work dir: model, data, dumps, drafters")
    ap.add_argument("--site", default="", help="the sglang bundle's site dir (device.sh stages it)")
    ap.add_argument("--out", required=True, help="the results file (a rerun resumes from it)")
    ap.add_argument("--out-dir", help="also copy the logs here")
    ap.add_argument("--target-steps", type=int, default=400)
    ap.add_argument("--target-size", choices=sorted(language.SIZES), default="gpu")
    ap.add_argument("--reference-device", default="cuda")
    ap.add_argument("--samples", type=int, default=512, help="training texts captured (256-512 tokens each)")
    ap.add_argument("--prompts", type=int, default=32, help="greedy generations per server")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-4)
    # decode graphs up to batch 16: the generations run one at a time (the sends are prefill), and
    # the int4 server's capture of SGLang's default sizes took 295 s of its 369 s start
    ap.add_argument("--server-flags", default=" ".join(SERVER_FLAGS + ["--cuda-graph-max-bs", "16"]))
    # the steps whose answers are not yet known first: a run stopped early loses the known ones
    # (the untrained drafter's accept length, ~1) and int4, which needs only the target and can
    # run in a later one (--steps target,int4_on,int4_verify,int4_off,int4_outlier)
    ap.add_argument("--steps", default="target,sp_prepare,off,on,wrong,verify,data,train,spec_right,spec_hooked,"
                                       "spec_hooked_verify,spec_untrained,int4_on,int4_verify,int4_off,outlier,"
                                       "int4_outlier,rule",
                    help="which steps, in order")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, _on_sigterm)
    r = Run(a)
    try:
        import torch

        r.res.setdefault("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    except Exception as e:
        r.res.setdefault("device", f"? ({e})")
    steps = {
        "target": r.target,
        "sp_prepare": r.sp_prepare,
        "off": lambda: r.serve("off"),
        "on": lambda: r.serve("on", os.path.join(r.work, "dump-on"), RIGHT, prenorm=True),
        "wrong": lambda: r.serve("wrong", os.path.join(r.work, "dump-wrong"), WRONG, generate=False),
        "verify": r.verify,
        "data": r.data_step,
        "train": r.train,
        "spec_untrained": lambda: r.serve("spec_untrained", spec=os.path.join(r.work, "drafter-untrained")),
        "spec_right": lambda: r.serve("spec_right", spec=os.path.join(r.work, "drafter-right")),
        # capture from a server that already speculates: the same server, flags, drafter and load
        # as spec_right, with the hook on other layers (1,4) than the drafter's (2,3,5)
        "spec_hooked": lambda: r.serve("spec_hooked", os.path.join(r.work, "dump-spec_hooked"), SPEC_HOOK,
                                       spec=os.path.join(r.work, "drafter-right")),
        "spec_hooked_verify": lambda: r.verify("spec_hooked"),
        # verify's failing samples again, alone, every layer captured: where does the token part?
        "outlier": lambda: r.outlier(),
        "int4_outlier": lambda: r.outlier("int4_", r.quantized()),
        # the routed experts in int4 as Kimi-K2.5 ships them: plain and hooked server, verified
        # against transformers on the dequantized weights
        "int4_off": lambda: r.serve("int4_off", model=r.quantized()),
        "int4_on": lambda: r.serve("int4_on", os.path.join(r.work, "dump-int4_on"), RIGHT, model=r.quantized()),
        "int4_verify": lambda: r.verify("int4_on", r.quantized()),
        # verify's bf16 rule measured on the `on` dump: the server and transformers' eager forward
        "rule": lambda: r.rule(),
        # the compact tier: the same capture stored fp8, drafters trained from both, served
        "on_fp8": lambda: r.serve("on_fp8", os.path.join(r.work, "dump-on_fp8"), RIGHT, prenorm=True, store="fp8",
                                  generate=False),
        "verify_fp8": lambda: r.verify("on_fp8"),
        "compact_data": r.compact_data,
        "compact_bytes": r.compact_bytes,
        "compact_train": r.compact_train,
        "spec_right_s1": lambda: r.serve("spec_right_s1", spec=os.path.join(r.work, "drafter-right_s1"), send=False),
        "spec_fp8": lambda: r.serve("spec_fp8", spec=os.path.join(r.work, "drafter-fp8"), send=False),
        "spec_shifted": lambda: r.serve("spec_shifted", spec=os.path.join(r.work, "drafter-shifted"), send=False),
    }
    names = a.steps.split(",")
    for i, name in enumerate(names):
        if r.step(name, steps[name]):
            # a step that ran again makes what the later ones built on it stale
            for later in names[i + 1:]:
                r.res.pop(later, None)
    r.res["summary"] = summarize(r.res)
    print(json.dumps(r.res["summary"], indent=1), flush=True)
    r.save()
    sys.exit(1 if any(isinstance(r.res.get(n), dict) and "error" in r.res[n] for n in names) else 0)


def summarize(res: dict) -> dict:
    """The four answers, from the steps' results."""
    gen = lambda k: (res.get(k) or {}).get("generate") or {}  # noqa: E731
    tps = lambda k: ((res.get(k) or {}).get("send_train") or {}).get("tokens_per_s")  # noqa: E731
    t = res.get("target") or {}
    s: Dict[str, object] = {"target_greedy_accuracy": (t.get("after_bf16_weights") or {}).get("greedy_accuracy"),
                            "target_mean_top1_prob": (t.get("after_bf16_weights") or {}).get("mean_top1_prob"),
                            "language_best_possible": t.get("oracle_accuracy")}
    for pre in ("", "int4_"):
        if tps(pre + "off") and tps(pre + "on"):
            s[pre + "prefill_on_over_off"] = round(tps(pre + "on") / tps(pre + "off"), 3)
        if gen(pre + "off").get("decode_tokens_per_s") and gen(pre + "on").get("decode_tokens_per_s"):
            s[pre + "decode_on_over_off"] = round(gen(pre + "on")["decode_tokens_per_s"] /
                                                  gen(pre + "off")["decode_tokens_per_s"], 3)
        w = (res.get(pre + "on") or {}).get("writer") or {}
        if w:  # whether the writer held the hooked server's forwards, and by which limit
            s[pre + "on_writer"] = {tag: {k: v.get(k) for k in ("forward_waited_s", "held_by_budget_s", "held_by_pinned_s",
                                                               "steps_written_raw", "steps_written", "disk_bound")}
                                    if isinstance(v, dict) else v for tag, v in w.items()}  # or the error
    for k in ("verify", "int4_verify"):
        v = res.get(k) or {}
        s[k] = {x: v.get(x) for x in ("ok", "samples_complete", "samples_incomplete", "findings", "error") if x in v}
        if v.get("fidelity"):  # per state: the rule's margin, and how the server's rounding compares
            s[k]["rule"] = {st: {x: f.get(x) for x in ("worst_vs_bound", "tail_tokens", "median_vs_ref", "ref_tail_rel",
                                                      "max_rel", "ref_max_rel")} for st, f in v["fidelity"].items()}
    for k in ("outlier", "int4_outlier"):  # per state, how far the served-alone samples came to the rule
        o = res.get(k) or {}
        if "verify" in o:
            s[k] = {"rids": o.get("rids"), "ok": o["verify"].get("ok"), "findings": o["verify"].get("findings"),
                    "worst_vs_bound": {st: (v or {}).get("worst_vs_bound")
                                       for st, v in (o["verify"].get("fidelity") or {}).items()}}
        elif o:
            s[k] = o
    rule = (res.get("rule") or {}).get("states") or {}
    if rule:  # per state: samples failing by verify's rule and by the pairing before it, and the worst token
        s["reference_rule"] = {st: {c: {k: v[c].get(k) for k in ("samples", "rule_failing", "pairing_failing",
                                                                 "rule_worst", "draws4_failing")}
                                    for c in ("server", "transformers_eager", "other_sample_token") if c in v}
                               for st, v in rule.items()}
    tr = res.get("train") or {}
    s["heldout_top1"] = {k: v.get("heldout_top1") for k, v in tr.items() if isinstance(v, dict) and k != "speculators"}
    right = s["heldout_top1"].get("right")
    if right is not None and right < 1:  # the controls' misses in units of the right drafter's
        s["heldout_misses_over_right"] = {k: round((1 - v) / (1 - right), 2) for k, v in s["heldout_top1"].items()
                                          if v is not None and k != "right"}
    if isinstance(tr.get("speculators"), dict):
        s["speculators_own_validation"] = {k: tr["speculators"].get(k) for k in ("exit", "val_full_acc_0", "val_loss")}
    s["heldout_simulated_accept_length"] = {k: v.get("simulated_acc_len") for k, v in (res.get("train") or {}).items()
                                            if isinstance(v, dict)}
    no_spec = gen("off").get("decode_tokens_per_s")
    s["decode"] = {"no_spec": {"decode_tokens_per_s": no_spec}}
    for k in ("spec_untrained", "spec_right"):
        g = gen(k)
        if g:
            s["decode"][k] = {"accept_length": g.get("accept_length"), "decode_tokens_per_s": g.get("decode_tokens_per_s"),
                              "over_no_spec": round(g["decode_tokens_per_s"] / no_spec, 3) if no_spec else None,
                              "outputs_equal_no_spec": g.get("outputs_equal_off")}
    ct = res.get("compact_train") or {}
    if ct:  # the compact tier: the fp8-trained drafter against two lossless ones (their spread is the noise)
        t1 = lambda k: (res.get(k) or {}).get("generate_t1") or {}  # noqa: E731
        spec = {"right": "spec_right", "right_s1": "spec_right_s1", "fp8": "spec_fp8", "shifted": "spec_shifted"}
        s["compact"] = {tag: {"heldout_top1": (ct.get(tag) or {}).get("heldout_top1"),
                              "simulated_acc_len": (ct.get(tag) or {}).get("simulated_acc_len"),
                              "accept_length_t0": gen(k).get("accept_length"),
                              "accept_length_t1": t1(k).get("accept_length")} for tag, k in spec.items()}
        per_token = {}
        for k, figs in ((res.get("compact_data") or {}).get("bytes") or {}).items():
            for v in figs.values():
                if isinstance(v, dict) and v.get("tokens_written"):
                    per_token[k] = round(v["file_bytes"] / v["tokens_written"], 1)
        if per_token:
            s["compact_bytes_per_token"] = per_token
        s["compact_verify"] = {x: (res.get("verify_fp8") or {}).get(x) for x in ("ok", "samples_complete", "findings")}
    hooked, plain = gen("spec_hooked"), gen("spec_right")
    if hooked and plain:
        s["speculating_server_hook_on_vs_off"] = {
            "accept_length_on": hooked.get("accept_length"), "accept_length_off": plain.get("accept_length"),
            "decode_tokens_per_s_on": hooked.get("decode_tokens_per_s"),
            "decode_tokens_per_s_off": plain.get("decode_tokens_per_s"),
            "outputs_equal_no_spec_on": hooked.get("outputs_equal_off"),
            "layer_lines": [x for x in (res.get("spec_hooked") or {}).get("hs_dump_lines", []) if "layer" in x],
            "verify": {x: (res.get("spec_hooked_verify") or {}).get(x) for x in ("ok", "samples_complete", "findings")}}
    return s


if __name__ == "__main__":
    main()
