"""ShortConv: the depthwise causal convolution equals torch's conv1d on the zero-padded input, and
running a sequence in pieces through the carried tail equals one run."""

import pytest
import torch
import torch.nn.functional as F

from fastweights.layers import ShortConv
from tests.tolerances import SHORT_CONV_F64


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("W", [1, 3, 4])
def test_equals_conv1d_and_chains(W, bias):
    conv = ShortConv(6, W, bias=bias).double()
    x = torch.randn(2, 11, 6, dtype=torch.float64)
    y, tail = conv(x)
    xp = F.pad(x.transpose(1, 2), (W - 1, 0))  # [B, C, W − 1 + T]
    ref = F.silu(F.conv1d(xp, conv.conv.weight, conv.conv.bias, groups=6)).transpose(1, 2)  # [B, T, C]
    assert (y - ref).abs().max().item() < SHORT_CONV_F64
    assert torch.equal(tail, x[:, x.shape[1] - (W - 1):])
    t, outs = None, []
    for a, b in [(0, 1), (1, 2), (2, 7), (7, 11)]:
        yy, t = conv(x[:, a:b], t)
        outs.append(yy)
    assert (torch.cat(outs, 1) - y).abs().max().item() < SHORT_CONV_F64


def test_errors():
    with pytest.raises(ValueError, match="kernel_size"):
        ShortConv(4, 0)
    conv = ShortConv(4, 4)
    with pytest.raises(ValueError, match="tail must have shape"):
        conv(torch.randn(1, 2, 4), torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match="^x must be a floating tensor"):
        conv(torch.randn(1, 2, 5))
    with pytest.raises(ValueError, match="^x must be a floating tensor"):
        conv(torch.randn(2, 4))
    for bad in (torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.bool), [0, 1]):
        with pytest.raises(ValueError, match="^positions must be an integer tensor"):
            conv(torch.randn(1, 2, 4), positions=bad)
    with pytest.raises(TypeError, match="^bias must be a bool"):
        ShortConv(4, 4, bias="no")
    with pytest.raises(ValueError, match="^channels must be a positive int"):
        ShortConv(0, 4)

