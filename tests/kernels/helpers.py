"""Helpers shared by the kernel tests (gated-linear and delta pipelines, the decode step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.tolerances import LOG_DECAY_GRAD_F32_REL

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b, of=None) -> float:
    """max |a − b| / max |b| (or / max |`of`|), in float64 on a's device (b moved there): the subtraction, |·|, max
    and the quotient round alike on any device, so the CPU's and the GPU's numbers are the same; on the GPU the
    GiB-sized realistic tests' comparisons skip two host copies and a single-threaded pass each."""
    a = a.double()
    b = b.to(a.device).double()
    of = b if of is None else of.to(a.device).double()
    return ((a - b).abs().max() / of.abs().max().clamp_min(1e-30)).item()


def to_dev(x: dict) -> dict:
    return {key: val.to(DEV) for key, val in x.items()}


def projection(outs, seed):
    """Σ ⟨out, R⟩ over `outs` in turn, in float64, each R standard normal from `seed` (drawn on the CPU: the same
    projection whatever the device): the scalar loss whose gradients the kernel tests compare. Prints the seed, as
    the `gen` fixture prints the inputs' (tests/kernels/conftest.py), so a failure's captured output holds both and
    the case can be replayed."""
    print(f"projection seed={seed}")
    g = torch.Generator().manual_seed(seed)
    return sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)).sum() for o in outs)


def grads(fn, x, seed, **kw):
    """(o, S_T, {input: gradient}) of a random projection of o and S_T (`projection`, from `seed`)."""
    leaves = {key: val.detach().clone().requires_grad_(True) for key, val in x.items()}
    o, S = fn(leaves, **kw)
    gs = torch.autograd.grad(projection((o, S), seed), list(leaves.values()))
    return o.detach(), S.detach(), dict(zip(leaves, gs))


def check(got, want, tol, what="", *, scales=None):
    """Outputs, final states and every gradient of `grads` results within `tol` of each other; the log-decay's
    gradient dg within max(`tol`, LOG_DECAY_GRAD_F32_REL) (it sums the others' products over the head dims, and
    they cancel: in fp32 its rounding is above the others'). `scales` {input: a tensor of its gradient's shape}: that
    gradient's largest error relative to the largest of the scale (the size of its summands, e.g.
    `delta_summand_scales`) instead of to its own largest entry — for a gradient that is a short sum whose terms can
    cancel (dβ at T = 1: one token's two terms), where rounding is relative to the terms, not to what is left."""
    o1, s1, g1 = got
    o2, s2, g2 = want
    scales = scales or {}
    assert rel(o1, o2) < tol, f"o {what}"
    assert rel(s1, s2) < tol, f"final state {what}"
    assert set(g1) == set(g2) and set(scales) <= set(g2)
    for name in g2:
        t = max(tol, LOG_DECAY_GRAD_F32_REL) if name == "g" else tol
        err = rel(g1[name], g2[name], scales.get(name))
        assert err < t, f"d{name} {what}: {err:.3g} ≥ {t:g}" + (" (of its summands' scale)" if name in scales else "")


def each_sequence_alone(rec, cu):
    """A function of the packed inputs that runs `rec` on each sequence of `cu` by itself (an empty
    one: no output, its state unchanged) and concatenates: the reference of a varlen call."""
    def alone(xd):
        outs, finals = [], []
        for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            part = {key: (val[s:s + 1] if key == "S0" else val[:, a:b]) for key, val in xd.items()}
            if b == a:
                outs.append(xd["v"][:, a:b].flatten(1, -3) * 0)  # [B, 0, H, V] (DeltaProduct's v has n too)
                finals.append(part["S0"] + 0 * xd["v"].sum())
                continue
            o, S = rec(part)
            outs.append(o)
            finals.append(S)
        return torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    return alone


