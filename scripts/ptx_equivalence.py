"""Does a change alter the GPU code of the Triton kernels? Compile them for Hopper (sm_90) on a
machine without a GPU, for two trees, and compare the PTX kernel by kernel.

A kernel verified on the H100 stays verified after a refactor only if the code the GPU runs is
the same. This script runs a fixed workload of the chunk pipelines (gated-linear and decay-first
delta class: every gate kind, fp32 and bf16, β, states, grouped heads, varlen; forward and backward)
with a stand-in driver that reports an sm_90 target: every `kernel[grid](...)` call compiles
(Triton → TTIR → TTGIR → LLVM → PTX, exactly as the GPU JIT specializes it from the arguments:
dtypes, 16-byte alignment, integer values) and nothing is launched — the outputs are left
unwritten, which does not matter to what is compiled next. Each launch's TTGIR (Triton's own IR after all
its passes — layouts, pipelining, tensor-core ops: where Triton's miscompiles live) is normalized
(locations and the signature dropped, SSA values renamed in order of first use, so renamed
variables and added arguments the code never reads do not count), and so is its PTX (debug
locations and comments dropped, parameters renamed after their arguments); `--compare OLD NEW`
says which launches differ at either level. Equal TTGIR with unequal PTX means LLVM ordered
instructions or numbered registers differently (e.g. after the parameter list changed).

    python3 scripts/ptx_equivalence.py --tree /path/to/old --out /tmp/old.json
    python3 scripts/ptx_equivalence.py --tree . --out /tmp/new.json
    python3 scripts/ptx_equivalence.py --compare /tmp/old.json /tmp/new.json

Needs triton (its bundled ptxas is not used: PTX is the comparison level, and ptxas is
deterministic on equal PTX). Run in a fresh process per tree (`--tree` is put first on sys.path).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys


def _conv_workload():
    """The short conv (`kernels.triton.layer.conv.short_conv`) forward and backward: bf16 and fp32, with and
    without tail, positions, bias and SiLU, a sliced input, both backwards (`one_pass_backward=`), at the default
    launch settings. A tree whose short_conv takes no `one_pass_backward` (before the pipelines refactor, where a
    module global picked the backward), or that has it at kernels/triton/conv.py (before the kernels were grouped
    into subpackages), is refused: run that tree's own copy of this script on it."""
    import inspect

    import torch

    try:
        from fastweights.kernels.triton.layer.conv import short_conv
    except ModuleNotFoundError:  # a tree from before kernels/triton was grouped into subpackages (conv.py at its top)
        print("error: this tree has no kernels/triton/layer/conv.py (a tree from before the kernels were grouped into "
              "subpackages): run that tree's scripts/ptx_equivalence.py", file=sys.stderr)
        raise SystemExit(2) from None

    if "one_pass_backward" not in inspect.signature(short_conv).parameters:
        print("error: this tree's short_conv takes no one_pass_backward argument (a tree from "
              "before the pipelines refactor): run that tree's scripts/ptx_equivalence.py", file=sys.stderr)
        raise SystemExit(2)
    gen = torch.Generator().manual_seed(0)
    B, T, C, W = 2, 300, 256, 4
    for one_pass, dtype in ((True, torch.bfloat16), (True, torch.float32), (False, torch.bfloat16),
                            (False, torch.float32)):  # both backwards: one pass, and the two kernels
        for tail_, pos_, bias_, act in ((False, False, False, "silu"), (True, True, True, "silu"),
                                        (True, False, False, None)):
            wide = torch.randn(B, T, C + 64, generator=gen).to(dtype)
            x = wide[..., 32:32 + C].requires_grad_(True) if not tail_ else torch.randn(
                B, T, C, generator=gen).to(dtype).requires_grad_(True)
            w = torch.randn(C, 1, W, generator=gen).requires_grad_(True)
            b = torch.randn(C, generator=gen).requires_grad_(True) if bias_ else None
            tail = torch.randn(B, W - 1, C, generator=gen).to(dtype).requires_grad_(True) if tail_ else None
            pos = (torch.arange(T) % 97).expand(B, T).contiguous() if pos_ else None
            y, new_tail = short_conv(x, w, b, tail, pos, act, one_pass_backward=one_pass)
            (y.float().sum() + new_tail.float().sum()).backward()


