#!/usr/bin/env bash
# r4s10 call 1 (tree: see tree.txt): (1) ncu on the short conv's and the gated DeltaNet op's kernels at the preset's
# micro-batch; (2) the preset graphed against the same-parameter transformer (the conv's DW_ACC now in the LM);
# (3) pytest -m cuda on what changed since the last GPU run (RoPE's frequencies, Titans' shared jit helpers, the
# fused delta kernels after VARLEN_ROWS' removal). Every step bounded: done by ~540 s.
set -u
W=/tmp/w; mkdir -p $W
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
D=docs/results/gpu/r4s10/call1
nvidia-smi -L > $W/env.txt; python3 -c "import torch,triton;print(torch.__version__,triton.__version__)" >> $W/env.txt
NCU="ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis"
timeout 120 $NCU -k regex:_conv --launch-skip 3 --launch-count 3 python3 $D/ncu_driver.py conv > $W/ncu_conv.txt 2>&1
echo "== ncu conv: exit $? at $SECONDS s"; grep -E "^  _conv|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Compute \(SM\)|L1/TEX Hit|L2 Hit" $W/ncu_conv.txt | head -40
timeout 150 $NCU -k regex:"^_" --launch-skip 5 --launch-count 6 python3 $D/ncu_driver.py delta > $W/ncu_delta.txt 2>&1
echo "== ncu delta: exit $? at $SECONDS s"; grep -E "^  _|Duration|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Block Size|Grid Size" $W/ncu_delta.txt | head -80
timeout 120 python3 -m fastweights.cli bench train --models softmax_attention gated_deltanet --same-params --d-model 768 \
  --n-layers 12 --num-heads 6 --head-dim 128 --head-v-dim 128 --vocab-size 256 --shapes 8,2048 4,4096 1,16384 --steps 5 \
  --warmup 2 --device cuda --dtype bfloat16 --cuda-graph --keep-going --out $W/bench > $W/bench.log 2>&1
echo "== bench preset: exit $? at $SECONDS s"; grep "^|" $W/bench.log | cut -c1-250
left=$(( 530 - SECONDS )); [ $left -gt 30 ] || left=30
setsid timeout -s INT -k 10 $left python3 -m pytest -m "cuda or triton" -q -rf -p no:randomly -n 4 --durations=15 \
  tests/kernels/layer/test_triton_rope.py tests/kernels/memories -k "titans or rope" > $W/cuda.log 2>&1
echo "== cuda tests: exit $? at $SECONDS s"; tail -n 25 $W/cuda.log
cp -r $W/. $OUT/
