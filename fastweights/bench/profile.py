"""Where one training step's time goes: `fastweights bench train --profile` runs one more eager step of each row
under torch.profiler and writes what took the time — on CUDA the kernels by device time (self), then the ATen ops by
input shapes (device time of the kernels each launched, children included); on the CPU the ATen ops by self CPU
time, then by input shapes. The top rows of each, with their share of the total.

It is the reading behind BENCHMARKS' per-kernel-class tables (e.g. §1r, §1s): one step, after the row's warm-up
and timed steps (compiles done), never a timed step itself (the profiler's own overhead would be in it)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["profile_step"]


def profile_step(step: Callable[[], object], device: torch.device, top: int = 30) -> str:
    """Run `step()` once under torch.profiler and return the report (text: two tables of `top` rows)."""
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=acts, record_shapes=True) as prof:
        step()
        if cuda:
            torch.cuda.synchronize(device)
    lines = []
    if cuda:
        kernels = sorted(((e.key, e.self_device_time_total, e.count) for e in prof.key_averages()
                          if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0),
                         key=lambda r: -r[1])
        total = sum(r[1] for r in kernels) or 1.0
        lines.append(f"GPU time {total / 1e3:.2f} ms in {sum(r[2] for r in kernels)} kernels; by kernel:")
        lines += [f"{us / 1e3:9.3f} ms {100 * us / total:5.1f} % {n:6d}×  {key[:140]}" for key, us, n in kernels[:top]]
        key_time = "device_time_total"
    else:
        key_time = "self_cpu_time_total"
    ops = sorted(((e.key, e.input_shapes, getattr(e, key_time), e.count)
                  for e in prof.key_averages(group_by_input_shape=True)
                  if e.device_type == torch.autograd.DeviceType.CPU and e.key.startswith("aten::")
                  and getattr(e, key_time) > 0), key=lambda r: -r[2])
    what = "device time of the kernels each launched; nested ops counted in each" if cuda else "self CPU time"
    total_ops = sum(r[2] for r in ops) or 1.0
    lines.append(f"by ATen op and input shapes ({what}):")
    lines += [f"{us / 1e3:9.3f} ms {100 * us / total_ops:5.1f} % {n:6d}×  {key:28s} {str(shapes)[:140]}"
              for key, shapes, us, n in ops[:top]]
    return "\n".join(lines) + "\n"