def _ttt_mlp_workload():
    """TTT-MLP's one-program kernels (`kernels.triton.memories.ttt_mlp`) at their default launch, forward and backward:
    D 64 and 128, F 4D, bf16 and fp32, offset 0 and 5 (a carried mini-batch), varlen with grouped heads."""
    import torch

    from fastweights.kernels.triton.memories.ttt_mlp import ttt_mlp_triton

    gen = torch.Generator().manual_seed(0)
    B, T, H = 2, 40, 2
    for D in (64, 128):
        F = 4 * D
        for dtype in (torch.bfloat16, torch.float32):
            q, k, v = (torch.randn(B, T, H, D, generator=gen).to(dtype).requires_grad_(True) for _ in range(3))
            beta = torch.rand(B, T, H, generator=gen).requires_grad_(True)
            lnw, lnb = torch.ones(H, D, requires_grad=True), torch.zeros(H, D, requires_grad=True)
            mlp = (torch.randn(B, H, D, F, generator=gen) * 0.1, torch.zeros(B, H, 1, F),
                   torch.randn(B, H, F, D, generator=gen) * 0.1, torch.zeros(B, H, 1, D))
            for offset in (0, 5):
                out = ttt_mlp_triton(q, k, v, beta, lnw, lnb, scale=0.1, weights=mlp, anchor=mlp if offset else None,
                                     offset=offset)
                out[0].float().sum().backward()
            cu = torch.tensor([0, 30, 31, 2 * T], dtype=torch.int32)
            three = tuple(torch.cat([w, w[:1]]) for w in mlp)
            out = ttt_mlp_triton(q[:, :, :1].reshape(1, B * T, 1, D), k[:, :, :1].reshape(1, B * T, 1, D),
                                 v.reshape(1, B * T, H, D), beta.reshape(1, B * T, H), lnw, lnb, scale=0.1,
                                 weights=three, cu_seqlens=cu)
            out[0].float().sum().backward()


def _titans_workload():
    """Titans' kernels (`kernels.triton.memories.titans`, both pipelines: "single" and "split") at their default
    launch, forward and backward: D 64 and 128, F 4D, bf16 and fp32, offset 0 and 5 (a carried mini-batch), varlen
    with grouped heads."""
    import torch

    from fastweights.kernels.triton.memories.titans import titans_triton

    gen = torch.Generator().manual_seed(0)
    B, T, H = 2, 40, 2
    for D in (64, 128):
        F = 4 * D
        for dtype in (torch.bfloat16, torch.float32):
            q, k, v = (torch.randn(B, T, H, D, generator=gen).to(dtype).requires_grad_(True) for _ in range(3))
            beta = torch.rand(B, T, H, generator=gen).requires_grad_(True)
            g, nu = -torch.rand(B, T, H, generator=gen), torch.rand(B, T, H, generator=gen)
            W = (torch.randn(B, H, D, F, generator=gen) * 0.1, torch.randn(B, H, F, D, generator=gen) * 0.1)
            M = (W[0] * 0.1, W[1] * 0.1)
            cu = torch.tensor([0, 30, 31, 2 * T], dtype=torch.int32)
            three = [tuple(torch.cat([w, w[:1]]) for w in t) for t in (W, M)]
            for pipeline in ("single", "split"):
                for offset in (0, 5):
                    out = titans_triton(q, k, v, g, beta, nu, scale=0.1, weights=W, momentum=M,
                                        anchor=W if offset else None, offset=offset, pipeline=pipeline)
                    out[0].float().sum().backward()
                out = titans_triton(q[:, :, :1].reshape(1, B * T, 1, D), k[:, :, :1].reshape(1, B * T, 1, D),
                                    v.reshape(1, B * T, H, D), g.reshape(1, B * T, H), beta.reshape(1, B * T, H),
                                    nu.reshape(1, B * T, H), scale=0.1, weights=three[0], momentum=three[1],
                                    cu_seqlens=cu, pipeline=pipeline)
                out[0].float().sum().backward()