def chunk_rows_agree(model: str, gen, tol: float) -> None:
    """The chunk triton row's fn and the torch row's on one validated Call (T = 21, a random initial
    state): outputs and final states within `tol`. The triton row is called directly (on the CPU
    under the interpreter), because its predicate asks for CUDA."""
    import fastweights as fw
    from fastweights.dispatch import DISPATCH, Call
    from fastweights.inputs import validate

    recipe = fw.zoo.get(model)
    cls = fw.recipe_class(recipe)
    x = fw.example_inputs(model, batch_size=1, seq_len=21, num_heads=2, head_dim=16, generator=gen)
    x.pop("initial_state", None)
    S0 = 0.3 * torch.randn(1, 2, 16, 16, generator=gen)

    def run(backend, device):
        d = {key: val.to(device) for key, val in x.items()}
        q, k, v = d.pop("q"), d.pop("k"), d.pop("v")
        call = Call(recipe=recipe, q=q, k=k, v=v, inputs=d, shapes=validate(recipe, q, k, v, d), scale=0.25,
                    initial_state=S0.to(device), output_final_state=True)
        return DISPATCH[(cls, "chunk", backend)].fn(call, chunk_size=16)

    o1, S1 = run("triton", DEV)
    o2, S2 = run("torch", "cpu")
    assert rel(o1, o2) < tol and rel(S1, S2) < tol


def delta_inputs(gate, gen, *, B=1, T=37, H=1, Hq=None, K=12, V=10, N=None, g_scale=1.0, n=0, probe=False,
                 dtype=torch.float32):
    """The delta-class kernels' inputs, fresh from `gen`: q, k [B, T, H_q, K] (unit keys), v [B, T, H, V],
    β ∈ (0, 1.5) [B, T, H], g (gate "none", "scalar" [B, T, H] or "diagonal" [B, T, H, K], log-sigmoid
    × g_scale), S0 [N or B, H, K, V]; with `probe` also p [B, T, H_q, K] (unit; Comba); with n ≥ 1
    DeltaProduct's k [B, T, n, H_q, K], v [B, T, n, H, V], β [B, T, n, H]."""
    Hq = H if Hq is None else Hq
    steps = (n,) if n else ()

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = {"q": rnd(B, T, Hq, K), "k": F.normalize(rnd(B, T, *steps, Hq, K), dim=-1), "v": rnd(B, T, *steps, H, V),
         "beta": 1.5 * torch.rand(B, T, *steps, H, generator=gen, dtype=torch.float64),
         "S0": 0.3 * rnd(N or B, H, K, V)}
    if probe:
        x["p"] = F.normalize(rnd(B, T, Hq, K), dim=-1)
    if gate != "none":
        x["g"] = g_scale * F.logsigmoid(rnd(*((B, T, H) if gate == "scalar" else (B, T, H, K))) + 1.0)
    return {key: val.to(dtype) for key, val in x.items()}


def delta_triton(x, *, scale=0.4, chunk_size=16, cu_seqlens=None, decay_first=True, pipeline=None):
    """chunk_delta_triton on the inputs of `delta_inputs` (moved to DEV), with the final state (pipeline: the
    glue's argument; None: its default)."""
    from fastweights.kernels.triton.delta import chunk_delta_triton

    d = to_dev(x)
    return chunk_delta_triton(d["q"], d["k"], d["v"], g=d.get("g"), beta=d["beta"], p=d.get("p"),
                              decay_first=decay_first, scale=scale, initial_state=d["S0"], output_final_state=True,
                              chunk_size=chunk_size, cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(DEV),
                              pipeline=pipeline)


def delta_bf16_agrees(gate, gen, *, T=33, chunk_size=16) -> None:
    """bf16 q, k, v, β, g, S0 (B 1, T, K 16, V 16, `delta_inputs`) through `delta_triton` at `chunk_size` as the
    launch table now says: o and every gradient come back in bf16, within TRITON_DELTA_LOW_REL of the fp32 torch chunk
    form on the same rounded values (under the interpreter the bf16 tensor-core products are emulated by rounding the
    operands: util.mm). Fresh random inputs and upstream gradients each call."""
    import secrets

    from fastweights.chunkwise import chunk_delta
    from tests.tolerances import TRITON_DELTA_LOW_REL

    x = delta_inputs(gate, gen, T=T, K=16, V=16, dtype=torch.bfloat16)
    seed = secrets.randbits(31)

    def torch_run(xd):
        xd = {key: val.float() for key, val in xd.items()}
        return chunk_delta(xd["q"], xd["k"], xd["v"], g=xd.get("g"), beta=xd["beta"], scale=0.4,
                           initial_state=xd["S0"], output_final_state=True, chunk_size=chunk_size)

    got = grads(delta_triton, x, seed, chunk_size=chunk_size)
    assert got[0].dtype == torch.bfloat16 and all(got[2][name].dtype == torch.bfloat16 for name in got[2])
    check(got, grads(torch_run, x, seed), TRITON_DELTA_LOW_REL[torch.bfloat16], "bf16")


