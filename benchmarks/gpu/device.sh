#!/usr/bin/env bash
# The GPU benchmarks on a machine with an NVIDIA GPU and no internet access, run from the root
# of a copy of this checkout that holds the bundle bin/gpu_bundle.sh built (.gpu-bundle). The
# machine's python3 has torch, triton and transformers (see bin/gpu_bundle.sh); everything is
# staged under $HSCAP_GPU_ROOT (default /root/hscap-gpu). benchmarks/README.md has the figures.
#   bash benchmarks/gpu/device.sh stage
#            unpacks chunk 2 (.gpu-bundle/b2) and makes the model and datasets in the background
#            (benchmarks/gpu/lib/model.py; log in $HSCAP_GPU_ROOT/stage.log); returns at once
#   bash benchmarks/gpu/device.sh run [benchmarks/gpu/server.py options]
#            unpacks chunk 1 (.gpu-bundle/b1), waits up to 5 min for staging, runs server.py
# The offline benchmarks (no sglang) need only hs_capture's own wheels (.gpu-bundle/b3):
#   bash benchmarks/gpu/device.sh offline python3 benchmarks/...
# The trainers (SpecForge, speculators) also need their wheels (.gpu-bundle/b4, bin/gpu_bundle.sh):
# pip installs, without deps or an index, each wheel whose distribution the machine lacks
#   bash benchmarks/gpu/device.sh trainers python3 benchmarks/gpu/train_from_dump.py ...
# Capture -> train -> serve (benchmarks/gpu/purpose.py), in the background, each call waiting
# up to WAIT seconds (default 540) and copying the results and logs to $RESULTS (default $ROOT/results):
#   bash benchmarks/gpu/device.sh purpose-stage     unpacks chunk 2, installs the trainers (b3, b4),
#                                                  trains the target in the background; returns at once
#   bash benchmarks/gpu/device.sh purpose [purpose.py options]
#                                                  unpacks chunk 1, (re)starts purpose.py, waits
#   bash benchmarks/gpu/device.sh purpose-wait      waits for the run in progress
# Capture on/off across the state rate (benchmarks/gpu/rate_sweep.py), the same way:
#   bash benchmarks/gpu/device.sh sweep-stage       unpacks chunk 2, makes the model and data; returns at once
#   bash benchmarks/gpu/device.sh sweep [options]   unpacks chunk 1, (re)starts rate_sweep.py, waits
#   bash benchmarks/gpu/device.sh sweep-wait        waits for the run in progress
set -euo pipefail
ROOT=${HSCAP_GPU_ROOT:-/root/hscap-gpu}
SITE=$ROOT/site
cmd=${1:-}
shift || true
# what every SGLang server here runs with (no hub, NVLink multicast off, caches kept across calls)
SERVER_ENV="PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 NCCL_NVLS_ENABLE=0 \
  TRITON_CACHE_DIR=$ROOT/cache/triton TVM_FFI_CACHE_DIR=$ROOT/cache/tvm FLASHINFER_WORKSPACE_BASE=$ROOT/cache"
PURPOSE_ENV="PYTHONPATH=. $SERVER_ENV"  # purpose.py puts the bundle on its servers' path itself

