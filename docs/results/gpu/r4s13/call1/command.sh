#!/usr/bin/env bash
# r4s13 call 1 (tree bd12a3e): issue 36. Times first: TTT-MLP's sliced kernels at the small shape (B64 T512 H2 D64)
# and the LM's H 16 (B4 T4096 D128) against the one-program kernels (the default decision); OmegaNet with every fp32
# product on TF32 (what a TF32 region could give). Then TTT-MLP's one-program cuda tests (not run on a GPU since
# r4s11) beside the sliced ones. ~560 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
step() { echo "== $1: exit $2 at $SECONDS s"; }
setsid timeout -s INT -k 10 230 python3 scripts/gpu_ttt_mlp_sliced.py --out $W/sliced --phases time \
  --shapes small lm --variants off np8w4 np4w4 --repeats 3 > $W/sliced.log 2>&1
step sliced $?; tail -n 25 $W/sliced.log
setsid timeout -s INT -k 10 110 python3 scripts/minibatch_memory.py --time --models omeganet --shape 64 512 2 \
  --D 64 --dtype bfloat16 --repeats 3 --row-budget 30 --matmul-tf32 --profile --out $W/omega > $W/omega.log 2>&1
step omega $?; tail -n 30 $W/omega.log
P="python3 -m pytest -q -rf --tb=short -p no:randomly"
R=$((555 - SECONDS)); [ $R -gt 200 ] && R=200
setsid timeout -s INT -k 10 $R $P -m cuda tests/kernels/memories/test_triton_ttt_mlp.py > $W/t_mlp.log 2>&1 &
setsid timeout -s INT -k 10 $R $P -m cuda tests/kernels/memories/test_triton_ttt.py \
  tests/kernels/memories/test_triton_titans.py > $W/t_ttt_titans.log 2>&1 &
wait
for f in t_mlp t_ttt_titans; do echo "== $f"; tail -n 6 $W/$f.log; done
mkdir -p $OUT/logs; cp $W/*.log $W/env.txt $OUT/logs/ 2>/dev/null
tar czf $OUT/results.tgz -C $W .
