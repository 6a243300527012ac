#!/usr/bin/env bash
# r4s12 call 4 (tree: tree.txt; main after merging the helper branches atlas-ns and mlp-d128): issue 36 on the GPU.
# Times first: TTT-MLP's sliced kernels (ttt_mlp_sliced: its float64 check, then B 4 T 4096 H 8 D 128 fwd+bwd, off vs
# on); ATLAS and OmegaNet at the small shape (ATLAS's Newton–Schulz now the torch iteration at side 64, at ieee and
# tf32x3); MesaNet's LM peak after the region keeps edges. Then the changed kernels' tests, three at once. ~540 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
step() { echo "== $1: exit $2 at $SECONDS s"; }
setsid timeout -s INT -k 10 170 python3 scripts/gpu_ttt_mlp_sliced.py --out $W/sliced --phases check time \
  --shapes lm8 --variants off np4 np8w4 --repeats 3 --check-len 300 > $W/sliced.log 2>&1
step sliced $?; tail -n 25 $W/sliced.log
setsid timeout -s INT -k 10 150 python3 scripts/minibatch_memory.py --time --models omeganet atlas --shape 64 512 2 \
  --D 64 --dtype bfloat16 --ns-precisions ieee tf32x3 --repeats 2 --row-budget 40 --out $W/atlas > $W/atlas.log 2>&1
step atlas $?; tail -n 14 $W/atlas.log
setsid timeout -s INT -k 10 75 python3 -m fastweights bench train --models softmax_attention mesanet --d-model 1024 \
  --n-layers 8 --num-heads 8 --head-dim 128 --head-v-dim 128 --vocab-size 256 --shapes 4,4096 --steps 3 --warmup 1 \
  --device cuda --dtype bfloat16 --cuda-graph --out $W/mesa > $W/mesa.log 2>&1
step mesa $?; grep "^| [sm]" $W/mesa.log | cut -d"|" -f2,3,8,9,10,12
P="python3 -m pytest -q -rf --tb=short -p no:randomly"
R=$((540 - SECONDS)); [ $R -gt 130 ] && R=130
setsid timeout -s INT -k 10 $R $P -m triton tests/kernels/memories/test_triton_newton_schulz.py > $W/t_ns.log 2>&1 &
setsid timeout -s INT -k 10 $R $P -m cuda tests/kernels/memories/test_triton_ttt_mlp_sliced.py \
  tests/kernels/memories/test_triton_ttt_mlp.py > $W/t_sliced.log 2>&1 &
setsid timeout -s INT -k 10 $R $P -m cuda tests/kernels/memories/test_triton_mesa_cg.py > $W/t_mesa.log 2>&1 &
wait
for f in t_ns t_sliced t_mesa; do echo "== $f"; tail -n 4 $W/$f.log; done
mkdir -p $OUT/logs; cp $W/*.log $W/env.txt $OUT/logs/ 2>/dev/null; cp $W/atlas/*.json $OUT/ 2>/dev/null
tar czf $OUT/results.tgz -C $W .
