"""r4s11: GPU time of one eager LM micro-batch (forward + backward, bf16 autocast) by kernel, for a mixer at a shape:
where a deep memory's LM step goes; then by ATen op and input shapes (the ops whose kernels took the most device
time). python3 profile_lm.py MIXER D_MODEL N_LAYERS HEADS B T"""
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from fastweights.models import LM, LMConfig

mixer, d, n, h, B, T = sys.argv[1], *map(int, sys.argv[2:7])
torch.manual_seed(0)
lm = LM(LMConfig(vocab_size=256, d_model=d, n_layers=n, num_heads=h, head_dim=128, head_v_dim=128, mixer=mixer)).cuda()
ids = torch.randint(0, 256, (B, T + 1), device="cuda")


def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = lm(ids[:, :-1])
    F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten()).backward()


for _ in range(2):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
    step()
    torch.cuda.synchronize()
events = prof.key_averages()
rows = sorted(((e.key, e.self_device_time_total, e.count) for e in events
               if e.self_device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA), key=lambda r: -r[1])
total = sum(r[1] for r in rows)
print(f"{mixer} d{d} L{n} H{h} {B}x{T}: GPU {total / 1e3:.1f} ms in {sum(r[2] for r in rows)} kernels")
for key, us, count in rows[:40]:
    print(f"{us / 1e3:8.2f} ms {count:6d}  {key[:140]}")
ops = sorted(((e.key, e.input_shapes, e.device_time_total, e.count) for e in prof.key_averages(group_by_input_shape=True)
              if e.device_type == torch.autograd.DeviceType.CPU and e.key.startswith("aten::") and e.device_time_total > 0),
             key=lambda r: -r[2])
print("by ATen op and input shapes (device time of the op's kernels, children included):")
for key, shapes, us, count in ops[:45]:
    print(f"{us / 1e3:8.2f} ms {count:6d}  {key:28s} {str(shapes)[:150]}")