def _workload(which: str = "chunk"):
    """The calls whose kernels are compared: chunk_gated_triton and chunk_delta_triton, decay first
    ("chunk"), the short conv ("conv", `_conv_workload`), TTT-MLP's kernels ("ttt_mlp", `_ttt_mlp_workload`) or
    Titans' ("titans", `_titans_workload`)."""
    if which == "conv":
        return _conv_workload()
    if which == "ttt_mlp":
        return _ttt_mlp_workload()
    if which == "titans":
        return _titans_workload()
    import torch

    from fastweights.kernels.triton.delta import chunk_delta_triton
    from fastweights.kernels.triton.gated import chunk_gated_triton

    gen = torch.Generator().manual_seed(0)

    def inputs(gate, dtype, B=2, T=200, H=4, Hq=2, K=128, V=128, S=None):
        q = torch.randn(B, T, Hq, K, generator=gen).to(dtype).requires_grad_(True)
        k = torch.randn(B, T, Hq, K, generator=gen).to(dtype).requires_grad_(True)
        v = torch.randn(B, T, H, V, generator=gen).to(dtype).requires_grad_(True)
        g = None
        if gate == "scalar":
            g = (-torch.rand(B, T, H, generator=gen)).requires_grad_(True)
        elif gate == "diagonal":
            g = (-torch.rand(B, T, H, K, generator=gen)).requires_grad_(True)
        beta = torch.rand(B, T, H, generator=gen).requires_grad_(True)
        S0 = torch.randn(S or B, H, K, V, generator=gen).requires_grad_(True)
        return q, k, v, g, beta, S0

    def backward(o, S):
        (o.float().sum() + S.float().sum()).backward()

    for fn in (chunk_delta_triton, chunk_gated_triton):
        for gate in ("none", "scalar", "diagonal"):
            for dtype in (torch.bfloat16, torch.float32):
                q, k, v, g, beta, S0 = inputs(gate, dtype)
                o, S = fn(q, k, v, g=g, beta=beta, scale=0.1, initial_state=S0, output_final_state=True,
                          chunk_size=64)
                backward(o, S)
            cu = torch.tensor([0, 70, 71, 200], dtype=torch.int32)  # varlen, B = 1
            q, k, v, g, beta, S0 = inputs(gate, torch.bfloat16, B=1, S=3)
            o, S = fn(q, k, v, g=g, beta=beta, scale=0.1, initial_state=S0, output_final_state=True,
                      chunk_size=64, cu_seqlens=cu)
            backward(o, S)


def _normalize(ptx: str, names: list[str]) -> str:
    """PTX without debug locations/sections and comments, parameters named after their arguments."""
    lines = []
    skip = False
    for line in ptx.splitlines():
        s = line.strip()
        if s.startswith(".section") and "debug" in s:
            skip = True
        if skip:
            if s == "}":
                skip = False
            continue
        if s.startswith((".loc", ".file", "//", "$L__tmp", "$L__func")) or not s:
            continue
        lines.append(line.split("//")[0].rstrip())
    text = "\n".join(lines)
    params = re.findall(r"\.param \.\S+(?: \.ptr \.global \.align \d+)? (\w+_param_(\d+))", text)
    for full, idx in params:
        i = int(idx)
        text = re.sub(rf"\b{full}\b", f"PARAM<{names[i] if i < len(names) else idx}>", text)
    # the parameter list itself: keep only the parameters the body reads
    body_start = text.find(")")
    header, body = text[:body_start], text[body_start:]
    used = set(re.findall(r"PARAM<(\w+)>", body))
    header = "\n".join(ln for ln in header.splitlines()
                       if "PARAM<" not in ln or any(f"PARAM<{u}>" in ln for u in used))
    return header + body


