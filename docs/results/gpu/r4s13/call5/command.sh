#!/usr/bin/env bash
# r4s13 call 5 (tree: tree.txt; the helper branches grads-split and titans-sliced merged, both options off by
# default). Times first. Issue 32: the gradient kernel's variants (row blocks, rowsums) at the preset's micro-batch,
# checked in bf16, timed, then the LM step graphed with the best two against off. Issue 36: Titans sliced checked
# against float64 and timed at B 4 T 4096 H 8 D 128. Then the two options' cuda tests, in parallel. ~560 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
step() { echo "== $1: exit $2 at $SECONDS s"; }
setsid timeout -s INT -k 10 150 python3 scripts/gpu_grads_rows.py --out $W/grads --phases launch check time \
  --variants off rowsums br16w4 br16w8r128 --no-fp32 --repeats 20 > $W/grads.log 2>&1
step grads $?; grep -v "^\s*$" $W/grads.log | tail -n 14 | cut -c1-240
S="--d-model 768 --n-layers 12 --num-heads 6 --head-dim 128 --head-v-dim 128 --vocab-size 256 --shapes 8,2048 \
   --steps 7 --warmup 2 --device cuda --dtype bfloat16 --cuda-graph"
for v in off rowsums br16w4; do
  [ -f $W/grads/launch_$v.json ] || continue
  M="gated_deltanet"; [ $v = off ] && M="softmax_attention gated_deltanet --same-params"
  setsid timeout -s INT -k 10 60 python3 -m fastweights bench train --models $M $S --launch $W/grads/launch_$v.json \
    --out $W/lm_$v > $W/lm_$v.log 2>&1
  step lm_$v $?; grep "^| [sg]" $W/lm_$v.log | cut -d"|" -f2,3,8,9,10 | head -4
done
setsid timeout -s INT -k 10 120 python3 scripts/gpu_ttt_mlp_sliced.py --memory titans --out $W/titans --phases check \
  time --shapes lm8 --variants off np4 np8 --repeats 3 > $W/titans.log 2>&1
step titans $?; grep -v "^\s*$" $W/titans.log | tail -n 12 | cut -c1-240
P="python3 -m pytest -q -rf --tb=short -p no:randomly"
R=$((560 - SECONDS)); [ $R -gt 150 ] && R=150; [ $R -lt 30 ] && R=30
setsid timeout -s INT -k 10 $R $P -m cuda tests/kernels/memories/test_triton_titans_sliced.py > $W/t_titans.log 2>&1 &
setsid timeout -s INT -k 10 $R $P -m cuda tests/kernels/fused/test_triton_delta_fused_bwd.py > $W/t_grads.log 2>&1 &
wait
for f in t_titans t_grads; do echo "== $f"; tail -n 6 $W/$f.log; done
mkdir -p $OUT/logs; cp $W/*.log $W/env.txt $OUT/logs/ 2>/dev/null
tar czf $OUT/results.tgz -C $W .
