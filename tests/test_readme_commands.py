"""The commands of README.md and docs/*.md, taken from their text and run as written on this CPU.

Every ```bash and ```python block of those files carries an HTML comment on the line above it
that says how it is run (a block without one fails here):
  <!-- cpu-env -->            the lines every other CPU block runs after (venv, $W, $PORT)
  <!-- cpu-recipe -->         serve -> send -> merge -> verify, run in order as one script
                              (one server for all of it)
  <!-- cpu-trainer: NAME -->  a trainer's own command(s), each followed by a line
                              `# stops: MESSAGE`: where it stops on a CPU
  <!-- cpu-demo -->           `bash bin/setup_env.sh && ...`: the set-up is the one this suite
                              runs under (.ci/run), the rest runs as written (its --out in a
                              temp dir)
  <!-- deployment -->         a GPU deployment's paths and models: every `hscap` command in it is
                              parsed by hscap's own CLI (options, arguments, choices; paths need
                              not exist), every SGLang argument list (`hscap serve|doctor -- ...`,
                              `python -m sglang.launch_server ...`) by SGLang's own parser; then
                              the block is reported skipped, with that reason
  <!-- dump-dataset -->       Python: run by tests/test_dump_dataset.py on a real dump
The recipe must end on verify's PASS (exit 0) with every sample merged in all three formats;
each trainer command must fail with exactly the message the block names (so it got past
its imports and argument parsing to that point). Every `specforge`/`speculators` subcommand
any block names must exist. The ModelOpt block runs as written in `.venvs/modelopt`
(its launch_train.sh, main.py, and `hscap train modelopt` from the dump, with no PYTHONPATH) and
needs a Model-Optimizer checkout (MODELOPT_EXAMPLES=.../examples/speculative_decoding): skipped,
with the reason, without one.
README_UNDER_TEST=path runs another copy of the README (to see these tests fail)."""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile

import click
import pytest

from tests.sglang_cpu.harness import REPO, free_port

README = os.environ.get("README_UNDER_TEST") or os.path.join(REPO, "README.md")
DOCUMENTS = [README] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
MARKS = r"cpu-env|cpu-recipe|cpu-demo|deployment|dump-dataset|cpu-trainer: ([\w-]+)"
MARKED = re.compile(r"<!-- (" + MARKS + r") -->\s*\n```(?:bash|python)\n(.*?)^```", re.S | re.M)
FENCED = re.compile(r"^```(?:bash|python)\n(.*?)^```", re.S | re.M)
STOPS = "# stops: "
SAMPLES = 12  # bin/tiny_model.py's default
SETUP = "bash bin/setup_env.sh && "


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def readme_blocks() -> dict:
    texts, unmarked = {}, []
    env, recipe, trainers, demo, deployment, snippets = [], [], {}, [], [], []
    for path in DOCUMENTS:
        with open(path) as f:
            text = f.read()
        rel = os.path.relpath(path, REPO) if path.startswith(REPO) else path
        texts[rel] = text
        marked = set()
        for m in MARKED.finditer(text):
            marked.add(m.start(3))
            kind, where = m.group(1), f"{rel}:{_line(text, m.start(3))}"
            if kind == "cpu-env":
                env.append(m.group(3))
            elif kind == "cpu-recipe":
                recipe.append(m.group(3))
            elif kind == "cpu-demo":
                demo.append(m.group(3))
            elif kind == "deployment":
                deployment.append((where, m.group(3)))
            elif kind == "dump-dataset":
                snippets.append(m.group(3))
            else:
                trainers[m.group(2)] = m.group(3)
        unmarked += [f"{rel}:{_line(text, m.start(1))}" for m in FENCED.finditer(text) if m.start(1) not in marked]
    assert len(env) == 1 and recipe and trainers, f"no marked CPU blocks in {DOCUMENTS}"
    return {"texts": texts, "env": env[0], "recipe": recipe, "trainers": trainers, "demo": sorted(set(demo)),
            "deployment": deployment, "snippets": snippets, "unmarked": unmarked}


BLOCKS = readme_blocks()


