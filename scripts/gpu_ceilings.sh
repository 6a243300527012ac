#!/usr/bin/env bash
# The ceilings sweep on every GPU of one machine (issue 24), one device call (≤ 10 min): resumable, run it again
# on the next call after committing $OUT/mqar_ceilings.jsonl to docs/results/. From the repository root:
#
#   bash scripts/gpu_ceilings.sh [seconds]
#
# 1. The graphed path's own cuda tests (tests/cuda/test_graph_train.py) on GPU 0; while they run, the last GPU
#    starts ATLAS's cells (eager: its step is bound by its Newton–Schulz FLOPs, graphs do not help it).
# 2. If the tests pass, the other models' cells with CUDA-graphed steps (`--cuda-graph`), else eager: one
#    `fastweights mqar` process per GPU (3 workers each) on the same records file — the cells' locks beside it
#    give each cell to one process, so no cell is trained twice.
# Every process stops by SIGINT before the budget ends: finished cells are in the records, a running one is saved
# under runs/ceilings (kept only on this machine).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu}"
mkdir -p "$OUT"
budget="${1:-570}"
t0=$(date +%s)
left() { local l=$(( budget - ($(date +%s) - t0) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR="$PWD/runs/cache/triton"
FW="python3 -m fastweights.cli"
REC=docs/results/mqar_ceilings.jsonl
MODELS="${MODELS:-softmax_attention linear_attention retnet mamba2 gla deltanet gated_deltanet comba deltaproduct \
kda ttt_linear ttt_mlp titans mesanet omeganet fox alibi deltaformer path_attention}"
ATLAS_LRS="${ATLAS_LRS:-0.003}"  # ATLAS's pilot was not run (its cells cost what a sweep cell does): one lr, said so
G=$(nvidia-smi -L | wc -l)
python3 -c "import torch, triton; print(torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), \
torch.cuda.device_count(), 'GPUs')" | tee "$OUT/env.txt"
git rev-parse --short HEAD >> "$OUT/env.txt" 2>/dev/null
sweep() {  # sweep GPU LOG ARGS...: one process on one GPU until the budget's end
  local gpu=$1 log=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu timeout -s INT "$(( $(left) - 20 ))" $FW mqar --preset ceilings --device cuda \
      --dtype bfloat16 --records $REC --out runs/ceilings --progress plain "$@" > "$OUT/$log" 2>&1
}
last=$(( G - 1 ))
sweep $last atlas.log --models atlas --lrs $ATLAS_LRS --workers 2 &
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m pytest -v -p no:benchmark -p no:cacheprovider -m cuda \
    tests/cuda/test_graph_train.py > "$OUT/graph_tests.log" 2>&1
rc=$?
tail -3 "$OUT/graph_tests.log"
GRAPH=--no-cuda-graph
[ $rc -eq 0 ] && GRAPH=--cuda-graph
echo "graph tests rc $rc: $GRAPH" | tee -a "$OUT/env.txt"
n=$(( G > 1 ? G - 1 : 1 ))
for (( g = 0; g < n; g++ )); do
  sweep $g "sweep_g$g.log" --models $MODELS --workers 3 $GRAPH &
done
wait
grep -hE "^\[|interrupted|Error|error" "$OUT"/sweep_g*.log "$OUT/atlas.log" | tail -60
cp $REC "$OUT/"
grep -c . "$OUT/mqar_ceilings.jsonl"
