"""Micro-benchmark of the joint q|k|v short conv (`kernels.triton.layer.conv.short_conv_joint`: one launch each way
on the q|k|v columns of the joint projection, dx in one tensor) against the three per-conv calls it replaces
(`short_conv` on each column view), at the gated-DeltaNet LM preset's shape (issue 32).

    python3 scripts/bench_conv_joint.py --out $OUT/conv_joint.json                       # CUDA (< 1 min)
    python3 scripts/bench_conv_joint.py --bwd BT=32,BC=32 --out $OUT/conv_joint.json     # backward launch settings
    python3 scripts/bench_conv_joint.py --rows ON=1,RUN=128 --out $OUT/conv_rows.json     # the row-streaming backward
    TRITON_INTERPRET=1 python3 scripts/bench_conv_joint.py --device cpu --tiny --out /tmp/cj.json   # runs at all

Shape (defaults): B = 8, T = 2,048, q, k, v of C = 768 channels each, W = 4, SiLU, no bias, bf16, read from a joint
projection Y [B, T, 3,088] (q k v a b z and padding: the preset's row stride). Each path is the model's wiring:
the split of Y into q|k|v and the rest, the convs, and the backward through the split: per conv, Y.split into
q, k, v, rest (its backward a cat of all of dY's columns); joint, `kernels.split_into_grad_buffer` into q|k|v and the
rest with `short_conv_joint(..., grad_in_base=True)` (dx written as the q|k|v columns of a [B, T, R] buffer, the
split's backward zero-filling only the other columns: no cat).
First a check that the joint path equals the per-conv path bitwise (y, dY, dw) at this shape. Then forward (no
autograd), backward alone (autograd.grad of the outputs with fixed dy through a retained graph: dY, dw) and
forward + backward, median of --repeats calls after --warmup, between CUDA events behind a ~1 ms GPU sleep.
Printed and written to --out (JSON): ms per path and the joint/per-conv ratio. --bwd / --fwd override
util.LAUNCH's "conv_bwd_fused" / "conv_fwd" keys (e.g. BT=32,BC=32,NBLK=8,DW_ACC=1), --rows "conv_bwd_rows"'s (ON=1:
the row-streaming backward, `_conv_bwd_rows`; its bitwise check against the per-conv path covers y and dY only where
torch sums dw's partial rows in another order — a FAIL there names which).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's fastweights

from scripts.bench_conv import behind_sleep_ms, parse_settings  # noqa: E402  (the settings parser, the timer)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--channels", type=int, default=768, help="C of each of q, k, v")
    ap.add_argument("--row", type=int, default=3088, help="the joint projection's row stride (ΣN + padding)")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--fwd", default="", help="util.LAUNCH['conv_fwd'] overrides, e.g. BT=64,BC=64")
    ap.add_argument("--bwd", default="", help="util.LAUNCH['conv_bwd_fused'] overrides, e.g. BT=32,BC=32")
    ap.add_argument("--rows", default="", help="util.LAUNCH['conv_bwd_rows'] overrides: ON=1 takes the row-streaming "
                    "backward (both paths), e.g. ON=1,RUN=128,BC=256,num_warps=2")
    ap.add_argument("--tiny", action="store_true", help="B 2, T 37, C 20, row 80: a check that it runs")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    import torch

    from fastweights.kernels import split_into_grad_buffer
    from fastweights.kernels.triton.common import util
    from fastweights.kernels.triton.layer.conv import short_conv, short_conv_joint

    if a.tiny:
        a.batch, a.seq, a.channels, a.row, a.warmup, a.repeats = 2, 37, 20, 80, 1, 2
    util.LAUNCH["conv_fwd"].update(parse_settings(a.fwd))
    util.LAUNCH["conv_bwd_fused"].update(parse_settings(a.bwd))
    util.LAUNCH["conv_bwd_rows"].update(parse_settings(a.rows))
    dev = torch.device(a.device)
    B, T, C, R, W = a.batch, a.seq, a.channels, a.row, a.width
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    Y = torch.randn(B, T, R, generator=gen).to(dev, dtype).requires_grad_(True)
    ws = [(torch.randn(C, 1, W, generator=gen) / W ** 0.5).to(dev).requires_grad_(True) for _ in range(3)]
    dys = [torch.randn(B, T, C, generator=gen).to(dev, dtype) for _ in range(3)]

    def joint():
        qkv, _ = split_into_grad_buffer(Y, [3 * C, R - 3 * C])
        return short_conv_joint(qkv, ws, grad_in_base=True)[0]

    def per_conv():
        parts = Y.split([C, C, C, R - 3 * C], dim=-1)
        return [short_conv(parts[i], ws[i])[0] for i in range(3)]

    def grads(ys):
        return torch.autograd.grad(ys, [Y] + ws, dys, retain_graph=True)

    # the check: bitwise equal
    yj, yp = joint(), per_conv()
    gj, gp = grads(yj), grads(yp)
    eq_y = all(torch.equal(u, v) for u, v in zip(yj, yp))
    eq_dy = torch.equal(gj[0], gp[0])
    dw_diff = max((u - v).abs().max().item() for u, v in zip(gj[1:], gp[1:]))
    equal = eq_y and eq_dy
    print(f"check joint == per-conv bitwise: y {'ok' if eq_y else 'FAIL'}, dY {'ok' if eq_dy else 'FAIL'}, "
          f"dw max |diff| {dw_diff:.1e} (0: bitwise)")

    def timer(fn) -> float:
        return behind_sleep_ms(fn, dev, a.warmup, a.repeats)

    launch = {k: dict(util.LAUNCH[k]) for k in ("conv_fwd", "conv_bwd_fused", "conv_bwd_rows")}
    out = {"shape": dict(B=B, T=T, C=C, row=R, W=W, dtype="bfloat16"), "launch": launch, "bitwise_equal": equal,
           "dw_max_diff": dw_diff, "ms": {}}
    for name, fn in (("joint", joint), ("per_conv", per_conv)):
        with torch.no_grad():
            fwd = timer(fn)
        ys = fn()
        bwd = timer(lambda ys=ys: grads(ys))
        both = timer(lambda fn=fn: torch.autograd.grad(fn(), [Y] + ws, dys))
        out["ms"][name] = {"forward": fwd, "backward": bwd, "forward+backward": both}
        print(f"{name:9s} forward {fwd:.3f} ms, backward {bwd:.3f} ms, forward+backward {both:.3f} ms")
    out["ratio_joint_over_per_conv"] = {k: out["ms"]["joint"][k] / out["ms"]["per_conv"][k]
                                        for k in out["ms"]["joint"]}
    print("joint / per-conv: " + ", ".join(f"{k} {v:.2f}" for k, v in out["ratio_joint_over_per_conv"].items()))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
