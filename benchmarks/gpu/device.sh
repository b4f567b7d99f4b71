#!/usr/bin/env bash
# The GPU benchmarks on a machine with an NVIDIA GPU and no internet access, run from the root
# of a copy of this checkout that holds the bundle bin/gpu_bundle.sh built (.gpu-bundle). The
# machine's python3 has torch, triton and transformers (see bin/gpu_bundle.sh); everything is
# staged under $HSCAP_GPU_ROOT (default /root/hscap-gpu). benchmarks/README.md has the figures.
#   bash benchmarks/gpu/device.sh stage
#            unpacks chunk 2 (.gpu-bundle/b2) and makes the model and datasets in the background
#            (benchmarks/gpu/model.py; log in $HSCAP_GPU_ROOT/stage.log); returns at once
#   bash benchmarks/gpu/device.sh run [benchmarks/gpu/server.py options]
#            unpacks chunk 1 (.gpu-bundle/b1), waits up to 5 min for staging, runs server.py
# The offline benchmarks (no sglang) need only hs_capture's own wheels (.gpu-bundle/b3):
#   bash benchmarks/gpu/device.sh offline python3 benchmarks/...
# The trainers (SpecForge, speculators) also need their wheels (.gpu-bundle/b4, bin/gpu_bundle.sh):
# pip installs, without deps or an index, each wheel whose distribution the machine lacks
#   bash benchmarks/gpu/device.sh trainers python3 benchmarks/gpu/train_from_dump.py ...
set -euo pipefail
ROOT=${HSCAP_GPU_ROOT:-/root/hscap-gpu}
SITE=$ROOT/site
cmd=${1:-}
shift || true
case "$cmd" in
stage)
  mkdir -p "$ROOT/bundle" "$SITE"
  cp .gpu-bundle/b2/cutlass_ir.tar.xz "$ROOT/bundle/"
  cp benchmarks/gpu/model.py "$ROOT/model.py"
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
  if [ ! -e "$ROOT/b1.done" ]; then
    xz -dc .gpu-bundle/b1/site.tar.xz | tar x -C "$SITE" && touch "$ROOT/b1.done"
  fi
  for i in $(seq 300); do
    [ -e "$ROOT/b2.done" ] && [ -e "$ROOT/model.done" ] && break
    sleep 1
  done
  cat "$ROOT/stage.log"
  [ -e "$ROOT/b2.done" ] && [ -e "$ROOT/model.done" ] || { echo "staging did not finish" >&2; exit 3; }
  export PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/python_packages:$PWD" PYTHONUNBUFFERED=1
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 NCCL_NVLS_ENABLE=0
  export TRITON_CACHE_DIR=$ROOT/cache/triton TVM_FFI_CACHE_DIR=$ROOT/cache/tvm FLASHINFER_WORKSPACE_BASE=$ROOT/cache
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
  python3 - .gpu-bundle/b3/*.whl .gpu-bundle/b4/*.whl <<'PY'
import importlib.metadata as md, os, subprocess, sys
missing = []
for w in sys.argv[1:]:
    dist = os.path.basename(w).split("-")[0]
    try:
        md.version(dist)
    except md.PackageNotFoundError:
        missing.append(w)
print("installing", len(missing), "wheels:", " ".join(os.path.basename(w).split("-")[0] for w in missing))
if missing:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", *missing], check=True)
PY
  export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
  "$@"
  ;;
*)
  echo "usage: $0 stage | run [server.py options] | offline COMMAND... | trainers COMMAND..." >&2; exit 2
  ;;
esac
