"""One quick-preset MQAR cell with MixerPreset fields overridden in every layer.

    python3 scripts/mqar_ablation.py mamba2 "{'beta': 'none'}" 3e-3 [--d-model 64] [--epochs 10]

Prints the best test accuracy (same data, schedule and budget as `fastweights mqar --preset quick`).
Used for docs/mqar.md's Mamba2 note: β = dt → β = 1 ("beta": "none"), or no D skip ("d_skip": False).
"""

import argparse
import ast
import dataclasses
import time

import torch

from fastweights.lab import mqar
from fastweights.lab.train import TrainConfig, train_cell


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("overrides", help="a dict literal of MixerPreset fields, e.g. \"{'d_skip': False}\"")
    ap.add_argument("lr", type=float)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=None, help="override the preset's epochs (10)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    overrides = ast.literal_eval(args.overrides)
    cell = next(c for c in mqar.make_cells(mqar.PRESETS["quick"], models=[args.model], d_models=[args.d_model],
                                           lrs=[args.lr]))
    base = mqar.lm_config(cell)
    cfg = dataclasses.replace(base, mixer_overrides={**dict(base.mixer_overrides), **overrides})

    def model_fn(_cfg=None):
        return mqar.build_lm(cfg)

    train, test = mqar.cell_data(cell)
    tc = TrainConfig(epochs=args.epochs or cell.epochs, batch_size=cell.batch_size, lr=cell.lr,
                     weight_decay=cell.weight_decay, decay_filter=cell.decay_filter, warmup=cell.warmup,
                     grad_clip=cell.grad_clip, early_stop=cell.early_stop, seed=cell.seed)
    t0 = time.time()
    res = train_cell(cfg, train, test, tc, model_fn=model_fn, progress="none")
    print(f"{args.model} d={args.d_model} lr={args.lr:g} epochs={tc.epochs} {overrides}: "
          f"accuracy {res['accuracy']:.3f} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
