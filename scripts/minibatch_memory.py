"""What one `fw.chunk` forward of a mini-batch memory (OmegaNet, ATLAS, TTT, Titans) keeps for its backward, per
token and head — and, on a GPU, the peak of a whole forward + backward at a given shape.

Saved bytes: `torch.autograd.graph.saved_tensors_hooks` records every tensor autograd saves (distinct storages, a
view of a saved one counts once) during one forward at B = 1, H = 1 and two lengths T₁ < T₂ (fp32, any device);
the slope (bytes(T₂) − bytes(T₁)) / (T₂ − T₁) is the per-token cost (what does not grow with T cancels), with the
source lines it came from (--by-line). The prediction at [B, T, H] is slope · B · T · H (the saved tensors only;
the peak adds the forward's and backward's transients). --peak (CUDA) runs one forward + backward of
`fw.chunk` at --shape in --dtype and reports torch.cuda.max_memory_allocated.

    python scripts/minibatch_memory.py --models omeganet atlas --D 64 --by-line
    python scripts/minibatch_memory.py --models omeganet atlas --D 64 --peak --device cuda --shape 64 512 2 --out DIR

--split N sets `fastweights.chunkwise.minibatch.split_readout(N)` (0: every gd / momentum readout segment by
segment); without it, the library's default.
"""

from __future__ import annotations

import argparse
import json
import traceback
from collections import defaultdict
from pathlib import Path

import torch

import fastweights as fw
from fastweights.chunkwise import minibatch
from fastweights.state import state_tensors


def _inputs(model, B, T, H, D, dtype, device, grad=True):
    inp = fw.example_inputs(model, batch_size=B, seq_len=T, num_heads=H, head_dim=D, dtype=dtype, device=device,
                            requires_grad=grad)
    return inp, inp.pop("initial_state", None)


def saved_bytes(model, T, D, device="cpu", by_line=False):
    """(bytes autograd saves in one fp32 forward at B 1, H 1, T tokens, {(source line, shape): bytes})."""
    torch.manual_seed(0)
    inp, st = _inputs(model, 1, T, 1, D, torch.float32, device)
    seen, where = {}, defaultdict(int)

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen[key] = t.untyped_storage().nbytes()
            if by_line:
                fr = [f for f in traceback.extract_stack() if "fastweights" in f.filename]
                at = f"{Path(fr[-1].filename).name}:{fr[-1].lineno} {fr[-1].name}" if fr else "?"
                where[(at, tuple(t.shape))] += seen[key]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fw.chunk(model, initial_state=st, output_final_state=True, check_values=False, **inp)
    return sum(seen.values()), where


def cpu_peak(model, T, D, B=1, H=1):
    """Peak bytes of tensor storages alive during one fp32 fw.chunk forward + backward on the CPU (the inputs and
    initial state not counted): `fastweights.bench.memory.cpu_peak_bytes`."""
    from fastweights.bench.memory import cpu_peak_bytes

    torch.manual_seed(0)
    inp, st = _inputs(model, B, T, H, D, torch.float32, "cpu")

    def fwd_bwd():
        o, fin = fw.chunk(model, initial_state=st, output_final_state=True, check_values=False, **inp)
        loss = o.sum() + sum(t.sum() for t in state_tensors(fin))
        leaves = [t for t in inp.values() if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.autograd.grad(loss, leaves, allow_unused=True)

    return cpu_peak_bytes(fwd_bwd)


def cuda_peak(model, B, T, H, D, dtype):
    """torch.cuda.max_memory_allocated (bytes) of one fw.chunk forward + backward, and its seconds."""
    import time

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    inp, st = _inputs(model, B, T, H, D, dtype, "cuda")
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    o, fin = fw.chunk(model, initial_state=st, output_final_state=True, check_values=False, **inp)
    loss = o.float().sum() + sum(t.float().sum() for t in state_tensors(fin))
    leaves = [t for t in inp.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.autograd.grad(loss, leaves, allow_unused=True)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["omeganet", "atlas"])
    ap.add_argument("--D", type=int, default=64, help="K = V")
    ap.add_argument("--lengths", type=int, nargs=2, default=[64, 128], help="T₁ T₂ of the slope")
    ap.add_argument("--shape", type=int, nargs=3, default=[64, 512, 2], metavar=("B", "T", "H"),
                    help="where to predict (and, with --peak, run)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", help="--peak's input dtype")
    ap.add_argument("--split", type=int, default=None, help="minibatch.split_readout(N)")
    ap.add_argument("--chain", type=int, default=0, help="minibatch.checkpoint_chain(k) for --peak")
    ap.add_argument("--by-line", action="store_true")
    ap.add_argument("--cpu-peak", action="store_true", help="also the CPU fwd+bwd peak of live storages, per token")
    ap.add_argument("--cpu-peak-B", type=int, default=1, help="--cpu-peak's batch (B·H the loop batches over)")
    ap.add_argument("--peak", action="store_true", help="also one fwd+bwd at --shape on CUDA: its peak")
    ap.add_argument("--out", default=None, help="write memory.json here")
    a = ap.parse_args(argv)
    if a.split is not None:
        minibatch.split_readout(a.split)
    B, T, H = a.shape
    rows = []
    for m in a.models:
        (t1, t2) = a.lengths
        s1, _ = saved_bytes(m, t1, a.D, a.device)
        s2, where = saved_bytes(m, t2, a.D, a.device, a.by_line)
        per = (s2 - s1) / (t2 - t1)
        row = dict(model=m, D=a.D, saved_per_token_head=per, predicted_saved_GiB=per * B * T * H / 2 ** 30,
                   shape=[B, T, H])
        print(f"{m:10s} D {a.D}: saved {per / 1024:8.1f} KiB a token and head -> {row['predicted_saved_GiB']:7.2f} "
              f"GiB saved at B {B}, T {T}, H {H}")
        if a.cpu_peak:
            p1, p2 = cpu_peak(m, t1, a.D, a.cpu_peak_B, 1), cpu_peak(m, t2, a.D, a.cpu_peak_B, 1)
            pp = (p2 - p1) / (t2 - t1) / a.cpu_peak_B
            row.update(cpu_peak_per_token_head=pp, cpu_peak_at_T2=p2, predicted_peak_GiB=pp * B * T * H / 2 ** 30)
            print(f"    CPU fwd+bwd peak {p2 / 2 ** 20:.1f} MiB at B {a.cpu_peak_B}, T {t2}, H 1: slope "
                  f"{pp / 1024:.1f} KiB a token and head -> {row['predicted_peak_GiB']:.2f} GiB at B {B}, T {T}, H {H} "
                  f"(fp32, the T-independent part left out)")
        if a.by_line:
            for (at, shape), nb in sorted(where.items(), key=lambda kv: -kv[1])[:12]:
                print(f"    {nb / t2 / 1024:8.2f} KiB/token  {at}  {list(shape)}")
        if a.peak:
            minibatch.checkpoint_chain(a.chain)
            try:
                peak, sec = cuda_peak(m, B, T, H, a.D, getattr(torch, a.dtype))
                row.update(peak_GiB=peak / 2 ** 30, seconds=sec)
                print(f"    peak {peak / 2 ** 30:.2f} GiB, {sec:.2f} s (first call, compiles included)")
            except torch.cuda.OutOfMemoryError as e:
                row.update(peak_GiB=None, error=str(e)[:300])
                print(f"    out of memory: {str(e)[:200]}")
            finally:
                minibatch.checkpoint_chain(0)
                torch.cuda.empty_cache()
        rows.append(row)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "memory.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
