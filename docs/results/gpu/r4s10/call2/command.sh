#!/usr/bin/env bash
# r4s10 call 2 (tree: tree.txt): the helpers' branches timed on the GPU — the conv streamed by rows against the tile
# kernels, the delta layer's copies, the delta kernels' launch variants at the preset's micro-batch, MesaNet's CG
# launch variants, OmegaNet's and ATLAS's peaks; then the preset graphed against the same-parameter transformer.
# Every step bounded: done by ~560 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
step() { echo "== $1: exit $2 at $SECONDS s"; }
# 1. the conv: tiles vs rows (each case checked against the defaults first)
timeout 90 python3 scripts/bench_conv.py --sweep --batch 8 --seq-len 2048 --channels 768 --out $W/conv_preset.json > $W/conv_preset.log 2>&1
step conv-preset $?; grep -E "µs|best|ROWS" $W/conv_preset.log | cut -c1-140 | head -30
# 2. the delta op's launch variants at the preset's micro-batch (fused/fused, checked against the table's launch)
timeout 120 python3 scripts/gpu_delta_pipelines.py --out $W/dp --shapes 8x2048x6 1x16384x6 --repeats 10 --launch-variants \
  '{"delta_fused_grads": {"num_warps": 4}}' '{"delta_fused_grads": {"BV": 32}}' '{"delta_fused_grads": {"BV": 128}}' \
  '{"delta_fused_fwd_t": {"PROGRAMS": 264}, "delta_fused_fwd": {"PROGRAMS": 264}}' \
  '{"delta_fused_rev": {"PROGRAMS": 264}, "delta_fused_rec": {"PROGRAMS": 264}}' \
  '{"delta_fused_fwd": {"num_stages": 3}, "delta_fused_fwd_t": {"num_stages": 3}, "delta_fused_rev": {"num_stages": 3}}' \
  '{"delta_prepass": {"num_warps": 8}}' > $W/dp.log 2>&1
step delta-launch $?; python3 -c "
import json; rows=json.load(open('$W/dp/pipelines.json'))
for r in rows: print(r['B'],r['T'],r['H'],json.dumps(r['launch']),'fwd %.3f fwd+bwd %.3f err %.2e'%(r.get('fwd_ms',-1),r.get('fwd_bwd_ms',-1),r.get('rel_err',-1)),r.get('error',''))"
# 3. MesaNet's CG launch variants, then its chunk row
timeout 100 python3 scripts/gpu_mesa_cg.py --out $W/mesa --phases kernel --variants 16:0:tf32:8 16:0:tf32:4 32:0:tf32:8 32:1:tf32:8 16:1:tf32:8 64:0:tf32:8 --repeats 5 > $W/mesa.log 2>&1
step mesa $?; tail -n 12 $W/mesa.log | cut -c1-160
# HELPERS
# 9. the preset graphed against the same-parameter transformer
timeout 100 python3 -m fastweights.cli bench train --models softmax_attention gated_deltanet --same-params --d-model 768 \
  --n-layers 12 --num-heads 6 --head-dim 128 --head-v-dim 128 --vocab-size 256 --shapes 8,2048 4,4096 1,16384 --steps 5 \
  --warmup 2 --device cuda --dtype bfloat16 --cuda-graph --keep-going --out $W/bench > $W/bench.log 2>&1
step bench-preset $?; grep "^|" $W/bench.log | cut -c1-250
cp -r $W/. $OUT/
