"""The training step that the lab's sweeps (`fastweights.lab.train`) and `fastweights train`
(`fastweights.pretrain`) share; layered above the models and below both of them.

* :mod:`~fastweights.training.loop` — the one training loop both drive (`run` over `Hooks`: micro-batches with
  gradient accumulation, the optimizer step, the stop check at the step boundary, periodic evaluation and
  saves, the per-step record) and the ranks' model wrappers (`wrap`: DDP / FSDP2, `no_sync`);
* :mod:`~fastweights.training.step` — AdamW parameter groups, the warm-up + cosine schedule,
  autocast, the optimizer step (clip, step, clear, schedule);
* :mod:`~fastweights.training.checkpoint` — atomic checkpoint writes and RNG states (exact resume);
* :mod:`~fastweights.training.control` — stop requests: Ctrl-C saves and stops at a step boundary;
* :mod:`~fastweights.training.distributed` — the process group under torchrun, rank information,
  small all-reduces, how the ranks share a step (`Layout`: data and context parallelism);
* :mod:`~fastweights.training.progress` — tqdm bars or plain log lines.
"""

from .checkpoint import atomic_save, rng_state, set_rng_state
from .control import Interrupted, request_stop, resume_hint, stop_on_sigint, stop_requested, training
from .distributed import DistInfo, all_reduce_sum, barrier, dist_info, init_distributed, is_distributed
from .progress import Progress, make_progress
from .step import adamw, autocast, lr_factor, optimizer_step, param_groups

__all__ = ["param_groups", "adamw", "lr_factor", "autocast", "optimizer_step", "atomic_save", "rng_state",
           "set_rng_state", "Interrupted", "stop_on_sigint", "training", "stop_requested", "request_stop",
           "resume_hint", "DistInfo", "dist_info", "init_distributed", "is_distributed", "barrier",
           "all_reduce_sum", "Progress", "make_progress"]
