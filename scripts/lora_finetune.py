"""A LoRA fine-tune of a small gated DeltaNet LM with peft (docs/hf.md, "LoRA with peft"), on the CPU.

    python scripts/lora_finetune.py [--steps 200] [--base-steps 200] [--d-model 64] [--plot docs/img/lora_gdn.png]
                                    [--json docs/results/lora_gdn.json]

1. The base: a 2-layer gated DeltaNet LM (bytes, vocab 257) trained in full on README.md (`--base-steps`).
2. The fine-tune: peft's LoRA (r 8) on every projection of the mixers (q, k, v, the gates a and b, the
   output gate g, o_proj), the base frozen, trained on docs/kernels.md (`--steps`); the loss of held-out
   windows of docs/kernels.md is measured before and after, and the adapted model's logits against the
   merged model's (`merge_and_unload`).
Prints one JSON line of the numbers (and writes it to --json), plots both losses to --plot.
`run(...)` is what tests/hf/test_lora_script.py calls at a tiny size.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["q_proj", "k_proj", "v_proj", "decay.proj", "beta.proj", "g_proj", "o_proj"]


def windows(data: bytes, T: int) -> torch.Tensor:
    """Non-overlapping byte windows [N, T + 1] (ids 0…255)."""
    n = (len(data) - 1) // T
    ids = torch.tensor(list(data[: n * T + 1]), dtype=torch.long)
    return torch.stack([ids[i * T: i * T + T + 1] for i in range(n)])


def loss_of(model, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of rows batch [B, T + 1]."""
    return model(input_ids=batch, labels=batch).loss


def train(model, rows: torch.Tensor, steps: int, lr: float, batch: int, gen: torch.Generator) -> list[float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))  # 20 warm-up steps
    losses = []
    for _ in range(steps):
        pick = torch.randint(0, rows.shape[0], (batch,), generator=gen)
        loss = loss_of(model, rows[pick])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    return losses


@torch.no_grad()
def evaluate(model, rows: torch.Tensor) -> float:
    return float(loss_of(model, rows))


def run(*, steps: int = 200, base_steps: int = 200, d_model: int = 64, T: int = 64, batch: int = 8, rank: int = 8,
        seed: int = 0, plot: Path | None = None) -> dict:
    """The base run and the LoRA run; returns their numbers (losses in nats per byte)."""
    from peft import LoraConfig, get_peft_model

    import fastweights.hf as fh
    from fastweights.models import LM, LMConfig

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    cfg = LMConfig(vocab_size=257, d_model=d_model, n_layers=2, num_heads=2, head_dim=d_model // 2,
                   mixer="gated_deltanet")
    model = fh.from_lm(LM(cfg))
    t0 = time.perf_counter()
    base_losses = train(model, windows((ROOT / "README.md").read_bytes(), T), base_steps, 3e-3, batch, gen)
    target = windows((ROOT / "docs" / "kernels.md").read_bytes(), T)
    held = target[-max(2, target.shape[0] // 8):]  # the last eighth of the windows: never trained on
    train_rows = target[: target.shape[0] - held.shape[0]]
    before = evaluate(model, held)
    total = sum(p.numel() for p in model.parameters())
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                                  target_modules=TARGETS))
    frozen = {k: v.clone() for k, v in peft_model.named_parameters() if not v.requires_grad}
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    lora_losses = train(peft_model, train_rows, steps, 3e-3, batch, gen)
    after = evaluate(peft_model, held)
    base_kept = all(torch.equal(v, dict(peft_model.named_parameters())[k]) for k, v in frozen.items())
    # every adapter trained: its B (zero at the start) moved
    lora_b = [p for k, p in peft_model.named_parameters() if "lora_B" in k]
    moved = sum(bool(p.detach().ne(0).any()) for p in lora_b)
    with torch.no_grad():
        adapted = peft_model(input_ids=held).logits
        merged = peft_model.merge_and_unload()(input_ids=held).logits
    result = dict(d_model=d_model, T=T, batch=batch, rank=rank, base_steps=base_steps, lora_steps=steps,
                  parameters=total, trainable=trainable, held_out_before=round(before, 4),
                  held_out_after=round(after, 4), base_weights_unchanged=base_kept,
                  adapters_trained=f"{moved}/{len(lora_b)}",
                  merged_max_abs_diff=float((adapted - merged).abs().max()),
                  seconds=round(time.perf_counter() - t0, 1), base_losses=base_losses, lora_losses=lora_losses)
    if plot is not None:
        _plot(result, plot)
    return result


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    nb = len(result["base_losses"])
    ax.plot(range(nb), result["base_losses"], label="base: full training on README.md", lw=1)
    ax.plot(range(nb, nb + len(result["lora_losses"])), result["lora_losses"],
            label=f"LoRA r={result['rank']} on docs/kernels.md ({result['trainable']:,} of "
                  f"{result['parameters']:,} parameters)", lw=1)
    ax.axhline(result["held_out_before"], color="gray", ls=":", lw=1, label="held-out docs/kernels.md, before LoRA")
    ax.axhline(result["held_out_after"], color="black", ls="--", lw=1, label="held-out docs/kernels.md, after LoRA")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats / byte)")
    ax.set_title(f"gated DeltaNet, d_model {result['d_model']}, 2 layers, CPU")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from fastweights.cliargs import ArgError, Parser, positive

    ap = Parser(prog="scripts/lora_finetune.py", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="LoRA steps")
    ap.add_argument("--base-steps", type=int, default=200, help="full-training steps of the base")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--plot", type=Path, default=None, help="PNG of the loss curves")
    ap.add_argument("--json", type=Path, default=None, help="where to write the numbers (one JSON object)")
    args = ap.parse_args(argv)
    try:
        for flag, value in (("--steps", args.steps), ("--base-steps", args.base_steps), ("--d-model", args.d_model)):
            positive(flag, value)
        if args.d_model % 2:
            raise ArgError(f"--d-model must be even (2 heads), got {args.d_model}")
    except ArgError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    result = run(steps=args.steps, base_steps=args.base_steps, d_model=args.d_model, plot=args.plot)
    line = json.dumps({k: v for k, v in result.items() if not k.endswith("_losses")})
    print(line)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
