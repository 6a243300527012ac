"""transformers' own linear-attention layers ↔ MemoryMixer, both directions: Qwen3-Next's gated
DeltaNet, Kimi-Linear's KDA and Mamba2's mixer. Converted layers give the same outputs (their torch
paths compute in fp32, so fp32 to rounding), converting back gives the same weights bit for bit,
anything without an exact counterpart raises, and a tiny Qwen3-Next model on swapped layers gives
the same logits (generation on swapped layers: test_swap.py)."""

import pytest
import torch
from transformers.models.kimi_linear import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention
from transformers.models.mamba2 import Mamba2Config
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
from transformers.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

import fastweights.convert as fc
from fastweights.layers import MemoryMixer
from tests.tolerances import CONVERT_LAYER_F32_REL, CONVERT_MODEL_F32_REL

D = 32


def randomize(module):
    """Every parameter redrawn (not the init's ones and zeros, so a swapped pair shows); A in (0.4, 2.7)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            else:
                p.normal_(0.0, 0.3)
    return module


def rel_err(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def qwen3_next_layer(Hk=2, H=4, K=8, V=6, W=3, **kw):
    cfg = Qwen3NextConfig(hidden_size=D, linear_num_key_heads=Hk, linear_num_value_heads=H, linear_key_head_dim=K,
                          linear_value_head_dim=V, linear_conv_kernel_dim=W, rms_norm_eps=1e-5, num_hidden_layers=1,
                          layer_types=["linear_attention"], **kw)
    return randomize(Qwen3NextGatedDeltaNet(cfg, 0))


def kimi_layer(H=4, K=8, W=4, **kw):
    cfg = KimiLinearConfig(hidden_size=D, linear_num_heads=H, linear_head_dim=K, linear_conv_kernel_dim=W,
                           num_hidden_layers=1, layer_types=["linear_attention"], **kw)
    return randomize(KimiLinearDeltaAttention(cfg, 0))


def mamba2_layer(H=8, P=8, N=6, n_groups=1, **kw):
    cfg = Mamba2Config(n_groups=n_groups, hidden_size=D, num_heads=H, head_dim=P, state_size=N, expand=H * P // D,
                       num_hidden_layers=1, chunk_size=16, **kw)
    return randomize(Mamba2Mixer(cfg, 0)).eval()


CASES = {
    "qwen3_next": (qwen3_next_layer, fc.from_qwen3_next, fc.to_qwen3_next),
    "kimi_linear": (kimi_layer, fc.from_kimi_linear, fc.to_kimi_linear),
    "mamba2": (mamba2_layer, fc.from_mamba2, fc.to_mamba2),
}


@pytest.mark.parametrize("peer", CASES)
def test_layer_converts_both_ways_with_equal_outputs_and_weights(peer):
    build, to_fw, back = CASES[peer]
    layer = build()
    mixer = to_fw(layer)
    assert isinstance(mixer, MemoryMixer)
    x = torch.randn(2, 37, D)
    with torch.no_grad():
        want = layer(x)
        assert rel_err(mixer(x)[0], want) < CONVERT_LAYER_F32_REL
        fresh = back(mixer)  # a new transformers layer built from the mixer alone
        assert rel_err(fresh(x), want) < CONVERT_LAYER_F32_REL
    # filling the original layer back gives its weights bit for bit
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    randomize(layer)
    back(mixer, layer)
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("peer", CASES)
def test_a_trained_mixer_converts_to_the_peer_and_back(peer):
    """fastweights → transformers → fastweights: a mixer built by fastweights (random weights, as
    after training) reaches the peer layer with equal outputs and returns with equal weights."""
    build, to_fw, back = CASES[peer]
    template = to_fw(build())  # a mixer with the peer's wiring and dims
    mixer = randomize(MemoryMixer(template.d_model, template.recipe, template.Hq, head_dim=template.K,
                                  head_v_dim=template.V, num_v_heads=template.H, norm_eps=template.o_norm.eps,
                                  preset=template.preset))
    if peer == "kimi_linear":  # Kimi-Linear's output gate has no bias
        torch.nn.init.zeros_(mixer.g_proj[1].bias)
    x = torch.randn(2, 29, D)
    layer = back(mixer).eval()
    with torch.no_grad():
        assert rel_err(layer(x), mixer(x)[0]) < CONVERT_LAYER_F32_REL
    again = to_fw(layer)
    for k, v in mixer.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_qwen3_next_model_on_fastweights_layers_gives_the_same_logits():
    cfg = Qwen3NextConfig(vocab_size=64, hidden_size=D, intermediate_size=48, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                          linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                          shared_expert_intermediate_size=16, rms_norm_eps=1e-6,
                          layer_types=["linear_attention"] * 3 + ["full_attention"])
    model = randomize(Qwen3NextForCausalLM(cfg)).eval()
    ids = torch.randint(0, 64, (2, 21))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        assert fc.swap_linear_attention(model) is model
        assert all(isinstance(m.linear_attn, fc.AsTransformersLayer) for m in model.model.layers[:3])
        assert [m.linear_attn.layer_idx for m in model.model.layers[:3]] == [0, 1, 2]
        got = model(ids, use_cache=False).logits
        assert rel_err(got, want) < CONVERT_MODEL_F32_REL
    # with transformers' cache and padding: tests/convert/test_swap.py


def test_mixers_without_an_exact_counterpart_raise():
    mixer = fc.from_qwen3_next(qwen3_next_layer())
    gated = MemoryMixer(D, "gated_deltanet", 2, head_dim=8, head_v_dim=6, num_v_heads=4, out_gate="sigmoid")
    with pytest.raises(fc.ConversionError, match="out_gate='sigmoid' \\(needs 'swish'\\)"):
        fc.to_qwen3_next(gated)
    with pytest.raises(fc.ConversionError, match="zoo model 'gated_deltanet'; this mixer runs 'kda'"):
        fc.to_qwen3_next(fc.from_kimi_linear(kimi_layer()))
    with pytest.raises(fc.ConversionError, match=r"\(d, H_k, H, K, V, W\)"):
        fc.to_qwen3_next(mixer, qwen3_next_layer(H=2))
    kda = fc.from_kimi_linear(kimi_layer())
    with torch.no_grad():
        kda.g_proj[1].bias[3] = 0.5
    with pytest.raises(fc.ConversionError, match="g_b_proj has no bias.*max \\|b\\| = 0.5"):
        fc.to_kimi_linear(kda)
    with pytest.raises(fc.ConversionError, match="n_groups=2"):
        fc.from_mamba2(mamba2_layer(n_groups=2))
    with pytest.raises(fc.ConversionError, match="use_bias=True"):
        fc.from_mamba2(mamba2_layer(use_bias=True))
    with pytest.raises(fc.ConversionError, match="time_step_limit=\\(0.0, 1.0\\) clamps dt"):
        fc.from_mamba2(mamba2_layer(time_step_limit=(0.0, 1.0)))
    with pytest.raises(fc.ConversionError, match="hidden_act"):
        fc.from_qwen3_next(qwen3_next_layer(hidden_act="gelu"))
    with pytest.raises(fc.ConversionError, match="expected transformers' Mamba2Mixer, got KimiLinearDeltaAttention"):
        fc.from_mamba2(kimi_layer())
    with pytest.raises(fc.ConversionError, match="mix dtypes"):
        layer = kimi_layer()
        layer.o_proj.to(torch.float64)
        fc.from_kimi_linear(layer)


@pytest.mark.parametrize("case", ["qwen3_next", "kimi_linear"])
@pytest.mark.parametrize("kwargs, name", [({"num_heads": 2}, "num_heads"), ({"head_dim": 8}, "head_dim"),
                                          ({"conv_size": 2}, "conv_size"), ({"out_gate": "sigmoid"}, "out_gate"),
                                          ({"scale": 1.0}, "scale")])
def test_a_mixer_argument_the_layer_sets_is_a_conversion_error_naming_it(case, kwargs, name):
    """(num_heads= was a raw TypeError, a preset field such as out_gate= silently changed what the
    converted mixer computes.) How the mixer runs (chunk_size=, backend=) passes through."""
    make, convert, _ = CASES[case]
    layer = make()
    with pytest.raises(fc.ConversionError, match=f"^{name}=.*: the converted mixer takes {name} from transformers'"):
        convert(layer, **kwargs)
    assert convert(layer, chunk_size=4, backend="torch").config.chunk_size == 4
