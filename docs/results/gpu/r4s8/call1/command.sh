#!/usr/bin/env bash
# r4s8 call 1: branch ttt-bwd-trade (copied as new_tree) against main (the working tree): the memories' cuda tests on
# the branch, TTT-Linear checked (float64) and timed beside main's kernel and fla's chunk_ttt_linear in one run; and the
# gated fused pipeline's refusal changes (696acb4) on main: the bf16 none/scalar cases, grouped varlen, T 65536,
# the varlen no-recompile and graph-capture tests.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L > $W/env.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=/tmp/tc
V="tf32x3:8 tf32:8 tf32x3:4 tf32:4"
(PYTHONPATH=/tmp/site:$PWD timeout 200 python3 scripts/gpu_memories.py --out $W/warm --phases warm --models ttt_linear > $W/warm.log 2>&1) &
(cd new_tree && PYTHONPATH=$PWD timeout 260 python3 -m pytest -m cuda -n 3 -q -p no:randomly tests/kernels/memories > $W/cuda_mem.log 2>&1) &
(timeout 260 python3 -m pytest -m cuda -n 3 -q -rf -p no:randomly tests/kernels/fused/test_triton_gated_fused.py \
   -k "(realistic and (none or scalar) and dtype1 and (B2-T1024 or B3-T1000)) or grouped_varlen or (long_bf16 and not diagonal) or no_recompile or graph_capture" \
   > $W/cuda_fused.log 2>&1) &
(timeout 200 python3 scripts/gpu_memories.py --out $W/old --phases compile --variants $V --models ttt_linear > $W/old.log 2>&1) &
(cd new_tree && PYTHONPATH=$PWD timeout 260 python3 scripts/gpu_memories.py --out $W/new --phases compile check --variants $V --models ttt_linear > $W/new.log 2>&1)
wait
echo "== after tests/compile/check: $SECONDS s"; tail -2 $W/cuda_mem.log $W/cuda_fused.log; tail -2 $W/warm.log
(cd new_tree && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 scripts/gpu_memories.py --out $W/new --phases time --variants $V --models ttt_linear >> $W/new.log 2>&1)
PYTHONPATH=$PWD timeout 90 python3 scripts/gpu_memories.py --out $W/old --phases time --variants $V --models ttt_linear >> $W/old.log 2>&1
echo "== done: $SECONDS s"
grep -h '^check\|^time\|^compile' $W/new.log $W/old.log | cut -c1-200
tar czf $OUT/call1.tgz -C $W .
