"""fastweights/training/throughput.py: the steady-state rate of a run's steps, the model's FLOPs per token and
the MFU against a device's peak."""

from __future__ import annotations

import pytest
import torch

from fastweights.chunkwise.flops import chunk_flops
from fastweights.models import LM, LMConfig
from fastweights.training import throughput
from fastweights.training.throughput import StepClock, mfu, mixer_flops_per_token, model_flops_per_token, peak_flops


class FakeClock:
    """A clock that returns the given times, one per call."""

    def __init__(self, times):
        self.times = iter(times)

    def __call__(self):
        return next(self.times)


def test_steady_rate_leaves_out_the_first_steps():
    """Step 1 takes 10 s (the compiles), the later ones 1 s: the running figure carries the first step, the
    steady one (from the end of step 2 on) does not; it is None until a step past `skip` has ended."""
    clock = StepClock(100, skip=2, window=50, clock=FakeClock([0.0, 10.0, 11.0, 12.0, 13.0, 14.0]))
    clock.start()
    clock.step()
    assert clock.steady is None and clock.running == pytest.approx(100 / 10)
    clock.step()
    assert clock.steady is None
    for _ in range(3):
        clock.step()
    assert clock.steady == pytest.approx(100.0)  # 3 steps of 100 tokens in the 3 s from 11 to 14
    assert clock.running == pytest.approx(500 / 14)


def test_steady_rate_is_over_the_last_window_steps():
    times = [0.0, 5.0, 6.0, 8.0, 10.0, 11.0, 12.0]  # start, then the ends of steps 1-6
    clock = StepClock(10, skip=1, window=2, clock=FakeClock(times))
    clock.start()
    for _ in range(6):
        clock.step()
    assert clock.steady == pytest.approx(2 * 10 / (12.0 - 10.0))  # only the last two steps
    with pytest.raises(ValueError, match="skip and window must be ≥ 1"):
        StepClock(10, skip=0)


def _lm(mixer, **kw):
    return LM(LMConfig(vocab_size=64, d_model=16, n_layers=2, num_heads=2, head_dim=8, mixer=mixer, **kw))


def test_model_flops_per_token_counts_the_weights_and_each_mixer():
    """6 · (parameters every token multiplies) + 3 · the mixers' forward FLOPs per token: softmax attention grows
    with T, the chunk form of gated DeltaNet does not; an untied input embedding is a lookup (not counted); a
    mixer without a count (MesaNet) gives None."""
    T = 128
    lm = _lm(["gated_deltanet", "softmax_attention"])
    gdn, attn = lm.blocks[0].mixer, lm.blocks[1].mixer
    assert mixer_flops_per_token(attn, T) == attn.H * T * (attn.K + attn.V)
    C = gdn.config.chunk_size
    assert mixer_flops_per_token(gdn, T) == chunk_flops(1, C, gdn.H, gdn.K, gdn.V, C=C, delta=True) / C
    assert mixer_flops_per_token(gdn, 2 * T) == mixer_flops_per_token(gdn, T)
    want = 6 * lm.num_parameters() + 3 * (mixer_flops_per_token(gdn, T) + mixer_flops_per_token(attn, T))
    assert lm.lm_head is None and model_flops_per_token(lm, T) == pytest.approx(want)
    untied = _lm(["gated_deltanet", "softmax_attention"], tie_word_embeddings=False)
    assert untied.num_parameters() == lm.num_parameters() + 64 * 16
    assert model_flops_per_token(untied, T) == pytest.approx(want)  # the head counted once either way
    assert model_flops_per_token(_lm("mesanet"), T) is None


def test_peak_and_mfu(monkeypatch):
    """The peak from the table for an H100 / H200 in bf16, None for fp32, another GPU or the CPU; the MFU the
    fraction of devices × peak that tokens/s × FLOPs per token is, None when a factor is unknown."""
    assert peak_flops("cpu", "bfloat16") is None
    for name, dtype, want in (("NVIDIA H100 80GB HBM3", "bfloat16", 989e12), ("NVIDIA H200", "bfloat16", 989e12),
                              ("NVIDIA H100 80GB HBM3", "float32", None), ("NVIDIA A100-SXM4-80GB", "bfloat16", None)):
        monkeypatch.setattr(throughput.torch.cuda, "get_device_name", lambda device, name=name: name)
        assert peak_flops(torch.device("cuda", 0), dtype) == want, (name, dtype)
    assert mfu(1000.0, 2e9, 1e13, devices=2) == pytest.approx(0.1)
    assert mfu(None, 2e9, 1e13) is None and mfu(1000.0, None, 1e13) is None and mfu(1000.0, 2e9, None) is None