# hs_capture's wheels (b3) and the trainers' (b4) that the machine lacks, without deps or an index
install_trainers() {
  python3 - .gpu-bundle/b3/*.whl .gpu-bundle/b4/*.whl <<'PY'
import importlib.metadata as md, os, subprocess, sys
missing = []
for w in sys.argv[1:]:
    if not os.path.exists(w):
        continue
    dist = os.path.basename(w).split("-")[0]
    try:
        md.version(dist)
    except md.PackageNotFoundError:
        missing.append(w)
print("installing", len(missing), "wheels:", " ".join(os.path.basename(w).split("-")[0] for w in missing))
if missing:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", *missing], check=True)
PY
}

# the checkout as it is now, outside the working tree a later copy replaces
copy_repo() {
  rm -rf "$ROOT/repo.new" && mkdir -p "$ROOT/repo.new"
  tar cf - --exclude=./.gpu-bundle --exclude=./.git --exclude=./.venv . | tar xf - -C "$ROOT/repo.new"
  rm -rf "$ROOT/repo" && mv "$ROOT/repo.new" "$ROOT/repo"
}

# chunk 1 unpacked (once), then up to $2 seconds for chunk 2 and the background job's done-file $1
unpack_and_wait() {
  if [ ! -e "$ROOT/b1.done" ]; then
    xz -dc .gpu-bundle/b1/site.tar.xz | tar x -C "$SITE" && touch "$ROOT/b1.done"
  fi
  for i in $(seq "$2"); do
    [ -e "$ROOT/b2.done" ] && [ -e "$ROOT/$1" ] && break
    sleep 1
  done
  tail -40 "$ROOT/stage.log"
  [ -e "$ROOT/b2.done" ] && [ -e "$ROOT/$1" ] || { echo "staging did not finish" >&2; exit 3; }
  if [ ! -e "$ROOT/pyc.done" ]; then
    # the bundle ships no bytecode: compiled once on every core, not by each server's first import
    t0=$(date +%s); python3 -m compileall -q -j 0 "$SITE" > /dev/null 2>&1 || true
    echo "compiled the bundle's bytecode in $(( $(date +%s) - t0 )) s"; touch "$ROOT/pyc.done"
  fi
}

# a benchmark NAME in the background, in a copy of the checkout: stops the one in progress first
start_bg() {
  local name=$1; shift
  if [ -e "$ROOT/$name.pid" ] && [ ! -e "$ROOT/$name.done" ]; then
    kill -TERM -- -"$(cat "$ROOT/$name.pid")" 2>/dev/null || true
    for i in $(seq 60); do [ -e "$ROOT/$name.done" ] && break; sleep 1; done
  fi
  rm -f "$ROOT/$name.done"
  copy_repo
  setsid nohup bash -c "cd '$ROOT/repo' && echo \$\$ > '$ROOT/$name.pid' && $PURPOSE_ENV $* ; \
    echo \$? > '$ROOT/$name.done'" > "$ROOT/$name.log" 2>&1 < /dev/null &
  sleep 2
}

# the machine part of a results file's name (benchmarks/README.md): the GPU's model, e.g. h100
machine() {
  local m
  m=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE '\b[a-z][0-9]{2,3}\b' | head -1)
  echo "${m,,}" | grep . || echo gpu
}

# up to WAIT seconds for benchmark NAME (of SCRIPT.py); its results ($ROOT/NAME.results.json, as
# SCRIPT.MACHINE.results.json) and logs go to $RESULTS either way
wait_bg() {
  local name=$1 script=${2:-$1} out=${RESULTS:-$ROOT/results}
  for i in $(seq "${WAIT:-540}"); do
    [ -e "$ROOT/$name.done" ] && break
    sleep 1
  done
  tail -40 "$ROOT/$name.log"
  mkdir -p "$out"
  cp "$ROOT/$name.results.json" "$out/$script.$(machine).results.json" 2>/dev/null || true
  (cd "$ROOT" && tar czf "$out/logs.tar.gz" out "$name.log" stage.log 2>/dev/null) || true
  [ -e "$ROOT/$name.done" ] && echo "$name finished (exit $(cat "$ROOT/$name.done"))" || echo "$name still running"
}

case "$cmd" in
stage)
  mkdir -p "$ROOT/bundle" "$SITE"
  cp .gpu-bundle/b2/cutlass_ir.tar.xz "$ROOT/bundle/"
  cp benchmarks/gpu/lib/model.py "$ROOT/model.py"
  rm -f "$ROOT"/*.done
  setsid nohup bash -c "
    (xz -dc '$ROOT/bundle/cutlass_ir.tar.xz' | tar x -C '$SITE' && touch '$ROOT/b2.done') &
    python3 '$ROOT/model.py' '$ROOT/model' '$ROOT/data' ${HSCAP_GPU_TIMED:+--timed $HSCAP_GPU_TIMED} && touch '$ROOT/model.done'
    wait" > "$ROOT/stage.log" 2>&1 < /dev/null &
  echo "staging in the background: $ROOT/stage.log"
  ;;
run)
  if [ ! -e "$ROOT/stage.log" ]; then
    echo "nothing staged under $ROOT: run 'bash benchmarks/gpu/device.sh stage' first" >&2; exit 3
  fi
  unpack_and_wait model.done 300
  export PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/python_packages:$PWD" $SERVER_ENV
  python3 benchmarks/gpu/server.py --root "$ROOT" "$@"
  ;;
offline)
  mkdir -p "$ROOT/offline"
  for w in .gpu-bundle/b3/*.whl; do
    case "$w" in *numpy-*) python3 -c "import numpy" 2>/dev/null && continue;; esac
    python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$w" "$ROOT/offline"
  done
  export PYTHONPATH="$ROOT/offline:$PWD" PYTHONUNBUFFERED=1
  "$@"
  ;;
trainers)
  install_trainers
  export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
  "$@"
  ;;
purpose-stage)
  mkdir -p "$ROOT/bundle" "$SITE" "$ROOT/out"
  cp .gpu-bundle/b2/cutlass_ir.tar.xz "$ROOT/bundle/"
  rm -f "$ROOT"/*.done
  install_trainers
  copy_repo
  setsid nohup bash -c "
    (xz -dc '$ROOT/bundle/cutlass_ir.tar.xz' | tar x -C '$SITE' && touch '$ROOT/b2.done') &
    cd '$ROOT/repo' && $PURPOSE_ENV python3 benchmarks/gpu/purpose.py --root '$ROOT' --out '$ROOT/purpose.results.json' \
      --steps target ${PURPOSE_TARGET_ARGS:-} && touch '$ROOT/target.done'
    wait" > "$ROOT/stage.log" 2>&1 < /dev/null &
  echo "staging and training the target in the background: $ROOT/stage.log"
  ;;
purpose)
  [ -e "$ROOT/stage.log" ] || { echo "nothing staged under $ROOT: run 'device.sh purpose-stage' first" >&2; exit 3; }
  unpack_and_wait target.done 300
  start_bg purpose python3 benchmarks/gpu/purpose.py --root "$ROOT" --site "$SITE" --out "$ROOT/purpose.results.json" \
    --out-dir "$ROOT/out" ${*:+$(printf '%q ' "$@")}
  wait_bg purpose
  ;;
purpose-wait)
  wait_bg purpose
  ;;
sweep-stage)
  mkdir -p "$ROOT/bundle" "$SITE" "$ROOT/out"
  cp .gpu-bundle/b2/cutlass_ir.tar.xz "$ROOT/bundle/"
  rm -f "$ROOT"/*.done
  copy_repo
  setsid nohup bash -c "
    (xz -dc '$ROOT/bundle/cutlass_ir.tar.xz' | tar x -C '$SITE' && touch '$ROOT/b2.done') &
    cd '$ROOT/repo' && $PURPOSE_ENV python3 benchmarks/gpu/rate_sweep.py --root '$ROOT' --out /dev/null --stage-only \
      && touch '$ROOT/model.done'
    wait" > "$ROOT/stage.log" 2>&1 < /dev/null &
  echo "staging the sweep's model and data in the background: $ROOT/stage.log"
  ;;
sweep)
  [ -e "$ROOT/stage.log" ] || { echo "nothing staged under $ROOT: run 'device.sh sweep-stage' first" >&2; exit 3; }
  unpack_and_wait model.done 300
  start_bg sweep env PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/python_packages:." python3 benchmarks/gpu/rate_sweep.py \
    --root "$ROOT" --out "$ROOT/sweep.results.json" --logs "$ROOT/out" ${*:+$(printf '%q ' "$@")}
  wait_bg sweep rate_sweep
  ;;
sweep-wait)
  wait_bg sweep rate_sweep
  ;;
*)
  echo "usage: $0 stage | run [server.py options] | offline COMMAND... | trainers COMMAND... | purpose-stage | purpose [options] | purpose-wait | sweep-stage | sweep [rate_sweep.py options] | sweep-wait" >&2; exit 2
  ;;
esac
