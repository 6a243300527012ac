#!/usr/bin/env bash
# r4s15 call 1 (tree: tree.txt). Decisions before the final commit's cuda suite. Times first, tests last.
# 1. Issue 32: the pre-pass inverse INV 2 held to float64 on the GPU (tf32x3's real rounding), then the preset LM
#    graphed (same-params transformer, gated DeltaNet with INV 0 and with INV 2) at 8x2048 and 4x4096.
# 2. Issue 36: the TTT-Linear LM (d 1024, 8 layers, 8 heads of 128, 4x4096, graphed) with the sliced passes on
#    (ON 2: eager they lost to Python launch cost, 257 launches a pass; in a graph that cost is gone) against off.
# 3. The persistent sliced TTT-Linear (SYNC 1) cuda tests, never run on a GPU, bounded.
set -u
W=/tmp/w; mkdir -p $W $OUT/logs
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
step() { echo "== $1: exit $2 at $SECONDS s"; cp $W/*.log $OUT/logs/ 2>/dev/null; }
echo '{"delta_prepass": {"INV": 2}}' > $W/inv2.json
echo '{"ttt_linear_sliced": {"ON": 2}}' > $W/tl_on.json
setsid timeout -s INT -k 10 110 python3 scripts/gpu_prepass_inverse.py --out $W/inv --phases check \
  --variants substitution batched > $W/inv_check.log 2>&1
step inv_check $?; grep '^check' $W/inv_check.log | cut -c1-260
S="--d-model 768 --n-layers 12 --num-heads 6 --head-dim 128 --head-v-dim 128 --vocab-size 256 --shapes 8,2048 4,4096 \
   --steps 7 --warmup 2 --device cuda --dtype bfloat16 --cuda-graph"
setsid timeout -s INT -k 10 100 python3 -m fastweights bench train --models softmax_attention gated_deltanet \
  --same-params $S --out $W/lm_inv0 > $W/lm_inv0.log 2>&1
step lm_inv0 $?; grep "^| [sg]" $W/lm_inv0.log | cut -d"|" -f2-10
setsid timeout -s INT -k 10 80 python3 -m fastweights bench train --models gated_deltanet $S --launch $W/inv2.json \
  --out $W/lm_inv2 > $W/lm_inv2.log 2>&1
step lm_inv2 $?; grep "^| [sg]" $W/lm_inv2.log | cut -d"|" -f2-10
T="--d-model 1024 --n-layers 8 --num-heads 8 --head-dim 128 --head-v-dim 128 --vocab-size 256 --shapes 4,4096 \
   --steps 4 --warmup 1 --device cuda --dtype bfloat16 --cuda-graph"
setsid timeout -s INT -k 10 75 python3 -m fastweights bench train --models ttt_linear $T --out $W/tl_off \
  > $W/tl_off.log 2>&1
step tl_off $?; grep "^| [t]" $W/tl_off.log | cut -d"|" -f2-10
setsid timeout -s INT -k 10 90 python3 -m fastweights bench train --models ttt_linear $T --launch $W/tl_on.json \
  --out $W/tl_on > $W/tl_on.log 2>&1
step tl_on $?; grep "^| [t]" $W/tl_on.log | cut -d"|" -f2-10
setsid timeout -s INT -k 10 60 python3 -m pytest -q -rfE --tb=short -p no:randomly -n 4 -m cuda \
  tests/kernels/memories/test_triton_ttt_linear_sliced.py -k persistent > $W/t_sync.log 2>&1
step t_sync $?; tail -n 8 $W/t_sync.log
cp $W/env.txt $OUT/logs/; tar czf $OUT/results.tgz -C $W inv lm_inv0 lm_inv2 tl_off tl_on 2>/dev/null
