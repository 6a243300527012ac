"""r4s18: TRITON_DELTA_LOW_REL's room — `tests/kernels/helpers.delta_bf16_agrees` (bf16 inputs through the delta
kernels against the fp32 torch chunk form) over N fresh draws of each gate at the two shapes the tests call it with;
prints the eight largest errors as fractions of the bound. Usage: PYTHONPATH=. python delta_bf16_room.py N"""
import contextlib, io, os, secrets, sys

os.environ["TRITON_INTERPRET"] = "1"
import torch
import tests.kernels.helpers as H
worst = {}
def fake_check(got, want, tol, what="", *, scales=None):
    o1, s1, g1 = got; o2, s2, g2 = want
    vals = {"o": H.rel(o1, o2), "S": H.rel(s1, s2), **{n: H.rel(g1[n], g2[n]) for n in g2}}
    for n, v in vals.items():
        k = (CUR, n); worst[k] = max(worst.get(k, 0), v / tol)
H.check = fake_check
n = int(sys.argv[1])
for i in range(n):
    for gate in ("none", "scalar", "diagonal"):
        for T, c in ((33, 16), (45, 32)):
            CUR = f"{gate} T{T} c{c}"
            with contextlib.redirect_stdout(io.StringIO()):
                H.delta_bf16_agrees(gate, torch.Generator().manual_seed(secrets.randbits(62)), T=T, chunk_size=c)
top = sorted(worst.items(), key=lambda kv: -kv[1])[:8]
for k, v in top: print(k, f"{v:.3f} of the bound")
