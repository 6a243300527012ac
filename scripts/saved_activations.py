"""Which tensors an LM step keeps for its backward, by module: the activation memory behind `bench
train`'s peak, counted on any device (no CUDA allocator needed).

Builds `LM(LMConfig(...))` like `fastweights bench train`, runs one forward under bf16 autocast with
`torch.autograd.graph.saved_tensors_hooks` recording every tensor autograd saves (deduplicated by
storage: a tensor saved twice, or a view of a saved one, counts once) and attributes it to the
innermost module running when it was saved. Two runs, at T and 2T, give each module's saved bytes
per token as the slope (what does not grow with T — bf16 casts of the weights, which autocast saves
— cancels); printed per module class, with the total.

    TRITON_INTERPRET=1 python3 scripts/saved_activations.py --models gated_deltanet softmax_attention \\
        --d-model 1024 --num-heads 8 --head-dim 128 --seq-len 256 --fused

--fused asks for the Triton rows: the layer ops (LMConfig.layer_ops="triton") and the memory's
backend (on a CPU only under TRITON_INTERPRET=1, the Triton rows then let serve CPU calls: slow but
exact in what is saved); without it, the layers' torch ops (layer_ops="torch"). The bytes
scale linearly in B·T (the delta class's per-chunk states too), so a small T gives the per-token
cost of the anchor shape.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch


def saved_bytes(model: str, *, d_model: int, num_heads: int, head_dim: int, vocab_size: int, B: int, T: int,
                fused: bool, device: str) -> tuple[dict, list, int]:
    import dataclasses

    from fastweights import zoo
    from fastweights.dispatch import DISPATCH

    backend = "triton" if fused and not zoo.resolve(model).is_softmax else "auto"
    before = dict(DISPATCH)
    try:
        # the Triton rows ask for CUDA: under the interpreter, let them (for this call only: restored below)
        if fused and torch.device(device).type == "cpu":
            for key, impl in list(DISPATCH.items()):
                if key[2] == "triton":
                    DISPATCH[key] = dataclasses.replace(impl, supports=lambda recipe, target: None)
        return _saved_bytes(model, backend, d_model=d_model, num_heads=num_heads, head_dim=head_dim,
                            vocab_size=vocab_size, B=B, T=T, fused=fused, device=device)
    finally:
        DISPATCH.clear()
        DISPATCH.update(before)


def _saved_bytes(model: str, backend: str, *, d_model, num_heads, head_dim, vocab_size, B, T, fused, device):
    from fastweights.models import LM, LMConfig

    cfg = LMConfig(vocab_size=vocab_size, d_model=d_model, n_layers=1, num_heads=num_heads, head_dim=head_dim,
                   mixer=model, backend=backend, layer_ops="triton" if fused else "torch")
    with torch.device(device):
        lm = LM(cfg)
    stack: list[str] = ["LM"]
    # a mixer's projections of x run as one matmul only while none of them is hooked (`MemoryMixer._project`,
    # so that adapters and hooks apply): they stay unhooked, and what the joint matmul keeps counts as the mixer's
    joint = {id(m.get_submodule(path)) for m in lm.modules() if hasattr(m, "joint_projections")
             for _, path in m.joint_projections}
    for mod in lm.modules():
        if id(mod) in joint:
            continue
        label = type(mod).__name__
        mod.register_forward_pre_hook(lambda m, a, label=label: stack.append(label) and None)
        mod.register_forward_hook(lambda m, a, o: stack.pop() and None)  # a hook's return replaces the output
    seen: dict[tuple, tuple[str, int, str]] = {}

    def pack(t):
        if t.device.type != "meta" and t.untyped_storage().nbytes():
            key = (t.untyped_storage().data_ptr(), t.device.type)
            if key not in seen:
                seen[key] = (stack[-1], t.untyped_storage().nbytes(), f"{list(t.shape)} {t.dtype}")
        return t

    ids = torch.randint(0, vocab_size, (B, T + 1), device=device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        logits = lm(ids[:, :-1])
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    by_module: dict[str, int] = defaultdict(int)
    for mod, n, _ in seen.values():
        by_module[mod] += n
    largest = sorted(seen.values(), key=lambda r: -r[1])
    return dict(by_module), largest, sum(by_module.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["gated_deltanet", "softmax_attention"])
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--num-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--fused", action="store_true")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    kw = dict(d_model=a.d_model, num_heads=a.num_heads, head_dim=a.head_dim, vocab_size=a.vocab_size, B=a.batch,
              fused=a.fused, device=a.device)
    tokens = a.batch * a.seq_len  # the extra tokens of the second run
    for m in a.models:
        one, _, _ = saved_bytes(m, T=a.seq_len, **kw)
        two, largest, _ = saved_bytes(m, T=2 * a.seq_len, **kw)
        slope = {mod: (two.get(mod, 0) - one.get(mod, 0)) / tokens for mod in set(one) | set(two)}
        total = sum(slope.values())
        how = "fused layer kernels, Triton memory" if a.fused else "torch ops"
        print(f"## {m}: saved bytes per token, one layer + embedding and head ({how}; T = {a.seq_len} and "
              f"{2 * a.seq_len})")
        print("| module | bytes per token | share |\n|---|---:|---:|")
        for mod, n in sorted(slope.items(), key=lambda kv: -kv[1]):
            if abs(n) >= 1:
                print(f"| {mod} | {n:,.0f} | {n / total:.0%} |")
        print(f"| **total** | **{total:,.0f}** | |\nlargest at T = {2 * a.seq_len}: " +
              "; ".join(f"{mod} {shape} {n / 2**20:.2f} MiB" for mod, n, shape in largest[:8]) + "\n")


if __name__ == "__main__":
    main()
