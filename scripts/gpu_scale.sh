#!/usr/bin/env bash
# [scale-out] 33 on one multi-GPU machine (2 or 4 GPUs), one device call each stage (≤ 10 min). From the repo root:
#
#   STAGE=dp bash scripts/gpu_scale.sh    # --preset gpu-125m: 1 GPU, then DDP and FSDP2 on 2 and on 4 GPUs
#   STAGE=cp bash scripts/gpu_scale.sh    # context parallelism: the bf16 check against one GPU, then
#                                         # T = 131,072 on 1 GPU vs --context-parallel 4, and T = 1,048,576 on 4
#
# Every run is the user's command (`torchrun --standalone --nproc_per_node N -m fastweights.cli train ...`, or
# plain `python -m fastweights.cli train` on one GPU) on random byte documents (ids 0–255, an end-of-text every
# ~4k tokens, written to a .bin token file first: the machine has no network). Each run's log.jsonl and a
# summary line (scripts/scale_summary.py: the steady tokens/s, leaving out the first 3 steps) go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu}"
mkdir -p "$OUT" runs/scale
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" TRITON_CACHE_DIR="$PWD/runs/cache/triton"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # (the machine's rule)
G=$(nvidia-smi -L | wc -l)
STEPS="${STEPS:-16}"
python3 -c "import torch, triton; print(torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(), \
torch.cuda.device_count(), 'GPUs')" | tee -a "$OUT/env.txt"
git rev-parse --short HEAD >> "$OUT/env.txt" 2>/dev/null
DATA=runs/scale/bytes.bin
[ -f $DATA ] || python3 - <<'PY'
import numpy as np
rng = np.random.default_rng(0)
x = rng.integers(0, 256, size=1 << 26, dtype=np.uint16)
x[rng.random(x.size) < 1 / 4096] = 256  # end-of-text: documents of ~4k tokens
x.tofile("runs/scale/bytes.bin")
PY
COMMON=(--data $DATA --val-every 100000 --save-every 100000 --log-every 1 --progress plain --val-fraction 0.001)
run() {  # run NAME GPUS NPROC ARGS...: one training run on the listed GPUs
  local name=$1 gpus=$2 n=$3; shift 3
  local launch=(python3 -m fastweights.cli)
  [ "$n" -gt 1 ] && launch=(python3 -m torch.distributed.run --standalone --nproc_per_node "$n" -m fastweights.cli)
  rm -rf "runs/scale/$name"
  echo "== $name: CUDA_VISIBLE_DEVICES=$gpus ${launch[*]} train $*" | tee -a "$OUT/commands.txt"
  CUDA_VISIBLE_DEVICES=$gpus timeout "${TIMEOUT:-240}" "${launch[@]}" train "${COMMON[@]}" --out "runs/scale/$name" \
      "$@" > "$OUT/$name.log" 2>&1
  echo "   $name: exit $?" | tee -a "$OUT/commands.txt"
  cp "runs/scale/$name/log.jsonl" "$OUT/$name.jsonl" 2>/dev/null
  python3 scripts/scale_summary.py --skip 3 "runs/scale/$name" | tee -a "$OUT/summary.jsonl"
  tail -3 "$OUT/$name.log"
}
case "${STAGE:-dp}" in
dp)
  P=(--preset gpu-125m --steps "$STEPS")
  # the preset's global batch (64 × 2048) on every layout; its micro-batch (8 sequences) kept by accumulating
  # 8 / N micro-batches on N GPUs; one run at a time (two runs side by side perturbed each other's times).
  # gpu1 --no-cuda-graph: the preset graphs one process's steps by default (cuda_graph "auto") and runs DDP/FSDP
  # eagerly, so the 1-GPU baseline is kept eager — the scaling figures compare like with like, as before.
  run gpu1 0 1 "${P[@]}" --grad-accum 8 --no-cuda-graph & run ddp2 2,3 2 "${P[@]}" --grad-accum 4 --parallel ddp; wait
  run fsdp2 0,1 2 "${P[@]}" --grad-accum 4 --parallel fsdp
  if [ "$G" -ge 4 ]; then
    run ddp4 0,1,2,3 4 "${P[@]}" --grad-accum 2 --parallel ddp
    run fsdp4 0,1,2,3 4 "${P[@]}" --grad-accum 2 --parallel fsdp
  fi
  ;;
cp)
  # correctness first: bf16 spans on 2 GPUs against one GPU's whole sequence (an LM at the preset's head shape)
  CUDA_VISIBLE_DEVICES=0,1 timeout 180 python3 -m torch.distributed.run --standalone --nproc_per_node 2 \
      scripts/gpu_cp_check.py > "$OUT/cp_check.log" 2>&1; echo "cp_check: exit $?"; tail -12 "$OUT/cp_check.log"
  N=$(( G >= 4 ? 4 : G ))
  ALL=$(seq -s, 0 $(( N - 1 )))
  M=(--preset gpu-125m --steps "${CP_STEPS:-6}")
  # T = 131,072, 4 sequences a step (524,288 tokens), one sequence a micro-batch, per-block checkpointing on
  # both (one GPU holds 131k tokens' activations only so): one GPU, then N ranks holding a span each
  run cp_t131k_gpu1 0 1 "${M[@]}" --seq-len 131072 --batch-size 4 --grad-accum 4 --grad-checkpoint
  run cp_t131k_cp$N "$ALL" "$N" "${M[@]}" --seq-len 131072 --batch-size 4 --grad-accum 4 --context-parallel "$N" \
      --grad-checkpoint
  # the same 4 sequences with each rank's whole span in one micro-batch (131,072 tokens a rank, as one GPU's)
  run cp_t131k_cp${N}_acc1 "$ALL" "$N" "${M[@]}" --seq-len 131072 --batch-size 4 --grad-accum 1 \
      --context-parallel "$N" --grad-checkpoint
  [ -n "${CP_SHORT:-}" ] && { echo "== summary"; cat "$OUT/summary.jsonl"; exit 0; }
  # T = 1,048,576 (one sequence a step): N ranks, then one GPU (expected: out of memory)
  run cp_t1m_cp$N "$ALL" "$N" "${M[@]}" --seq-len 1048576 --batch-size 1 --grad-accum 1 --context-parallel "$N" \
      --grad-checkpoint
  TIMEOUT=120 run cp_t1m_gpu1 0 1 "${M[@]}" --seq-len 1048576 --batch-size 1 --grad-accum 1 --grad-checkpoint
  grep -h -i -m1 "out of memory" "$OUT/cp_t1m_gpu1.log" || true
  ;;
esac
echo "== summary"; cat "$OUT/summary.jsonl"