def force_delta_pipeline(monkeypatch, *, forward=None, backward=None, recompute_states=None):
    """For the test: `chunk_delta_triton`'s default pipeline (what it runs when called without `pipeline=`, as these
    tests call it) is the rule's (`kernels.pipelines.delta_pipeline`) with `forward` / `backward` set to "fused" (the
    forward also "split")
    where the call's kernels take it (no probe key, the decay first or none; the backward also no diagonal decay,
    K ≤ 128, C ≤ 64) and "staged" elsewhere, and `recompute_states` set (None: the rule's)."""
    from fastweights.kernels.pipelines import DeltaPipeline
    from fastweights.kernels.triton import delta as delta_mod
    from fastweights.kernels.triton.common.limits import DELTA_FUSED_BWD_MAX_C, DELTA_FUSED_BWD_MAX_K

    rule = delta_mod.delta_pipeline

    def forced(*, gate, probe, decay_first, device_type, dtype, K, V, C, split=False):
        base = rule(gate=gate, probe=probe, decay_first=decay_first, device_type=device_type, dtype=dtype, K=K, V=V,
                    C=C, split=split)
        takes = not probe and (decay_first or gate == "none")
        bwd_takes = takes and gate != "diagonal" and K <= DELTA_FUSED_BWD_MAX_K and C <= DELTA_FUSED_BWD_MAX_C
        fwd = base.forward if forward is None else (forward if forward in ("fused", "split") and takes else "staged")
        bwd = base.backward if backward is None else ("fused" if backward == "fused" and bwd_takes else "staged")
        keep = base.recompute_states if recompute_states is None else recompute_states
        return DeltaPipeline(fwd, bwd, keep, base.fp32)

    monkeypatch.setattr(delta_mod, "delta_pipeline", forced)


def force_gated_pipeline(monkeypatch, pipeline="fused", *, recompute_states=True):
    """For the test: `chunk_gated_triton`'s default pipeline is `pipeline` ("fused" where
    `kernels.pipelines.gated_fused_serves` the call, else "staged") with `recompute_states`."""
    from fastweights.kernels.pipelines import GatedPipeline, gated_fused_serves
    from fastweights.kernels.triton import gated as gated_mod

    def forced(*, gate, device_type, dtype, K, V):
        fused = pipeline == "fused" and gated_fused_serves(device_type, K, V, gate=gate, dtype=dtype)
        return GatedPipeline("fused" if fused else "staged", recompute_states)

    monkeypatch.setattr(gated_mod, "gated_pipeline", forced)


# ---------------------------------------------------------------------------- compile keys (no recompile per packing)
#: The head of a compile-key script, run by `compile_keys` in a subprocess without TRITON_INTERPRET (under the
#: interpreter nothing compiles): the sm_90 driver stand-in; Triton's `jit_cache_hook`, which records each launch's
#: compile key (the dict key of `kernel.device_caches[device][0]`, from the specialization of every argument) in
#: `keys` and skips the compile; `packing(gen, i, max_len)`, the i-th of a series of varlen packings; `report`.
KEYS_PREAMBLE = r'''
import json, os, sys
os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, sys.argv[1])
import torch
from triton import knobs
from fastweights.kernels.triton.common.standin import install_sm90_driver

install_sm90_driver()
keys = set()


def hook(**kw):  # called with the compile key of every launch that would compile; True: skip the compile
    keys.add(kw["repr"].split("[")[0] + " " + str(kw["key"]))
    return True


knobs.runtime.jit_cache_hook = hook


def packing(gen, i, max_len):
    """(lengths, T, cu_seqlens) of the i-th packing: 1 to 6 sequences of 0 .. max_len − 1 tokens; the 2nd has T a
    multiple of 16 (its first sequence not: an int specialization would split here), the 3rd T = 1 (an int
    argument equal to 1 would be specialized)."""
    n = int(torch.randint(1, 7, (1,), generator=gen))
    lengths = torch.randint(0, max_len, (n,), generator=gen).tolist()
    if i == 1:
        lengths = [16, 32, 0]
    if i == 2:
        lengths = [1]
    T = max(1, sum(lengths))
    lengths[-1] += T - sum(lengths)
    return lengths, T, torch.tensor([0] + lengths).cumsum(0).to(torch.int32)


def report(counts):  # the number of distinct compile keys after each batch, and the kernels keyed
    print(json.dumps({"counts": counts, "kernels": sorted({key.split(" ")[0] for key in keys})}))
'''


