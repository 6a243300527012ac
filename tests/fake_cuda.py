"""A CUDA-like target on the CPU, for tests: the one documented override of the dispatch table.

`FakeCuda(monkeypatch).install()` replaces every Triton row of `fastweights.dispatch.DISPATCH` by
a copy whose capability predicate sees a CPU call as a CUDA one (every other check of the
predicate unchanged: dtype, head dims, chunk size, conv width, norm group and gate), so "auto"
takes the Triton rows on the CPU exactly where it would take them on a GPU, and an explicit
"triton" is accepted there. Each row's fn is wrapped to record the row (class, form, backend) in
`calls`; by default a Triton row then delegates to the torch row of its (class, form) — the
routing is what is tested, the kernels are not run — and with `kernels=True` it runs its own
kernel (under TRITON_INTERPRET=1 on CPU tensors: the layer-level kernel tests) — and a row's `fn.joint` (the conv
row's joint q|k|v launch, `layers.conv.joint_conv`) is kept, recorded, only then (without kernels the layer runs
its convs one by one through the delegating row). Torch rows are
recorded too. Replacing rows clears the route cache (`dispatch.Table`), and monkeypatch puts the
original rows back after the test.

Installing the fake after a model was built (or loaded) stands for "built where no GPU was, then
moved to the GPU": a model that fixed its backends when built keeps the torch rows; one that
routes each call takes the Triton rows.
"""

from __future__ import annotations

import dataclasses

from fastweights.dispatch import DISPATCH, Target

__all__ = ["FakeCuda"]


def _as_if_cuda(supports):
    def on_fake_cuda(recipe, target: Target):
        if target.device_type == "cpu":
            target = target._replace(device_type="cuda")
        return supports(recipe, target)
    return on_fake_cuda


class FakeCuda:
    """See the module doc. `calls`: the (class, form, backend) of every row call since install."""

    def __init__(self, monkeypatch, *, kernels: bool = False):
        self.monkeypatch, self.kernels = monkeypatch, kernels
        self.calls: list[tuple[str, str, str]] = []

    def install(self) -> FakeCuda:
        original = dict(DISPATCH)
        for key, impl in original.items():
            cls, form, backend = key
            if backend == "triton":
                run = impl.fn if self.kernels else original[(cls, form, "torch")].fn
                fn = self._recorded(key, run)
                joint = getattr(impl.fn, "joint", None)
                if joint is not None and self.kernels:  # the joint conv (q, k, v in one launch): its kernel, recorded
                    fn.joint = self._recorded(key, joint)
                new = dataclasses.replace(impl, fn=fn, supports=_as_if_cuda(impl.supports))
            elif backend == "torch":
                new = dataclasses.replace(impl, fn=self._recorded(key, impl.fn))
            else:
                continue
            self.monkeypatch.setitem(DISPATCH, key, new)
        return self

    def _recorded(self, key, fn):
        def recorded(*args, **kwargs):
            self.calls.append(key)
            return fn(*args, **kwargs)
        return recorded

    def take(self) -> list[tuple[str, str, str]]:
        """The calls recorded since the last take (and forget them)."""
        out, self.calls[:] = list(self.calls), []
        return out
