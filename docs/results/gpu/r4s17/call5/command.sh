# r4s17 call 5 (a fresh H200, empty Triton cache, no ~/.triton): the preset's plain command, its first optimizer step
# (compiles and the CUDA graph's capture included) — issue 32's "≤ 30 s on a fresh machine" under the graphed default
mkdir -p $OUT; export TRITON_CACHE_DIR=$(mktemp -d) PYTHONUNBUFFERED=1; ls ~/.triton 2>&1 | head -2 > $OUT/env.txt; nvidia-smi -L >> $OUT/env.txt
/usr/bin/time -v setsid timeout -s INT -k 10 200 python3 -m fastweights.cli train --preset gpu-125m --steps 8 \
  --data README.md docs BENCHMARKS.md --out /tmp/first --progress plain --val-every 1000 --save-every 1000 \
  --val-fraction 0.01 --fresh > $OUT/first.log 2> $OUT/first.err