def _normalize_ttgir(ttgir: str) -> str:
    """TTGIR (Triton's GPU IR after all its passes: layouts, pipelining, wgmma) without locations
    and the function signature, every SSA value renamed in order of first use — so renamed Python
    variables, reordered or added (unread) arguments leave it unchanged."""
    body = []
    for line in ttgir.splitlines():
        s = line.strip()
        if s.startswith("#loc") or s.startswith("tt.func"):
            continue
        body.append(re.sub(r"\s*loc\((?:[^()]|\([^()]*\))*\)", "", line).rstrip())
    text = "\n".join(body)
    names: dict[str, str] = {}
    return re.sub(r"%[A-Za-z_0-9][\w.#]*", lambda m: names.setdefault(m.group(0), f"%v{len(names)}"), text)


def _standin():
    """This repository's `fastweights/kernels/triton/common/standin.py`, loaded by its path: `collect` imports another
    tree's fastweights (maybe one from before the module existed), and the driver stand-in is the same for both."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fastweights", "kernels", "triton",
                        "common", "standin.py")
    spec = importlib.util.spec_from_file_location("_fastweights_standin", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def collect(tree: str, out: str, workload: str = "chunk") -> None:
    sys.path.insert(0, os.path.abspath(tree))
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.runtime.jit import JITFunction

    _standin().install_sm90_driver()
    records = []
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        sig = kernel.src.signature
        names = [n for n, t in sig.items() if t != "constexpr"]
        records.append({"kernel": self.__name__, "ptx": _normalize(kernel.asm["ptx"], names),
                        "ttgir": _normalize_ttgir(kernel.asm["ttgir"]),
                        "constexprs": {str(k): repr(v) for k, v in kernel.src.constants.items()}})
        return kernel

    JITFunction.run = compile_only
    _workload(workload)
    with open(out, "w") as f:
        json.dump({"tree": os.path.abspath(tree), "triton": triton.__version__, "launches": records}, f)
    print(f"{len(records)} launches compiled for sm_90 from {tree} -> {out}")


def compare(a: str, b: str) -> int:
    A, B = json.load(open(a))["launches"], json.load(open(b))["launches"]
    if [r["kernel"] for r in A] != [r["kernel"] for r in B]:
        print(f"the launch sequences differ: {len(A)} vs {len(B)} launches")
        print("old:", [r["kernel"] for r in A])
        print("new:", [r["kernel"] for r in B])
        return 1
    kinds = sorted({r["kernel"] for r in A})
    ptx = [i for i, (r, s) in enumerate(zip(A, B)) if r["ptx"] != s["ptx"]]
    ir = [i for i, (r, s) in enumerate(zip(A, B)) if r["ttgir"] != s["ttgir"]]
    print(f"{len(A)} launches of {len(kinds)} kernels: TTGIR identical in {len(A) - len(ir)}, "
          f"PTX identical in {len(A) - len(ptx)}")
    for i in ir:
        print(f"  TTGIR differs: launch {i}, {A[i]['kernel']}")
    only_ptx = sorted({A[i]["kernel"] for i in ptx if i not in ir})
    if only_ptx:
        print(f"  PTX differs with the same TTGIR (LLVM's instruction order and register numbering after the "
              f"kernel's parameters moved): {', '.join(only_ptx)}")
    return 1 if ir else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", default=".")
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    ap.add_argument("--workload", choices=("chunk", "conv", "ttt_mlp", "titans"), default="chunk",
                    help="the chunk pipelines (default), the short conv's kernels, TTT-MLP's or Titans'")
    a = ap.parse_args()
    if a.compare:
        sys.exit(compare(*a.compare))
    if not a.out:
        ap.error("--out is required with --tree")
    collect(a.tree, a.out, a.workload)


if __name__ == "__main__":
    main()
