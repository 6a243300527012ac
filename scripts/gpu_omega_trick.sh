#!/usr/bin/env bash
# Issue 36: OmegaNet by the kernel trick (chunkwise/omega.py) on one GPU, one device call (≤ 10 min). From the repo root:
#
#   OUT=... bash scripts/gpu_omega_trick.sh              # everything (typically 5–8 min)
#   OUT=... STAGE=small bash scripts/gpu_omega_trick.sh  # 1 and 2 only;  STAGE=lm: 3 only (if one call is too long)
#
# 1. the op table at the small shape (B 64, T 512, H 2, D 64, bf16): gated DeltaNet against OmegaNet (the goal ≤ 5×);
# 2. OmegaNet's fwd+bwd step there by `minibatch_memory.py --time`, the kernel trick's form (on) and the mini-batch
#    form on expanded features (off, the r4s13 figure's form), each with its top kernels (--profile); on also with
#    torch's fp32 products on TF32 (--matmul-tf32: o's and the gradients' error against the fp32 row); then the
#    Triton feature kernels' tests (-m triton) and the step with the kernel trick's K'-wide products by them
#    (--feature-kernels);
# 3. the fwd+bwd peak at the LM shape (B 4, T 4096, H 16, D 128, bf16): on (goal ≤ 80 GB), and on with
#    `minibatch.checkpoint_chain(16)`; then the LM shape's op table row.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" TRITON_CACHE_DIR="$PWD/runs/cache/triton"
python3 -c "import torch, triton; print(torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  | tee -a "$OUT/env.txt"
git rev-parse --short HEAD >> "$OUT/env.txt" 2>/dev/null
STAGE="${STAGE:-all}"
if [ "$STAGE" != lm ]; then
timeout 150 python3 -m fastweights bench speed --models gated_deltanet omeganet --forms chunk --lengths 512 --batch 64 \
  --heads 2 --dim 64 --dtype bfloat16 --device cuda --repeats 3 --warmup 1 --no-peers --keep-going \
  --out "$OUT/speed_small" 2>&1 | tail -20 | tee "$OUT/speed_small.txt"
for kt in on off; do  # on: also once more with every fp32 product on TF32 (--matmul-tf32; its error against fp32)
  timeout 120 python3 scripts/minibatch_memory.py --time --models omeganet --shape 64 512 2 --D 64 --dtype bfloat16 \
    --repeats 5 --profile --kernel-trick $kt $([ $kt = on ] && echo --matmul-tf32) --out "$OUT/time_$kt" 2>&1 \
    | tail -5 | tee "$OUT/time_$kt.txt"
done
# the kernel trick's K'-wide products by the Triton kernels (φ in registers; untested on a GPU before this call)
timeout 120 python3 -m pytest -x -q -p no:randomly -m triton tests/kernels/memories/test_triton_omega_features.py \
  2>&1 | tail -5 | tee "$OUT/feature_kernels_tests.txt"
timeout 120 python3 scripts/minibatch_memory.py --time --models omeganet --shape 64 512 2 --D 64 --dtype bfloat16 \
  --repeats 5 --profile --feature-kernels --out "$OUT/time_kernels" 2>&1 | tail -5 | tee "$OUT/time_kernels.txt"
fi
[ "$STAGE" = small ] && exit 0
timeout 120 python3 scripts/minibatch_memory.py --models omeganet --D 128 --peak --device cuda --shape 4 4096 16 \
  --dtype bfloat16 --out "$OUT/lm_peak" 2>&1 | tail -5 | tee "$OUT/lm_peak.txt"
timeout 120 python3 scripts/minibatch_memory.py --models omeganet --D 128 --peak --device cuda --shape 4 4096 16 \
  --dtype bfloat16 --chain 16 --out "$OUT/lm_peak_chain16" 2>&1 | tail -5 | tee "$OUT/lm_peak_chain16.txt"
timeout 120 python3 -m fastweights bench speed --models omeganet --forms chunk --lengths 4096 --batch 4 --heads 16 \
  --dim 128 --dtype bfloat16 --device cuda --repeats 2 --warmup 1 --no-peers --keep-going \
  --out "$OUT/speed_lm" 2>&1 | tail -20 | tee "$OUT/speed_lm.txt"
