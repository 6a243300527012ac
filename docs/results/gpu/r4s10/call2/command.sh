#!/usr/bin/env bash
# r4s10 call 2 (tree: tree.txt): the fused delta forward's RAW_QK option on the GPU (its cuda tests, then timed), the
# delta kernels' launch variants at the preset's micro-batch and at 1 × 16384, MesaNet's CG launch variants.
# Every step bounded: done by ~420 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
step() { echo "== $1: exit $2 at $SECONDS s"; }
# 2. the delta op's launch variants (RAW_QK's cuda test first)
timeout 90 python3 -m pytest -m cuda -q -rf -p no:randomly tests/kernels/fused/test_triton_delta_fused.py -k raw_qk > $W/raw_qk_tests.log 2>&1
step raw-qk-tests $?; tail -n 3 $W/raw_qk_tests.log
# the launch variants at the preset's micro-batch (fused/fused, checked against the table's launch)
timeout 200 python3 scripts/gpu_delta_pipelines.py --out $W/dp --shapes 8x2048x6 1x16384x6 --repeats 10 --launch-variants \
  '{"delta_fused_grads": {"num_warps": 4}}' '{"delta_fused_grads": {"BV": 32}}' '{"delta_fused_grads": {"BV": 128}}' \
  '{"delta_fused_fwd_t": {"PROGRAMS": 264}, "delta_fused_fwd": {"PROGRAMS": 264}}' \
  '{"delta_fused_rev": {"PROGRAMS": 264}, "delta_fused_rec": {"PROGRAMS": 264}}' \
  '{"delta_fused_fwd": {"num_stages": 3}, "delta_fused_fwd_t": {"num_stages": 3}, "delta_fused_rev": {"num_stages": 3}}' \
  '{"delta_prepass": {"num_warps": 8}}' '{"delta_fused_fwd": {"RAW_QK": 1}}' > $W/dp.log 2>&1
step delta-launch $?; python3 -c "
import json; rows=json.load(open('$W/dp/pipelines.json'))
for r in rows: print(r['B'],r['T'],r['H'],json.dumps(r['launch']),'fwd %.3f fwd+bwd %.3f err %.2e'%(r.get('fwd_ms',-1),r.get('fwd_bwd_ms',-1),r.get('rel_err',-1)),r.get('error',''))"
# 3. MesaNet's CG launch variants, then its chunk row
timeout 100 python3 scripts/gpu_mesa_cg.py --out $W/mesa --phases kernel --variants 16:0:tf32:8 16:0:tf32:4 32:0:tf32:8 32:1:tf32:8 16:1:tf32:8 64:0:tf32:8 --repeats 5 > $W/mesa.log 2>&1
step mesa $?; tail -n 12 $W/mesa.log | cut -c1-160
cp -r $W/. $OUT/
