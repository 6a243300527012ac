#!/usr/bin/env bash
# Issues 32 and 36's sitting: every table they name, from the user's commands, beside the peers, on one GPU machine
# kept warm over a few device calls (each ≤ 600 s). The peers are carried as wheels (never dependencies) and
# unpacked under the ignored runs/sitting/site; their compiled kernels and autotune choices are cached under
# runs/sitting/cache (Triton, TileLang), which a warm machine keeps between calls. One stage (or several) a call:
#
#   STAGE=install WHEELS=.whl/a   unpack the wheels of one folder (tilelang + FlashQLA; then .whl/b: z3, fla)
#   STAGE=warm                    scripts/gpu_peers_warm.py: every case compiled in parallel processes, then the
#                                 peers' autotune one case at a time with the GPU to itself (bounded: what it misses
#                                 the timed run tunes in its warm-up calls, alone on the GPU)
#   STAGE=ops                     issue 32's op table (B 4, T 4096, H 16, D 128, bf16; fla, FlashQLA, SDPA beside)
#                                 and its 32K row (B 1, 16 q/k heads, 32 value heads)
#   STAGE=lm                      issue 32's LM table (bench train, graphed, the same-params transformer beside) at the
#                                 preset's shape and at d_model 1024, then `fastweights train --preset gpu-125m`
#   STAGE=memories                issue 36's table at the small and the LM shape (fla's chunk_ttt_linear beside), the
#                                 deep memories' LM rows, and TTT-Linear's backward variants against fla
#
# From the repository root: STAGE="ops lm" OUT=... bash scripts/gpu_sitting.sh   (BENCHMARKS.md §1z has the tables)
# At most 8 files land in $OUT (the device's limit): each stage's log, and one results.tgz of the tables.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-runs/sitting/out}"
R=runs/sitting
mkdir -p "$OUT" $R/site $R/cache/triton $R/cache/tilelang $R/w
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/$R/site:$PWD" TRITON_CACHE_DIR="$PWD/$R/cache/triton" \
  TILELANG_CACHE_DIR="$PWD/$R/cache/tilelang" TRITON_CACHE_AUTOTUNING=1
