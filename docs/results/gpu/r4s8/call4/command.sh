#!/usr/bin/env bash
# r4s8 call 4 (tree 4a9394b): Titans' loop kernels on a GPU for the first time — the memories' cuda tests (Titans' 6,
# TTT-MLP now at 8 warps), Titans checked with bf16 inputs at T 1000 (tf32, the new bf16 default, vs ieee) and timed
# beside gated DeltaNet; the bf16 graphed-step diagnosis (weights or gradients; packed or not). Bounded to ~300 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
(timeout -s INT -k 10 170 python3 -m pytest -m cuda -n 3 -q -rf -p no:randomly tests/kernels/memories > $W/cuda_mem.log 2>&1) &
(timeout 170 python3 docs/results/gpu/r4s8/call4/graphed_bf16.py > $W/graphed_bf16.log 2>&1) &
(timeout 100 python3 scripts/gpu_memories.py --out $W/titans --phases compile --models titans --variants tf32:8 ieee:8 > $W/titans.log 2>&1;
 timeout 70 python3 scripts/gpu_memories.py --out $W/titans --phases check --models titans --check-dtype bfloat16 --check-len 1000 \
   --variants tf32:8 ieee:8 >> $W/titans.log 2>&1)
wait
echo "== after tests/check: $SECONDS s"; tail -n 3 $W/cuda_mem.log; cat $W/graphed_bf16.log | tail -24
timeout 100 python3 scripts/gpu_memories.py --out $W/titans --phases time --models titans --repeats 5 --variants tf32:8 ieee:8 >> $W/titans.log 2>&1
echo "== done: $SECONDS s"; grep -h '^check\|^time\|^compile' $W/titans.log | cut -c1-220
tar czf $OUT/call4.tgz -C $W .
