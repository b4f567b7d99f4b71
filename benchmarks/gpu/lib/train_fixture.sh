#!/usr/bin/env bash
# The fixture benchmarks/gpu/train_from_dump.py trains from, made with the REAL SGLang on this
# CPU (the test venv, bin/setup_env.sh): a tiny random DeepSeek-V3 stored in bfloat16 (what the
# server computes in), 48 samples captured in bfloat16 with layers 2,3,5 and the pre-norm state,
# sent as data.jsonl and again as speculators' own prepared dataset (sp/, rows "0".."47").
#   bash benchmarks/gpu/lib/train_fixture.sh OUT_DIR
set -euo pipefail
W=$(realpath -m "${1:?usage: train_fixture.sh OUT_DIR}"); PORT=${PORT:-30123}
cd "$(dirname "$0")/../../.."
source .venv/bin/activate
rm -rf "$W"; mkdir -p "$W"
python bin/tiny_model.py "$W/model" --data "$W/data.jsonl" --samples 48
python - "$W/model" <<'PY'
import json, os, sys
import torch
from safetensors.torch import load_file, save_file
d = sys.argv[1]
w = load_file(os.path.join(d, "model.safetensors"))
save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in w.items()},
          os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
cfg = json.load(open(os.path.join(d, "config.json")))
cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=1)
os.remove(os.path.join(d, "model.safetensors.index.json"))
PY
python -c "import sys; sys.path.insert(0, 'bin'); import tiny_model; tiny_model.add_checkpoint_files('$W/model')"
PYTHONPATH=tests/sglang_cpu/shims TORCHDYNAMO_DISABLE=1 \
hscap serve -d "$W/dump" --layers 2,3,5 --prenorm -- --model-path "$W/model" --dtype bfloat16 \
    --device cpu --attention-backend torch_native --sampling-backend pytorch --grammar-backend none \
    --skip-tokenizer-init --max-total-tokens 8192 --context-length 4096 --mem-fraction-static 0.05 \
    --chunked-prefill-size 128 --host 127.0.0.1 --port "$PORT" > "$W/server.log" 2>&1 &
SERVER=$!
speculators prepare-data --model "$W/model" --data "$W/data.jsonl" --output "$W/sp" > "$W/prepare.log" 2>&1
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do kill -0 $SERVER || exit 1; sleep 2; done
hscap send "$W/data.jsonl" --url "http://127.0.0.1:$PORT" -c 4
hscap send "$W/sp" --url "http://127.0.0.1:$PORT" -c 4
kill $SERVER; wait $SERVER || true
hscap verify "$W/dump" --dataset "$W/data.jsonl" | tail -1