W=$R/w
T0=$SECONDS
# one step: a bound in seconds, a log name, then the command (its own process group, SIGINT at the bound)
step() {
  local bound=$1 name=$2; shift 2
  setsid timeout -s INT -k 10 "$bound" "$@" > "$W/$name.log" 2>&1
  echo "== $name: exit $? at $((SECONDS - T0)) s"
}
keep() { cp "$W"/*.log "$OUT"/ 2>/dev/null; tar czf "$OUT/results.tgz" -C "$W" --exclude='*.log' . 2>/dev/null; }
trap keep EXIT
for stage in ${STAGE:?STAGE: install warm ops lm memories}; do
  case "$stage" in
  install)
    python3 -m pip install -q --no-index --no-deps --target $R/site "${WHEELS:?WHEELS: a folder of wheels}"/*.whl \
      > "$W/install_$(basename "$WHEELS").log" 2>&1
    echo "== install $WHEELS: exit $?"
    { nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
      git rev-parse --short HEAD 2>/dev/null; ls $R/site; } > "$W/env.log" 2>&1 ;;
  warm)
    step "${COMPILE_S:-330}" warm_compile python3 scripts/gpu_peers_warm.py --mode compile --workers 14 \
      --deadline "$((${COMPILE_S:-330} - 15))"
    grep -E "FAILED|TIMEOUT|done" "$W/warm_compile.log" | cut -c1-200
    left=$((${WARM_S:-560} - (SECONDS - T0)))
    step "$left" warm_tune python3 scripts/gpu_peers_warm.py --mode tune --deadline "$((left - 10))"
    grep -vE "skipped" "$W/warm_tune.log" | cut -c1-200 ;;
  ops)
    A=(--forms chunk_triton --dim 128 --dtype bfloat16 --device cuda --repeats 20 --warmup 3 --threads 0 --keep-going)
    step 260 ops_4k python3 -m fastweights.cli bench speed --models gated_deltanet deltanet kda gla mamba2 retnet \
      comba deltaproduct --lengths 4096 --batch 4 --heads 16 "${A[@]}" --out "$W/ops_4k"
    step 120 ops_32k python3 -m fastweights.cli bench speed --models gated_deltanet --lengths 32768 --batch 1 \
      --heads 16 --value-heads 32 "${A[@]}" --out "$W/ops_32k"
    grep -E "^\|" "$W/ops_4k/speed.md" "$W/ops_32k/speed.md" 2>/dev/null | cut -c1-220 ;;
  lm)
    G=(--same-params --head-dim 128 --head-v-dim 128 --vocab-size 256 --steps 5 --warmup 2 --device cuda
       --dtype bfloat16 --cuda-graph --keep-going)
    step 150 lm_preset python3 -m fastweights.cli bench train --models softmax_attention gated_deltanet \
      --d-model 768 --n-layers 12 --num-heads 6 --shapes 8,2048 4,4096 1,16384 "${G[@]}" --out "$W/lm_preset"
    step 150 lm_1024 python3 -m fastweights.cli bench train --models softmax_attention gated_deltanet \
      --d-model 1024 --n-layers 8 --num-heads 8 --shapes 4,4096 4,8192 1,32768 "${G[@]}" --out "$W/lm_1024"
    grep -E "^\| [sg]" "$W/lm_preset.log" "$W/lm_1024.log" | cut -c1-240
    step 110 train_preset python3 -m fastweights.cli train --preset gpu-125m --cuda-graph --steps 24 \
      --data README.md docs BENCHMARKS.md --out "$W/train_run" --progress plain --val-every 1000 --save-every 1000 \
      --val-fraction 0.01 --fresh
    rm -rf "$W/train_run/checkpoint.pt" "$W/train_run/model"  # (the weights: not results)
    grep -E "step (1|2|6|12|18|24)/|steady|MFU" "$W/train_preset.log" | tail -8 | cut -c1-240 ;;
  memories)
    M=(--forms chunk --dtype bfloat16 --device cuda --threads 0 --keep-going)
    step 150 mem_small python3 -m fastweights.cli bench speed --models gated_deltanet ttt_linear ttt_mlp titans \
      mesanet omeganet atlas --lengths 512 --batch 64 --heads 2 --dim 64 --repeats 3 --warmup 1 "${M[@]}" \
      --out "$W/mem_small"
    step 150 mem_lm python3 -m fastweights.cli bench speed --models gated_deltanet ttt_linear ttt_mlp titans \
      mesanet --lengths 4096 --batch 4 --heads 16 --dim 128 --repeats 3 --warmup 1 "${M[@]}" --out "$W/mem_lm"
    grep -E "^\|" "$W/mem_small/speed.md" "$W/mem_lm/speed.md" 2>/dev/null | cut -c1-200
    step 200 mem_train python3 -m fastweights.cli bench train --models softmax_attention gated_deltanet ttt_linear \
      mesanet ttt_mlp titans --d-model 1024 --n-layers 8 --num-heads 8 --head-dim 128 --head-v-dim 128 \
      --vocab-size 256 --shapes 4,4096 --steps 3 --warmup 1 --device cuda --dtype bfloat16 --cuda-graph \
      --keep-going --out "$W/mem_train"
    grep -E "^\| [a-z]" "$W/mem_train.log" | cut -c1-200
    step 100 ttt_post python3 scripts/gpu_ttt_mlp_sliced.py --memory ttt_linear --out "$W/ttt_post" \
      --phases check time --shapes lm --variants off carrydirect post postg --repeats 5
    grep -E "ms|worst" "$W/ttt_post.log" | tail -12 | cut -c1-220 ;;
  *) echo "unknown stage $stage (install warm ops lm memories)" >&2; exit 2 ;;
  esac
  keep
done
