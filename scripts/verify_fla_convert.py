"""`fastweights convert` checked against fla's own model forward, both directions.

Needs flash-linear-attention (fla-core + flash-linear-attention 0.6.0) in the environment: a
test-only environment, never a fastweights dependency. For each converted fla model type (and a
hybrid with fla's `attn` layers, and untied heads):

  fla → fastweights: fla's <Name>ForCausalLM with random weights, written by its own
      save_pretrained, converted by `fastweights.convert.fla.convert_from_fla`, loaded by
      `LM.from_pretrained`: the logits of both on the same ids;
  fastweights → fla: an LM with random weights, written by `LM.save_pretrained`, converted by
      `convert_to_fla`, loaded by transformers' AutoModelForCausalLM (fla registers its classes):
      the logits of both.

Run on the CPU under Triton's interpreter (fla's kernels are Triton):

    TRITON_INTERPRET=1 /work/venvs/convert-fla/bin/python scripts/verify_fla_convert.py [--models gla kda ...]

or on a CUDA machine with fla installed (fla runs its own kernels; torch's SDPA stands in for
flash-attn only where flash-attn is not installed); --seq-len 200 takes fla's chunk kernels (and
MesaNet's CG solver) instead of the fused recurrent ones:

    python scripts/verify_fla_convert.py --device cuda --seq-len 200

On the CPU the script shims what cannot run there, only there, and says so in its output:
Triton's autotuner needs a GPU driver to time configs (it takes the first config); fla's `attn`
layer calls flash-attn (replaced by torch's causal SDPA, the same maths); MesaNet's chunk kernels
do not run under the interpreter (replaced by fla's own exact reference `naive_mesa_net_exact`,
fed the L2-normalized q, k the kernel would normalize). Everything else is fla's own code: with
T ≤ 64 in eval mode under no_grad, fla's layers take their fused_recurrent kernels.
Exit status 1 if any model's logits differ by more than --tol (relative to the largest logit).
`--dump-layouts PATH` also writes, per configuration, the config.json and the weight names and shapes
fla's save_pretrained wrote (tests/convert/data/fla_layouts.json: the CI tests hold the converter to
fla's real layout without fla installed).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's fastweights (run from anywhere)

import torch  # noqa: E402

SHIMS: list[str] = []


def install_flash_attn_shim() -> None:
    """fla's `attn` layer calls flash-attn; without it (always on the CPU), torch's causal SDPA."""
    import fla.layers.attn as fla_attn

    def sdpa_causal(q, k, v, causal=True, window_size=(-1, -1), **kwargs):  # q [B, T, H, D], k, v [B, T, Hkv, D]
        assert causal and tuple(window_size) == (-1, -1)
        rep = q.shape[2] // k.shape[2]
        k, v = (x.repeat_interleave(rep, dim=2) for x in (k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             is_causal=True)
        return o.transpose(1, 2)

    fla_attn.flash_attn_func = sdpa_causal
    SHIMS.append("fla attn: flash_attn_func -> torch causal SDPA (flash-attn is not installed)")


def install_cpu_shims() -> None:
    """The three CPU-only substitutions described in the module doc."""
    from triton.runtime import autotuner

    run = autotuner.Autotuner.run

    def first_config(self, *args, **kwargs):
        self.configs = self.configs[:1]
        return run(self, *args, **kwargs)

    autotuner.Autotuner.run = first_config
    SHIMS.append("Triton autotuner: first config (the interpreter has no driver to time configs)")

    install_flash_attn_shim()

    import fla.layers.mesa_net as fla_mesa
    from fla.ops.mesa_net.naive import naive_mesa_net_exact

    def mesa_exact(q, k, v, g, beta, lamb, h_kk_init=None, h_kv_init=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, **kwargs):
        if use_qk_l2norm_in_kernel:  # fla's l2norm: x / sqrt(Σ x² + 1e-6)
            q, k = (x / torch.sqrt((x.float() ** 2).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
        o, h_kk, h_kv = naive_mesa_net_exact(q, k, v, g, lamb, beta, h_kk_init, h_kv_init)
        return o.to(v.dtype), h_kk, h_kv

    fla_mesa.chunk_mesa_net = mesa_exact
    SHIMS.append("fla mesa_net: chunk_mesa_net -> fla's naive_mesa_net_exact (chunk kernels fail under the "
                     "interpreter)")


D, VOCAB = 32, 64
T = 23  # ≤ 64: fla's layers take their fused_recurrent kernels in eval mode; --seq-len > 64: the chunk kernels
# max |Δlogit| / max |logit|, fp32: both sides compute the same maths in other orders (fla's fused
# recurrent kernels, fastweights' chunk form); measured ≤ 1e-5 over the cases below (CPU, interpreter)
LOGITS_REL = 1e-4

# fla configs (small): model_type -> list of (label, config kwargs)
CASES = {
    "gated_deltanet": [("gva+neg", dict(head_dim=8, num_heads=2, num_v_heads=4, expand_v=1.5, allow_neg_eigval=True)),
                       ("hybrid", dict(head_dim=8, num_heads=4, expand_v=1.0, num_hidden_layers=3,
                                       attn={"layers": [1], "num_heads": 4, "num_kv_heads": 2})),
                       ("sigmoid gate", dict(head_dim=8, num_heads=2, output_gate_activation="sigmoid"))],
    "delta_net": [("gate", dict(num_heads=2, use_gate=True)), ("tied", dict(num_heads=4, tie_word_embeddings=True))],
    "gla": [("fused norm", dict(num_heads=2)), ("conv, unfused", dict(num_heads=2, use_short_conv=True,
                                                                       fuse_norm=False))],
    "kda": [("gva", dict(head_dim=8, num_heads=2, num_v_heads=4))],
    "mamba2": [("default", dict(head_dim=8, state_size=6, expand=2, chunk_size=16, norm_eps=1e-5))],
    "retnet": [("default", dict(num_heads=2))],
    "comba": [("default", dict(head_dim=8, num_heads=2))],
    "gated_deltaproduct": [("n_h 2, gated, neg", dict(head_dim=8, num_heads=2, num_householder=2,
                                                     use_forget_gate=True, allow_neg_eigval=True)),
                           ("n_h 3 ungated", dict(head_dim=8, num_heads=2, num_householder=3))],
    "linear_attn": [("elu", dict(num_heads=2, feature_map="elu")), ("identity", dict(num_heads=4,
                                                                                     feature_map="identity"))],
    "mesa_net": [("default", dict(head_dim=8, num_heads=2))],
}


def randomize(model) -> None:
    """Every parameter redrawn, so that a swapped or dropped weight shows in the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            elif name.endswith("lambda_params"):
                p.uniform_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.3 if p.dim() > 1 else 0.5).add_(1.0 if name.endswith("norm.weight") else 0.0)


def rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def check_case(model_type: str, kw: dict, device: str, tmp: Path, layouts: dict | None = None,
               label: str = "", seq_len: int = T) -> tuple[float, float]:
    import fla  # noqa: F401  (registers fla's models with transformers' Auto classes)
    from transformers import AutoConfig, AutoModelForCausalLM

    from fastweights.convert.fla import convert_from_fla, convert_to_fla
    from fastweights.models import LM

    base = dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, tie_word_embeddings=False,
                fuse_cross_entropy=False, norm_eps=1e-5)
    cfg = AutoConfig.for_model(model_type, **{**base, **kw})
    ids = torch.randint(0, VOCAB, (2, seq_len), device=device)
    # fla -> fastweights
    fla_model = AutoModelForCausalLM.from_config(cfg).to(device).eval()
    randomize(fla_model)
    fla_model.save_pretrained(tmp / "fla")
    if layouts is not None:
        from safetensors import safe_open

        with safe_open(str(tmp / "fla" / "model.safetensors"), "pt") as f:
            shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        config = json.loads((tmp / "fla" / "config.json").read_text())
        layouts[f"{model_type} {label}"] = {"config": config, "weights": dict(sorted(shapes.items()))}
    convert_from_fla(tmp / "fla", tmp / "fw")
    lm = LM.from_pretrained(tmp / "fw", device=device).eval()
    with torch.no_grad():
        want = fla_model(ids, use_cache=False).logits
        err_in = rel(lm(ids), want)
    # fastweights -> fla: a fresh LM of the converted config with random weights
    lm2 = LM(lm.config).to(device).eval()
    randomize(lm2)
    lm2.save_pretrained(tmp / "fw2")
    convert_to_fla(tmp / "fw2", tmp / "fla2")
    fla2 = AutoModelForCausalLM.from_pretrained(tmp / "fla2").to(device).eval()
    with torch.no_grad():
        err_out = rel(fla2(ids, use_cache=False).logits, lm2(ids))
    return err_in, err_out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tol", type=float, default=LOGITS_REL, help="bound on max |Δlogit| / max |logit|, fp32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=T, help="tokens per row (> 64: fla's chunk kernels; GPU)")
    ap.add_argument("--dump-layouts", default=None, help="write fla's config.json and weight shapes per case here")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    if args.device == "cpu":
        install_cpu_shims()
    else:
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            install_flash_attn_shim()
    for s in SHIMS:
        print(f"shim: {s}")
    worst, failed = 0.0, []
    layouts = {} if args.dump_layouts else None
    for model_type in args.models:
        for label, kw in CASES[model_type]:
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    err_in, err_out = check_case(model_type, kw, args.device, Path(tmp), layouts, label,
                                                 args.seq_len)
                except Exception as e:  # noqa: BLE001  (reported, counted as a failure)
                    print(f"{model_type:20s} {label:20s} ERROR {type(e).__name__}: {e}")
                    failed.append(f"{model_type} {label}")
                    continue
            ok = max(err_in, err_out) <= args.tol
            worst = max(worst, err_in, err_out)
            print(f"{model_type:20s} {label:20s} fla→fw {err_in:.2e}   fw→fla {err_out:.2e}   {'ok' if ok else 'FAIL'}")
            if not ok:
                failed.append(f"{model_type} {label}")
    if layouts is not None:
        Path(args.dump_layouts).write_text(json.dumps(layouts, indent=1, sort_keys=True) + "\n")
    print(f"worst relative logit difference {worst:.2e} (tol {args.tol:.0e}); failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