def clean_env(work: str, port: int, tmp: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HSCAP_", "SGLANG_HS_")) and k not in ("PYTHONPATH", "VIRTUAL_ENV",
                                                                     "SGLANG_USE_CPU_ENGINE")}
    # TMPDIR: SGLang's ZMQ sockets are temp files it never removes
    env.update(W=work, PORT=str(port), TMPDIR=tmp)
    return env


def run_script(script: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """bash, from the checkout's root, in its own process group: whatever it started in the
    background (the server) is killed with it."""
    proc = subprocess.Popen(["bash", "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"README block ran over {timeout:.0f} s:\n{out[-4000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def stop_points(block: str) -> tuple:
    """(the MESSAGE of each `# stops: MESSAGE` line, in order; the block with the k-th such line
    replaced by an echo of marker k and the exit status of the command just before it)."""
    lines, stops = [], []
    for line in block.splitlines():
        if line.startswith(STOPS):
            stops.append(line[len(STOPS):].strip())
            lines.append(f'echo "@@stop {len(stops) - 1} rc=$?@@"')
        else:
            lines.append(line)
    assert stops, "a cpu-trainer block names no `# stops:` line"
    assert block.rstrip().splitlines()[-1].startswith(STOPS), "commands after the last `# stops:` line"
    return stops, "\n".join(lines) + "\n"


def squeeze(s: str) -> str:
    """Whitespace collapsed: rich and argparse wrap long messages at the terminal's width."""
    return " ".join(s.split())


@pytest.fixture(scope="module")
def recipe():
    work = tempfile.mkdtemp(prefix="hscap-readme-")
    tmp = tempfile.mkdtemp(prefix="hscap-readme-tmp-")
    try:
        env = clean_env(work, free_port(), tmp)
        res = run_script(BLOCKS["env"] + "\n" + "\n".join(BLOCKS["recipe"]), env, timeout=900)
        log = os.path.join(work, "server.log")
        server_log = "(no server.log)"
        if os.path.exists(log):
            with open(log, errors="replace") as f:
                server_log = f.read()[-3000:]
        yield {"work": work, "env": env, "out": res.stdout, "rc": res.returncode,
               "server_log": server_log}
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def test_cpu_recipe_serves_sends_merges_and_verifies_pass(recipe):
    out, w = recipe["out"], recipe["work"]
    assert recipe["rc"] == 0, f"{out[-5000:]}\n--- server.log:\n{recipe['server_log']}"
    assert out.rstrip().splitlines()[-1].startswith("PASS"), out[-6000:]  # verify's last line
    assert "final state post-norm and pre-norm" in out  # the `grep HS_DUMP` of the server log
    assert "closed:" in out and "0 dropped, 0 failed" in out
    assert f"samples_complete={SAMPLES}" in out and "samples_incomplete=0" in out
    assert len(glob.glob(os.path.join(w, "sf", "*.ckpt"))) == SAMPLES
    assert len(glob.glob(os.path.join(w, "mo", "*.pt"))) == SAMPLES
    assert len(glob.glob(os.path.join(w, "sp", "hidden_states", "hs_*.safetensors"))) == SAMPLES


def _ids(pattern: str, block: str) -> list:
    m = re.search(pattern, block)
    assert m, f"no {pattern!r} in the README block"
    return [int(x) for x in re.findall(r"\d+", m.group(1))]


def test_trainer_layer_ids_in_the_readme_are_the_ones_merge_wrote(recipe):
    assert recipe["rc"] == 0, recipe["out"][-3000:]
    t, w = BLOCKS["trainers"], recipe["work"]

    def settings(sub):
        with open(os.path.join(w, sub, "trainer_settings.json")) as f:
            return json.load(f)["settings"]

    assert _ids(r"aux_hidden_state_layer_ids: (\[[\d, ]*\])", t["specforge"]) == \
        settings("sf")["model.aux_hidden_state_layer_ids"]
    assert _ids(r"--target-layer-ids((?: \d+)+)", t["speculators"]) == \
        settings(os.path.join("sp", "hidden_states"))["target_layer_ids"]
    assert _ids(r"eagle_aux_hidden_state_layer_ids=(\[[\d,]*\])", t["modelopt"]) == \
        settings("mo")["eagle_aux_hidden_state_layer_ids"]


@pytest.mark.parametrize("name", sorted(BLOCKS["trainers"]))
def test_trainer_command_stops_where_the_readme_says(recipe, name):
    assert recipe["rc"] == 0, recipe["out"][-3000:]
    env = dict(recipe["env"])
    if name == "modelopt":
        examples = os.environ.get("MODELOPT_EXAMPLES")
        if not examples or not os.path.exists(os.path.join(examples, "main.py")):
            pytest.skip("ModelOpt's training entry is in a Model-Optimizer checkout: set MODELOPT_EXAMPLES to its "
                        "examples/speculative_decoding")
        if not os.path.exists(os.path.join(REPO, ".venvs", "modelopt", "bin", "activate")):
            pytest.skip("no ModelOpt overlay venv: bash bin/setup_env.sh makes .venvs/modelopt")
        env["MODELOPT_EXAMPLES"] = examples
    stops, script = stop_points(BLOCKS["trainers"][name])
    res = run_script(BLOCKS["env"] + "\n" + script, env, timeout=900)
    pieces = re.split(r"@@stop (\d+) rc=(\d+)@@\n", res.stdout)
    # [output before marker 0, k, rc, output before marker 1, k, rc, ..., the rest]
    assert len(pieces) == 3 * len(stops) + 1, res.stdout[-6000:]
    for k, message in enumerate(stops):
        before, rc = pieces[3 * k], int(pieces[3 * k + 2])
        assert rc != 0, f"{name} command {k} did not stop:\n{before[-4000:]}"
        assert squeeze(message) in squeeze(before), \
            f"{name} command {k} did not stop at `{message}`:\n{before[-4000:]}"
        assert "ModuleNotFoundError" not in before, before[-4000:]


def test_trainer_subcommands_the_readme_names_exist():
    """Every `specforge X` / `speculators X` line of any block names a subcommand that
    exists (the commands with placeholders cannot run as they are): those the marked
    CPU blocks run are checked by running them (above), any other by `X --help` exiting 0."""
    def subcommands(blocks):
        return {tuple(line.split()[:2]) for block in blocks for line in block.splitlines()
                if len(line.split()) >= 2 and line.split()[0] in ("specforge", "speculators")}

    named = subcommands(b for text in BLOCKS["texts"].values() for b in FENCED.findall(text))
    run = subcommands(BLOCKS["recipe"] + list(BLOCKS["trainers"].values()))
    assert {("speculators", "prepare-data"), ("speculators", "train"), ("specforge", "train")} <= run
    assert ("speculators", "prepare-data") in named
    for prog, sub in sorted(named - run):
        res = subprocess.run([os.path.join(REPO, ".venv", "bin", prog), sub, "--help"], capture_output=True,
                             text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
        assert res.returncode == 0, f"`{prog} {sub} --help` exited {res.returncode}:\n{(res.stdout + res.stderr)[-3000:]}"


def test_every_command_block_says_how_it_is_run():
    assert not BLOCKS["unmarked"], "blocks with no marker comment above them (see this file's docstring): " + \
        ", ".join(BLOCKS["unmarked"])
    assert BLOCKS["demo"] and BLOCKS["deployment"] and len(BLOCKS["snippets"]) == 2


@pytest.mark.parametrize("block", BLOCKS["demo"])
def test_the_demo_runs_as_written_and_passes(block):
    assert block.startswith(SETUP) and block.count("\n") == 1, block
    command = block[len(SETUP):].strip()
    out = tempfile.mkdtemp(prefix="hscap-demo-")
    tmp = tempfile.mkdtemp(prefix="hscap-demo-tmp-")
    try:
        assert " --out out/demo" in command
        res = run_script(command.replace(" --out out/demo", f" --out {out}/demo"), clean_env(out, free_port(), tmp),
                         timeout=900)
        assert res.returncode == 0, res.stdout[-6000:]
        assert res.stdout.rstrip().splitlines()[-1].startswith("PASS"), res.stdout[-4000:]
    finally:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


def shell_commands(block: str) -> list:
    """Each simple command of a bash block as its words: continuation lines joined, comments
    dropped, split at `;`, `&&`, `|`, `&`, `$(`...`)`, leading VAR=value words dropped."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        words = []
        for token in list(lex) + [";"]:
            if token and set(token) <= set("();<>|&"):
                while words and re.match(r"^\w+=", words[0]):
                    words.pop(0)
                if words:
                    commands.append(words)
                words = []
            else:
                words.append(token)
    return commands


def sglang_arguments(words: list, parsed: dict):
    """The SGLang argument list a command hands to the server (`hscap serve|doctor`'s as
    hscap's own CLI parsed them), or None."""
    if words[0] == "hscap" and "sglang_args" in parsed:
        return [a for a in parsed["sglang_args"] if a != "--"]
    if words[:3] == ["python", "-m", "sglang.launch_server"]:
        return words[3:]
    return None


def hscap_parse(words: list, monkeypatch) -> tuple:
    """(why hscap's own CLI would refuse these words, or ''; the parameters it parsed). Paths
    need not exist here."""
    from hs_capture.cli import main

    ctx = click.Context(main, info_name="hscap")
    command = main.get_command(ctx, words[1]) if len(words) > 1 else None
    if command is None:
        return f"no such command: {' '.join(words[:2])}", {}
    for param in command.params:
        if isinstance(param.type, click.Path):
            monkeypatch.setattr(param.type, "exists", False)
    try:
        return "", command.make_context(words[1], list(words[2:]), parent=ctx).params
    except click.exceptions.Exit:
        return "", {}
    except click.ClickException as e:
        return f"{' '.join(words)}: {e.format_message()}", {}


SGLANG_PARSE = """
import argparse, contextlib, io, json, sys
from sglang.srt.server_args import ServerArgs
said = []
for args in json.loads(sys.stdin.read()):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(args)
        said.append("")
    except SystemExit:
        said.append(" ".join(args) + ": " + err.getvalue().strip().splitlines()[-1])
print(json.dumps(said))
"""


def deployment_commands(block: str, monkeypatch) -> tuple:
    """(what hscap's own CLI says of each command of a deployment block, '' where it parses;
    the SGLang argument lists the block hands to the server)."""
    problems, server_args = [], []
    for words in shell_commands(block):
        problem, parsed = hscap_parse(words, monkeypatch) if words[0] == "hscap" else ("", {})
        problems.append(problem)
        args = sglang_arguments(words, parsed)
        if args is not None:
            server_args.append(args)
    return problems, server_args


@pytest.fixture(scope="module")
def sglang_parsed():
    """What SGLang's own parser says of every argument list of every deployment block ('' where
    it parses), keyed by the list as JSON: one interpreter for all of them, as importing
    SGLang's server arguments takes ~10 s on this CPU and each list gets a parser of its own."""
    lists = []
    with pytest.MonkeyPatch.context() as mp:
        for _, block in BLOCKS["deployment"]:
            lists += [args for args in deployment_commands(block, mp)[1] if args not in lists]
    if not lists:
        return {}
    res = subprocess.run([sys.executable, "-c", SGLANG_PARSE], input=json.dumps(lists), capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    said = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(said) == len(lists), res.stdout[-3000:]
    return {json.dumps(args): s for args, s in zip(lists, said)}


@pytest.mark.parametrize("where,block", BLOCKS["deployment"], ids=[w for w, _ in BLOCKS["deployment"]])
def test_deployment_block_parses(where, block, monkeypatch, sglang_parsed):
    problems, server_args = deployment_commands(block, monkeypatch)
    problems += [sglang_parsed[json.dumps(args)] for args in server_args]
    problems = [p for p in problems if p]
    assert not problems, f"{where}:\n" + "\n".join(problems)
    pytest.skip(f"{where}: a GPU deployment's paths and models; its hscap commands and SGLang arguments parse, "
                "not run here")
