"""r4s11 call 7: ATLAS at issue 36's small shape (B 64, T 512, H 2, K = V = 64, bf16, `fw.chunk` on the row "auto" picks):
the peak memory and time of one forward + backward, the first (compiles included) and a second, at checkpoint_chain
0 then 4 — each printed as soon as it is measured (scripts/gpu_memories.py's peak row runs four and was cut at 75 s)."""
import json
import sys
import time

import torch

from fastweights.bench.speed import fastweights_case, fwd_bwd
from fastweights.chunkwise import minibatch

for k in map(int, sys.argv[1:] or ["0", "4"]):
    minibatch.checkpoint_chain(k)
    run, leaves = fastweights_case("atlas", "chunk", 64, 512, 2, 64, torch.bfloat16, "cuda", 64)
    _, fb = fwd_bwd(run, leaves)
    for i in range(2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        try:
            fb()
            torch.cuda.synchronize()
            row = dict(chain=k, call=i, s=round(time.perf_counter() - t, 2),
                       peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
        except torch.OutOfMemoryError as e:
            row = dict(chain=k, call=i, error=str(e).splitlines()[0][:160])
        print(json.dumps(row), flush=True)
        if "error" in row:
            break
