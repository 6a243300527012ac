"""Micro-benchmark of one MemoryMixer with its Triton layer ops and with their torch ops.

    python3 scripts/bench_layer.py --out runs/bench/layer.md                  # CUDA, the anchor shape
    python3 scripts/bench_layer.py --device cpu --tiny --out /tmp/layer.md    # a check that it runs

Times the layer's forward (gradients off) and forward + backward (of y.sum(), parameter and input
gradients) with layer_ops="triton" (short conv, the delta prologue and the gated output norm as
Triton kernels) and layer_ops="torch" (the layers' torch ops), the same weights; the memory runs
the same backend in both. Default shape: gated DeltaNet, d_model 2,048, 16 heads of 128
(K = V = 128), B = 4, T = 4,096, bf16 parameters and input. Median of --repeats calls after
--warmup calls, each timed between CUDA synchronizations. On the CPU the fused paths run under
Triton's interpreter (TRITON_INTERPRET=1 is set here, and the Triton layer-op rows are let serve
CPU calls): a check that the script works, not a timing.
Writes a Markdown table to --out and prints it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's fastweights


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gated_deltanet")
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--num-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--head-v-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="auto", help="the memory's backend (the same for both paths)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="d_model 64, 2 heads of 16, B = 2, T = 33, 2 repeats")
    ap.add_argument("--out", required=True, help="the Markdown table is written here")
    a = ap.parse_args(argv)
    if a.tiny:
        a.d_model, a.num_heads, a.head_dim, a.head_v_dim, a.batch, a.seq_len = 64, 2, 16, 16, 2, 33
        a.warmup, a.repeats = 1, 2
    if a.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (the kernels import it on first use)

    import torch

    from fastweights.dispatch import DISPATCH, LAYER
    from fastweights.layers import MemoryMixer

    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is present (use --device cpu --tiny to check the script)",
              file=sys.stderr)
        return 2
    dtype = getattr(torch, a.dtype)
    if dev.type == "cpu":  # the Triton layer-op rows ask for CUDA: under the interpreter, let them serve the CPU
        import dataclasses

        for key, impl in list(DISPATCH.items()):
            if key[0] == LAYER and key[2] == "triton":
                DISPATCH[key] = dataclasses.replace(impl, supports=lambda recipe, target: None)
    torch.manual_seed(0)
    layers = {}
    for ops in ("triton", "torch"):
        with torch.device(dev):
            layers[ops] = MemoryMixer(a.d_model, a.model, a.num_heads, head_dim=a.head_dim, head_v_dim=a.head_v_dim,
                                      backend=a.backend, layer_ops=ops).to(dtype)
    layers["torch"].load_state_dict(layers["triton"].state_dict())
    layer = layers["triton"]
    x = torch.randn(a.batch, a.seq_len, a.d_model, device=dev, dtype=dtype)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def forward():
        with torch.no_grad():
            layer(x)

    def forward_backward():
        xi = x.detach().requires_grad_(True)
        y, _ = layer(xi)
        y.float().sum().backward()
        layer.zero_grad(set_to_none=True)

    def median_ms(fn):
        for _ in range(a.warmup):
            fn()
        times = []
        for _ in range(a.repeats):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)

    rows = {}
    for name, ops in (("fused (Triton conv, prologue, norm)", "triton"), ("torch ops", "torch")):
        layer = layers[ops]
        rows[name] = (median_ms(forward), median_ms(forward_backward))
    (f_on, fb_on), (f_off, fb_off) = rows.values()

    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = "not installed"
    lines = [
        f"# MemoryMixer {a.model}: fused layer kernels on / off",
        "",
        f"d_model {a.d_model}, {a.num_heads} heads, K = {a.head_dim}, V = {a.head_v_dim}, B = {a.batch}, "
        f"T = {a.seq_len}, {a.dtype}; memory backend `{layer.backend}`; {device_name}; torch {torch.__version__}, "
        f"triton {tv}; median of {a.repeats} after {a.warmup} warm-up calls"
        + (" (CPU: the kernels ran under Triton's interpreter — not a timing)" if dev.type == "cpu" else ""),
        "",
        "| path | forward (ms) | forward + backward (ms) |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {f:.2f} | {fb:.2f} |" for name, (f, fb) in rows.items()]
    lines.append(f"| torch / fused | {f_off / f_on:.2f}× | {fb_off / fb_on:.2f}× |")
    text = "\n".join(lines) + "\n"
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
