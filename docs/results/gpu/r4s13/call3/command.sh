#!/usr/bin/env bash
# r4s13 call 3 (tree: tree.txt): does the span split (context parallelism's algebra on one GPU) fill the SMs at long T
# and few heads (issue 32)? Then OmegaNet and ATLAS after the one-unbind readout (issue 36), Titans' profile at the
# small shape. ~420 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
step() { echo "== $1: exit $2 at $SECONDS s"; }
setsid timeout -s INT -k 10 210 python3 scripts/gpu_span_split.py --out $W/span --P 2 4 8 16 --repeats 5 \
  > $W/span.log 2>&1
step span $?; grep "^{" $W/span.log | cut -c1-260
setsid timeout -s INT -k 10 70 python3 scripts/minibatch_memory.py --time --models omeganet --shape 64 512 2 \
  --D 64 --dtype bfloat16 --repeats 3 --row-budget 20 --profile --out $W/omega > $W/omega.log 2>&1
step omega $?; grep '"ms_median"' $W/omega.log | cut -c1-300
setsid timeout -s INT -k 10 70 python3 scripts/minibatch_memory.py --time --models titans --shape 64 512 2 \
  --D 64 --dtype bfloat16 --repeats 3 --row-budget 20 --profile --out $W/titans > $W/titans.log 2>&1
step titans $?; grep '"ms_median"' $W/titans.log | cut -c1-300
setsid timeout -s INT -k 10 70 python3 scripts/minibatch_memory.py --time --models atlas --shape 64 512 2 \
  --D 64 --dtype bfloat16 --repeats 1 --row-budget 20 --out $W/atlas > $W/atlas.log 2>&1
step atlas $?; grep '"ms_median"' $W/atlas.log | cut -c1-300
mkdir -p $OUT/logs; cp $W/*.log $W/env.txt $OUT/logs/ 2>/dev/null
tar czf $OUT/results.tgz -C $W .
