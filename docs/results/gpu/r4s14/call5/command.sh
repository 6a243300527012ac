#!/usr/bin/env bash
# r4s14 call 5 (tree: tree.txt; the three helper branches merged): times first — TTT-Linear's sliced passes against
# the one-program ones at the LM shape (issue 36), the pre-pass inverse's forms (issue 32), OmegaNet's kernel-trick
# form at the small shape (issue 36) —, then `pytest -m cuda` on the files call 2 left (the delta class, forms,
# TTT-Linear and its sliced passes, layer ops), as far as the session's device time goes (SIGINT: summary kept).
set -u
W=/tmp/w; mkdir -p $W $OUT/logs
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
step() { echo "== $1: exit $2 at $SECONDS s"; cp $W/*.log $OUT/logs/ 2>/dev/null; }
setsid timeout -s INT -k 10 100 python3 scripts/gpu_ttt_mlp_sliced.py --memory ttt_linear --out $W/tl --phases time \
  --shapes lm --variants off np4 np2w8 --repeats 5 > $W/ttt_linear.log 2>&1
step ttt_linear $?; grep -E '"fwdbwd|ms' $W/ttt_linear.log | tail -n 5 | cut -c1-300
setsid timeout -s INT -k 10 75 python3 scripts/gpu_prepass_inverse.py --out $W/inv --phases time --repeats 20 \
  > $W/inverse.log 2>&1
step inverse $?; tail -n 12 $W/inverse.log | cut -c1-300
setsid timeout -s INT -k 10 60 python3 -m fastweights bench speed --models gated_deltanet omeganet --forms chunk \
  --lengths 512 --batch 64 --heads 2 --dim 64 --dtype bfloat16 --device cuda --repeats 3 --warmup 1 --no-peers \
  > $W/omega.log 2>&1
step omega $?; grep -E "\| (omeganet|gated_deltanet) " $W/omega.log | cut -d"|" -f3,6,7
LEFT=$((545 - SECONDS))
setsid timeout -s INT -k 15 $LEFT python3 -m pytest -q -rfE --tb=short -p no:randomly -n 14 -m cuda --durations=20 \
  tests/kernels/memories/test_triton_ttt_linear_sliced.py tests/kernels/memories/test_triton_ttt.py \
  tests/kernels/fused/test_triton_delta_fused.py tests/kernels/fused/test_triton_delta_fused_bwd.py \
  tests/kernels/test_triton_delta_variants.py tests/kernels/test_triton_delta.py tests/cuda/test_forms.py \
  tests/layers/test_layer_ops.py -k "not persistent" > $W/part2.log 2>&1
step part2 $?; grep -E "passed|failed|error" $W/part2.log | tail -n 3; grep -E "^(FAILED|ERROR)" $W/part2.log | head -20
tar czf $OUT/results.tgz -C $W tl inv 2>/dev/null
