#!/usr/bin/env bash
# r4s9 call 3 (the warm machine of call 2, whose bench step had exited 2: --same-params needs softmax_attention in --models)
export PYTHONPATH=$PWD; timeout 300 python3 -m fastweights.cli bench train --models softmax_attention gated_deltanet --same-params --d-model 768 --n-layers 12 --num-heads 6 --head-dim 128 --head-v-dim 128 --vocab-size 256 --shapes 8,2048 4,4096 1,16384 --steps 5 --warmup 2 --device cuda --dtype bfloat16 --cuda-graph --keep-going --out $OUT/bench > $OUT/bench.log 2>&1; echo "exit $? at $SECONDS"; grep "^|" $OUT/bench.log | cut -c1-330
