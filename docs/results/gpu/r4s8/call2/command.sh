#!/usr/bin/env bash
# r4s8 call 2: main (tl.dot precision by input dtype: bf16 -> tf32) — the memories' cuda tests; TTT-Linear and TTT-MLP
# checked with bf16 q, k, v at T 1000 against float64 on the same rounded values per precision; TTT-Linear timed,
# branch ttt-bwd-trade (new_tree) against main, 15 repeats, beside fla; TTT-MLP timed per precision; then the peak
# phase (Titans, OmegaNet, ATLAS: fwd+bwd ms and peak memory, checkpoint_chain 0 and 4) alone.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=/tmp/tc
(PYTHONPATH=/tmp/site:$PWD timeout 200 python3 scripts/gpu_memories.py --out $W/warm --phases warm --models ttt_linear > $W/warm.log 2>&1) &
(timeout 200 python3 -m pytest -m cuda -n 3 -q -rf -p no:randomly tests/kernels/memories > $W/cuda_mem.log 2>&1) &
(timeout 200 python3 scripts/gpu_memories.py --out $W/main --phases compile --variants tf32x3:8 tf32:8 ieee:4 > $W/main.log 2>&1;
 timeout 150 python3 scripts/gpu_memories.py --out $W/main --phases check --check-dtype bfloat16 --check-len 1000 \
   --variants tf32x3:8 tf32:8 ieee:4 >> $W/main.log 2>&1) &
(cd new_tree && PYTHONPATH=$PWD timeout 200 python3 scripts/gpu_memories.py --out $W/new --phases compile --variants tf32x3:8 tf32:8 --models ttt_linear > $W/new.log 2>&1)
wait
echo "== after tests/compile/check: $SECONDS s"; tail -n 2 $W/cuda_mem.log; tail -n 2 $W/warm.log
(cd new_tree && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 scripts/gpu_memories.py --out $W/new --phases time --repeats 15 --variants tf32x3:8 tf32:8 --models ttt_linear >> $W/new.log 2>&1)
PYTHONPATH=/tmp/site:$PWD timeout 150 python3 scripts/gpu_memories.py --out $W/main --phases time --repeats 15 --variants tf32x3:8 tf32:8 ieee:4 >> $W/main.log 2>&1
echo "== after time: $SECONDS s"
timeout 230 python3 scripts/gpu_memories.py --out $W/peak --phases peak --chain 0 4 > $W/peak.log 2>&1
echo "== done: $SECONDS s"
grep -h '^check\|^time\|^compile\|^peak' $W/new.log $W/main.log $W/peak.log | cut -c1-230
tar czf $OUT/call2.tgz -C $W .
