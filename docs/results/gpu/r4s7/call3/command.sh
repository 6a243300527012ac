#!/usr/bin/env bash
# r4s7 call 3: a fresh machine's first `fastweights train --preset gpu-125m` step (empty Triton cache), then the TTT-Linear
# split (state pass + parallel readout; backward pre-pass + reverse pass) checked and timed against the pre-split kernel
# (old_tree = 7f512f2) and fla's chunk_ttt_linear, and the memories' cuda tests.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
timeout 170 python3 -m fastweights.cli train --preset gpu-125m --steps 12 --data README.md docs BENCHMARKS.md \
    --out /tmp/gpu_train --progress plain --val-every 1000 --save-every 1000 --val-fraction 0.01 --fresh > $W/train.log 2>&1
echo "== train: exit $? at $SECONDS s"; grep -E "step (1|2|3|6|9|12)/" $W/train.log | tail -6
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=/tmp/tc
(PYTHONPATH=/tmp/site:$PWD timeout 200 python3 scripts/gpu_memories.py --out $W/warm --phases warm --models ttt_linear > $W/warm.log 2>&1) &
(timeout 240 python3 -m pytest -m cuda -n 4 -q -p no:randomly tests/kernels/memories > $W/cuda_mem.log 2>&1) &
(cd old_tree && PYTHONPATH=$PWD timeout 200 python3 scripts/gpu_memories.py --out $W/old --phases compile check --models ttt_linear > $W/old.log 2>&1) &
timeout 240 python3 scripts/gpu_memories.py --out $W/new --phases compile check --models ttt_linear > $W/new.log 2>&1
wait
echo "== after tests/compile/check: $SECONDS s"; tail -2 $W/cuda_mem.log; tail -3 $W/warm.log
PYTHONPATH=/tmp/site:$PWD timeout 150 python3 scripts/gpu_memories.py --out $W/new --phases time --models ttt_linear >> $W/new.log 2>&1
(cd old_tree && PYTHONPATH=$PWD timeout 60 python3 scripts/gpu_memories.py --out $W/old --phases time --models ttt_linear >> $W/old.log 2>&1)
echo "== done: $SECONDS s"
grep -h '^check\|^time\|^compile' $W/new.log $W/old.log | cut -c1-260
tar czf $OUT/call3.tgz -C $W .
