#!/usr/bin/env bash
# r4s13 call 2 (tree 7267053: degree-2 features by index_select; TTT-MLP sliced by default at sequences x heads <= 64).
# Times first: issue 36's table in one run (`fastweights bench speed`, the user's chunk form, every deep memory
# beside gated DeltaNet, B 64 T 512 H 2 D 64 bf16); OmegaNet's profile after the features' fix; the TTT-MLP LM against
# a transformer (d 1024, 8 layers, 4x4096, graphed) on the default rule. Then the cuda tests of the changed kernels.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
step() { echo "== $1: exit $2 at $SECONDS s"; }
setsid timeout -s INT -k 10 200 python3 -m fastweights bench speed --models gated_deltanet ttt_linear ttt_mlp titans \
  mesanet omeganet atlas --forms chunk --lengths 512 --batch 64 --heads 2 --dim 64 --dtype bfloat16 --device cuda \
  --repeats 3 --warmup 1 --no-peers --keep-going --out $W/speed_small > $W/speed_small.log 2>&1
step speed_small $?; tail -n 12 $W/speed_small.log
setsid timeout -s INT -k 10 60 python3 scripts/minibatch_memory.py --time --models omeganet --shape 64 512 2 \
  --D 64 --dtype bfloat16 --repeats 3 --row-budget 20 --profile --out $W/omega > $W/omega.log 2>&1
step omega $?; grep '"ms_median"' $W/omega.log | cut -c1-300
setsid timeout -s INT -k 10 170 python3 -m fastweights bench train --models softmax_attention ttt_mlp --d-model 1024 \
  --n-layers 8 --num-heads 8 --head-dim 128 --head-v-dim 128 --vocab-size 256 --shapes 4,4096 --steps 3 --warmup 1 \
  --device cuda --dtype bfloat16 --cuda-graph --out $W/lm_mlp > $W/lm_mlp.log 2>&1
step lm_mlp $?; grep "^| [st]" $W/lm_mlp.log | cut -d"|" -f2,3,6,8,9,10,12
P="python3 -m pytest -q -rf --tb=short -p no:randomly"
R=$((550 - SECONDS)); [ $R -gt 150 ] && R=150
setsid timeout -s INT -k 10 $R $P -m cuda tests/kernels/memories/test_triton_ttt_mlp_sliced.py > $W/t_sliced.log 2>&1 &
setsid timeout -s INT -k 10 $R $P -m cuda tests/kernels/memories/test_triton_titans.py > $W/t_titans.log 2>&1 &
wait
for f in t_sliced t_titans; do echo "== $f"; tail -n 6 $W/$f.log; done
mkdir -p $OUT/logs; cp $W/*.log $W/env.txt $OUT/logs/ 2>/dev/null
tar czf $OUT/results.tgz -C $W .
