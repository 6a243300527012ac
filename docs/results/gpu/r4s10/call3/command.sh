#!/usr/bin/env bash
# r4s10 call 3 (tree: tree.txt): the fused delta forward's numeric launch options (RAW_QK, RAW_KV, INV_TF32) held to
# the fp32 torch form on the GPU in bf16, then timed at three shapes (the preset's 8×2048×6 and 1×16384×6, the op
# table's 4×4096×16), with the grads kernel's BV 32 again. Every step bounded: done by ~300 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
step() { echo "== $1: exit $2 at $SECONDS s"; }
setsid timeout -s INT -k 10 120 python3 -m pytest -m cuda -q -rf -p no:randomly -n 4 \
  tests/kernels/fused/test_triton_delta_fused.py -k numeric_launch > $W/options_tests.log 2>&1
step option-tests $?; tail -n 6 $W/options_tests.log
timeout 170 python3 scripts/gpu_delta_pipelines.py --out $W/dp --shapes 8x2048x6 1x16384x6 4x4096x16 --repeats 15 \
  --launch-variants '{"delta_prepass": {"RAW_KV": 1}}' '{"delta_prepass": {"INV_TF32": 1}}' \
  '{"delta_prepass": {"RAW_KV": 1, "INV_TF32": 1}}' '{"delta_fused_grads": {"BV": 32}}' '{}' > $W/dp.log 2>&1
step delta-launch $?; python3 -c "
import json; rows=json.load(open('$W/dp/pipelines.json'))
for r in rows: print(r['B'],r['T'],r['H'],json.dumps(r['launch']),'fwd %.3f fwd+bwd %.3f (min %.3f / %.3f) err %.2e'%(r.get('fwd_ms',-1),r.get('fwd_bwd_ms',-1),r.get('fwd_min_ms',-1),r.get('fwd_bwd_min_ms',-1),r.get('rel_err',-1)),r.get('error',''))"
cp -r $W/. $OUT/