def compile_keys(body: str, *args: str) -> dict:
    """{"counts": keys after each batch, "kernels": the kernels keyed} of `KEYS_PREAMBLE + body`, run in a
    subprocess with the repository root and `args` as its argv."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    r = subprocess.run([sys.executable, "-c", KEYS_PREAMBLE + body, root, *args], capture_output=True, text=True,
                       timeout=600, env={key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def spy_launches(monkeypatch, module, names) -> list[str]:
    """The names of `module`'s kernels `names` in the order they are launched (each kernel's `run` spied)."""
    seen = []
    for name in names:
        kernel = getattr(module, name)

        def spy(*args, _run=kernel.run, _name=name, **kw):
            seen.append(_name)
            return _run(*args, **kw)

        monkeypatch.setattr(kernel, "run", spy)
    return seen


def delta_summand_scales(x, seed, want, *, scale=0.4) -> dict:
    """`check`'s `scales` for the delta rule against its recurrence: {"beta": the size of dβ's summands [B, T, H]},
    float64. dβ_t = (v_t − S'ᵀk_t) · (dS_tᵀ k_t), S' = diag(e^{g_t}) S_{t−1} and dS_t the loss's gradient at S_t
    (`projection` of o and S_T from `seed`); its size here is Σ_v (|v_t| + |S'ᵀk_t|) |dS_tᵀ k_t|, the two terms
    before they cancel (the kernels sum them apart: Σ V ⊙ Y − Γ rowsum(K ⊙ Z)). A kernel's fp32 rounding of dβ_t is
    a few ulps of this, not of |dβ_t|: at T = 1 a token's two terms may cancel to far below both, and with B = 2
    nothing else sets max |dβ|. The delta rule with no, a scalar or a diagonal decay, decay first, H_q = H, no varlen
    (`delta_inputs`' x, `delta_triton`'s scale); its own dβ is held to `want`'s (the reference's `grads`) in
    float64, so the scale is of the same maths."""
    from tests.tolerances import CHUNK_F64

    xd = {key: val.detach().double().cpu().requires_grad_(key == "beta") for key, val in x.items()}
    q, k, v, beta = xd["q"], xd["k"], xd["v"], xd["beta"]
    S, states, outs = xd["S0"], [], []
    for t in range(q.shape[1]):
        if "g" in xd:  # a scalar decay [B, H] or a diagonal one [B, H, K]
            a = xd["g"][:, t].exp()
            S = S * (a[..., None, None] if a.dim() == 2 else a[..., None])
        pred = torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + beta[:, t, :, None, None] * k[:, t, :, :, None] * (v[:, t] - pred)[:, :, None, :]
        S.retain_grad()
        states.append((pred.detach(), S))
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    projection((torch.stack(outs, 1), S), seed).backward()
    assert rel(beta.grad, want[2]["beta"]) < CHUNK_F64, "delta_summand_scales' recurrence is not the reference's"
    terms = [((v[:, t].abs() + pred.abs()) * torch.einsum("bhk,bhkv->bhv", k[:, t], St.grad).abs()).sum(-1)
             for t, (pred, St) in enumerate(states)]
    return {"beta": torch.stack(terms, 1).detach()}
