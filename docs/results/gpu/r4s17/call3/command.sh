# r4s17 call 3: the 12 cuda_big tests call 2 did not reach (its 500 s bound), then the LM on the split forward
# beside the default (issue 32), then the preset's log head (its graphed default, "auto").
export PYTHONPATH=$PWD TRITON_CACHE_DIR=$PWD/runs/cache/triton PYTHONUNBUFFERED=1 FASTWEIGHTS_CUDA_BIG_SLOTS=4
setsid timeout -s INT -k 10 280 python3 -m pytest -q -rfE --tb=short -p no:randomly -n 4 -m cuda \
  $(cat docs/results/gpu/r4s17/call3/left12.txt) --junitxml=$OUT/left12.xml > $OUT/left12.log 2>&1
echo '{"delta_split_out": {"ON": 1}}' > runs/split.json
G=(--models softmax_attention gated_deltanet --d-model 768 --n-layers 12 --num-heads 6 --shapes 8,2048 4,4096
   --same-params --head-dim 128 --head-v-dim 128 --vocab-size 256 --steps 5 --warmup 2 --device cuda
   --dtype bfloat16 --cuda-graph --keep-going)
setsid timeout -s INT -k 10 110 python3 -m fastweights.cli bench train "${G[@]}" --out $OUT/lm_default > $OUT/lm_default.log 2>&1
setsid timeout -s INT -k 10 110 python3 -m fastweights.cli bench train "${G[@]}" --launch runs/split.json --out $OUT/lm_split > $OUT/lm_split.log 2>&1
setsid timeout -s INT -k 10 75 python3 -m fastweights.cli train --preset gpu-125m --steps 6 --data README.md docs BENCHMARKS.md \
  --out runs/train_auto --progress plain --val-every 1000 --save-every 1000 --val-fraction 0.01 --fresh > $OUT/train_auto.log 2>&1
rm -rf runs/train_auto
cd $OUT && tar czf all.tgz --exclude all.tgz . ; ls $OUT
