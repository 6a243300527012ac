"""Context parallelism on GPUs against one GPU, in bf16 autocast (run under torchrun, one process a GPU; on a CPU
machine it runs on gloo in fp32 as a smoke test):

    torchrun --standalone --nproc_per_node 2 scripts/gpu_cp_check.py

Each rank builds the same LM (gated DeltaNet at the gpu-125m preset's head shape, 2 layers, its short convs) and
the same packed documents, runs the whole sequence alone (the reference) and its span under context parallelism,
and compares logits and every parameter gradient (summed over the ranks). The bf16 noise level is the reference's
own distance to an fp32 run; the spans must stay within 2× it (plus 1e-3). Prints one line per quantity and exits
1 if one fails."""

import sys

import torch
import torch.distributed as dist

from fastweights.distributed import ContextParallel
from fastweights.models import LM, LMConfig


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main() -> int:
    """The check (see the module doc); 1 if a quantity fails."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    cp = ContextParallel()
    T = 8192 if cuda else 96
    torch.manual_seed(0)
    lm = LM(LMConfig(vocab_size=256, d_model=256, n_layers=2, num_heads=2, head_dim=128, head_v_dim=128,
                     mixer="gated_deltanet")).to(dev)
    ids = torch.randint(0, 256, (1, T), device=dev)
    pos = torch.arange(T, device=dev)[None].clone()
    for c in (T // 7, T // cp.size, T // cp.size + 5):  # documents: one starts exactly at rank 1's first token
        pos[0, c:] = torch.arange(T - c, device=dev)
    w = torch.randn(1, T, 256, device=dev)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda)

    def grads_of(loss):
        return [torch.zeros_like(p) if g is None else g for p, g in
                zip(lm.parameters(), torch.autograd.grad(loss, list(lm.parameters()), allow_unused=True))]

    ref32 = lm(ids, position_ids=pos).float()
    g32 = grads_of((ref32 * w).sum())
    with amp:
        ref = lm(ids, position_ids=pos).float()
    gref = grads_of((ref * w).sum())
    with amp:
        got = lm(cp.shard(ids), position_ids=cp.shard(pos), context=cp).float()
    gcp = grads_of((got * cp.shard(w)).sum())
    for g in gcp:
        dist.all_reduce(g)
    rows = [("logits", rel(cp.shard(ref), cp.shard(ref32)), rel(got, cp.shard(ref)))]
    rows += [("grad " + n, rel(a, c), rel(b, a)) for (n, _), a, b, c in zip(lm.named_parameters(), gref, gcp, g32)]
    bad = [r for r in rows if r[2] > 2 * r[1] + 1e-3]
    if rank == 0:
        print(f"device {dev} ({torch.cuda.get_device_name(dev) if cuda else 'cpu'}), {cp.size} ranks, T {T}")
        print(f"{'quantity':<44} {'bf16 vs fp32':>12} {'spans vs one':>12}")
        for name, noise, err in rows:
            print(f"{name:<44} {noise:12.2e} {err:12.2e}{'  FAIL' if (name, noise, err) in bad else ''}")
        print("cp_check:", "FAIL" if bad else "ok", f"({len(rows)} quantities)")
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
