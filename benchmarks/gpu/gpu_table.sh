#!/usr/bin/env bash
# The table of benchmarks/reports/gpu-h200.md, "GPU checks and GPU runs", in one call on a CUDA machine: gpu_check.py beside
# healing on the GPU, then batch-1 decoding (eager with each experts kernel, compiled by generate with CUDA graphs)
# and the MoE layer against Mixtral's. Each step runs under a time limit and none starts after DEADLINE seconds
# (default 540), so that a short lease still brings back what finished. Logs go to OUT_DIR (default gpu-results).
#
#   bash benchmarks/gpu/gpu_table.sh [OUT_DIR]
#
# Needs the built-in model in the cache; without network, see benchmarks/gpu/random_default_model.py.
set -u
cd "$(dirname "$0")/../.."
OUT_DIR=${1:-gpu-results}
DEADLINE=${DEADLINE:-540}
PY=${PYTHON:-python3}  # some GPU images have python3 and no python
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=5 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
LOG=$OUT_DIR/log.txt
$PY -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__, \
'|', torch.cuda.get_device_name())" >> "$LOG" 2>&1 || exit 1

step() {  # name limit command...: appends the command's output to OUT_DIR/name.txt and one line to the log
  local name=$1 limit=$2 left=$((DEADLINE - SECONDS))
  shift 2
  if [ "$left" -lt 25 ]; then echo "SKIP $name (deadline)" >> "$LOG"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local start=$SECONDS
  timeout "$limit" "$@" >> "$OUT_DIR/$name.txt" 2>&1
  echo "STEP $name rc=$? $((SECONDS - start))s: $*" >> "$LOG"
}

step gpu_check 200 $PY benchmarks/gpu/gpu_check.py &
HEALED=$(mktemp -d)/healed
step heal 170 $PY -m llama_moe convert --method random --num-experts 8 --top-k 2 --heal-tokens 32768 --no-eval \
  --output "$HEALED"
$PY -c "import json, sys; print(json.load(open(sys.argv[1]))['conversion_info']['healing'])" "$HEALED/config.json" \
  >> "$OUT_DIR/heal.txt" 2>&1
rm -rf "$(dirname "$HEALED")"
wait
DECODE=($PY benchmarks/speed/bench_decode.py --device cuda --dtype bfloat16 --processes 1 --threads 8)
step decode 90 "${DECODE[@]}" --rounds 3 --new-tokens 48 --top-k 2 4 6
step decode_grouped_mm 60 "${DECODE[@]}" --rounds 3 --new-tokens 48 --top-k 2 --experts-implementation grouped_mm
step moe_layer 60 $PY benchmarks/speed/bench_moe_layer.py --device cuda --dtype bfloat16 --repeats 50 --threads 8
step decode_compiled 200 "${DECODE[@]}" --rounds 2 --new-tokens 32 --top-k 2 --compile --compile-mode reduce-overhead
echo "done at ${SECONDS}s" >> "$LOG"
cat "$LOG"
