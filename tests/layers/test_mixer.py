"""MemoryMixer: every zoo model as a layer — its training form equals the recurrent form (outputs
and parameter gradients), prefill + decoding steps equal one forward, the carried state is typed
and has the size state_size() reports; the preset table, the form rule, grouped heads, custom
recipes, and the errors."""

import math

import pytest
import torch

import fastweights as fw
from fastweights.layers import (
    PRESETS,
    MemoryMixer,
    MixerError,
    MixerPreset,
    MixerState,
    SoftmaxAttention,
    derived_preset,
    state_bytes,
    training_form,
)
from fastweights.layers.gates import BetaGate, GLAGate, LogSigmoidGate, MambaDecay
from fastweights.recipe import has_bare_state
from fastweights.state import KVCache, MemoryState, MesaState
from tests.tolerances import (
    GATE_A_HIGH_SLACK,
    GATE_A_LOW_SLACK,
    GATE_DT_REL_SLACK,
    LAYER_F64_REL,
    LAYER_GRAD_F64_REL,
    LAYER_GRAD_F64_REL_DEFAULT,
    TTT_INIT_STD,
)

ZOO = fw.zoo.names()


def tiny(name, d=16, H=2, K=8, dtype=torch.float64, **kw):
    r = fw.zoo.resolve(name)
    if r.memory.residual_ln:
        kw.setdefault("head_v_dim", K)
    if r.feature_map.kind == "polynomial":
        K = 4  # K' = C(K + 2, 2)
        kw["head_v_dim"] = kw.get("head_v_dim") and 4
    return MemoryMixer(d, name, H, head_dim=K, **kw).to(dtype)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def test_preset_table_covers_the_zoo():
    assert set(PRESETS) == set(ZOO)
    for name in ZOO:
        assert MemoryMixer(16, name, 2, head_dim=8, head_v_dim=8).preset == PRESETS[name]


@pytest.mark.parametrize("name", ZOO)
def test_training_form_equals_recurrent_with_gradients(name):
    m = tiny(name)
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    y1, _ = m(x)
    y2, _ = m(x, form="recurrent")
    assert rel(y1, y2) < LAYER_F64_REL
    proj = torch.randn_like(y1)
    params = [p for p in m.parameters()]
    g1 = torch.autograd.grad((y1 * proj).sum(), params)
    g2 = torch.autograd.grad((y2 * proj).sum(), params)
    for (pname, _), a, b in zip(m.named_parameters(), g1, g2):
        assert rel(a, b) < LAYER_GRAD_F64_REL.get(name, LAYER_GRAD_F64_REL_DEFAULT), pname
        assert a.abs().max() > 0, f"{pname} gets no gradient"


@pytest.mark.parametrize("name", ZOO)
def test_prefill_then_steps_equals_one_forward(name):
    m = tiny(name)
    T, P = 12, 5
    x = torch.randn(2, T, 16, dtype=torch.float64)
    y, _ = m(x)
    yp, st = m(x[:, :P], output_state=True)
    outs = [yp]
    for t in range(P, T):
        yt, st = m.step(x[:, t:t + 1], st)
        outs.append(yt)
    assert rel(torch.cat(outs, 1), y) < LAYER_F64_REL
    assert isinstance(st, MixerState) and st.position == T
    assert state_bytes(st) == m.state_size(2, T)
    r = m.recipe
    expected = (KVCache if r.is_softmax else MesaState if r.is_mesa
                else torch.Tensor if has_bare_state(r)
                else MemoryState)
    assert isinstance(st.memory, expected)
    assert (st.conv_q is not None) == (m.preset.conv != "none")


@pytest.mark.parametrize("name", ZOO)
def test_init_state_is_the_empty_prefix(name):
    """Decoding from init_state() equals a forward from no state (the MLP memory starts at its parameters)."""
    m = tiny(name)
    x = torch.randn(2, 4, 16, dtype=torch.float64)
    y, _ = m(x)
    st = m.init_state(2)
    outs = []
    for t in range(4):
        yt, st = m.step(x[:, t:t + 1], st)
        outs.append(yt)
    assert rel(torch.cat(outs, 1), y) < LAYER_F64_REL


def test_form_rule():
    for name in ZOO:
        r = fw.zoo.get(name)
        m = MemoryMixer(16, name, 2, head_dim=8, head_v_dim=8)
        if r.is_softmax:
            assert m.form == "parallel"
        else:
            have = fw.forms(r)
            assert m.form == next(f for f in ("chunk", "parallel", "recurrent") if f in have)
        assert m.form == training_form(r)
    m = MemoryMixer(16, "gated_deltanet", 2, head_dim=8, form="recurrent")
    assert m.form == "recurrent"
    with pytest.raises(MixerError, match="does not exist"):
        MemoryMixer(16, "ttt_linear", 2, head_dim=8, head_v_dim=8, form="parallel")


def test_state_is_constant_for_memories_and_grows_for_softmax():
    lin = MemoryMixer(16, "gated_deltanet", 2, head_dim=8)
    att = SoftmaxAttention(16, 2, head_dim=8)
    assert lin.state_size(3, 10) == lin.state_size(3, 1000)
    assert att.state_size(3, 1000) - att.state_size(3, 10) == 3 * 990 * 2 * (8 + 8) * 4
    # GDN: S [B, H, K, V] fp32 + conv tails (3 inputs of q, k, v)
    K, V = 8, 16
    assert lin.state_size(3) == 3 * 2 * K * V * 4 + 3 * 3 * (2 * K + 2 * K + 2 * V) * 4


def test_grouped_value_heads():
    m = MemoryMixer(16, "gated_deltanet", 1, num_v_heads=4, head_dim=8, head_v_dim=4).double()
    assert m.q_proj.out_features == 8 and m.v_proj.out_features == 16
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    y, st = m(x, output_state=True)
    assert st.memory.shape == (2, 4, 8, 4)
    y2, _ = m(x, form="recurrent")
    assert rel(y, y2) < LAYER_F64_REL


def test_grouped_value_heads_reach_the_memory_unexpanded(monkeypatch):
    """The layer hands q and k to the memory op with their H_q heads (the Triton rows take groups
    natively; only the torch reference expands them, inside its own `prepare`)."""
    seen = []
    chunk = fw.api.chunk

    def spy(recipe, q, k, v, **kw):
        seen.append((q.shape[2], k.shape[2], v.shape[2]))
        return chunk(recipe, q, k, v, **kw)

    monkeypatch.setattr(fw.api, "chunk", spy)
    m = MemoryMixer(16, "gated_deltanet", 1, num_v_heads=4, head_dim=8, head_v_dim=4).double()
    m(torch.randn(2, 9, 16, dtype=torch.float64))
    assert seen == [(1, 1, 4)]


def test_grouped_kv_heads_cache_holds_kv_heads():
    m = SoftmaxAttention(16, 4, num_kv_heads=2, head_dim=4).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    y, st = m(x, output_state=True)
    assert st.memory.k.shape == (2, 6, 2, 4)
    assert y.shape == x.shape
    with pytest.raises(MixerError, match="must divide"):
        SoftmaxAttention(16, 4, num_kv_heads=3, head_dim=4)
    with pytest.raises(MixerError, match="SoftmaxAttention takes a softmax-side"):
        SoftmaxAttention(16, 4, model="gated_deltanet")


def test_softmax_variants_are_presets_of_one_class():
    for name in ("fox", "alibi", "deltaformer", "path_attention"):
        m = SoftmaxAttention(16, 2, head_dim=8, model=name)
        assert type(m).__mro__[1] is MemoryMixer and m.recipe.name == name
    assert isinstance(SoftmaxAttention(16, 2, head_dim=8).decay, type(None))
    assert isinstance(SoftmaxAttention(16, 2, head_dim=8, model="fox").decay, LogSigmoidGate)


def test_custom_recipe_gets_a_derived_layer():
    novel = fw.Recipe(name="novel", objective=fw.Objective(kind="l2"),
                      retention=fw.Retention(kind="diagonal"), optimizer=fw.Optimizer(kind="gd"))
    m = MemoryMixer(16, novel, 2, head_dim=8).double()
    assert m.preset == derived_preset(novel)
    assert isinstance(m.decay, MambaDecay) and m.decay.channels == 8  # KDA-style per-channel gate
    assert isinstance(m.beta, BetaGate) and m.preset.qk_norm == "l2" and m.q_conv is not None
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    assert rel(m(x)[0], m(x, form="recurrent")[0]) < LAYER_F64_REL
    # a zoo name with changed axes is not the zoo model: derived, not the zoo row
    gdn_diag = fw.zoo.get("gated_deltanet").with_(retention=fw.Retention(kind="diagonal"))
    assert MemoryMixer(16, gdn_diag, 2, head_dim=8).preset == derived_preset(gdn_diag)
    # a mixer built from a muon/omega recipe with no zoo row
    weird = fw.Recipe(name="weird", feature_map=fw.FeatureMap(kind="elu1"),
                      objective=fw.Objective(kind="omega", window=3), optimizer=fw.Optimizer(kind="muon"),
                      retention=fw.Retention(kind="scalar", decay_first=False))
    m = MemoryMixer(16, weird, 2, head_dim=4).double()
    assert m.nu is not None and m.gamma is not None and m.form == "recurrent"
    y, st = m(x, output_state=True)
    assert y.shape == x.shape and st.memory.momentum is not None


def test_overrides_and_errors():
    m = MemoryMixer(16, "gated_deltanet", 2, head_dim=8, conv="none", out_gate="none")
    assert m.q_conv is None and m.g_proj is None
    with pytest.raises(MixerError, match="unknown argument"):
        MemoryMixer(16, "gated_deltanet", 2, head_dim=8, convolution="none")
    with pytest.raises(MixerError, match="preset.decay='gla' does not fit"):
        MemoryMixer(16, "gated_deltanet", 2, head_dim=8, preset="gla")
    with pytest.raises(MixerError, match="num_kv_heads"):
        MemoryMixer(16, "gated_deltanet", 2, head_dim=8, num_kv_heads=1)
    with pytest.raises(MixerError, match="num_v_heads"):
        MemoryMixer(16, "softmax_attention", 2, head_dim=8, num_v_heads=4)
    with pytest.raises(MixerError, match="multiple of num_heads"):
        MemoryMixer(16, "gated_deltanet", 2, head_dim=8, num_v_heads=3)
    with pytest.raises(MixerError, match="head_v_dim == head_dim"):
        MemoryMixer(16, "ttt_linear", 2, head_dim=8, head_v_dim=4)
    with pytest.raises(MixerError, match="even head_dim"):
        MemoryMixer(16, "retnet", 2, head_dim=7)
    with pytest.raises(MixerError, match="takes no beta"):
        MemoryMixer(16, "softmax_attention", 2, head_dim=8, beta="sigmoid")
    with pytest.raises(MixerError, match="β ≤ 2"):
        MemoryMixer(16, "deltanet", 2, head_dim=8, beta_scale=3.0)
    with pytest.raises(MixerError, match="preset.conv"):
        MixerPreset(conv="qv")
    with pytest.raises(fw.UnknownModelError):
        MemoryMixer(16, "gated_deltanett", 2)
    m = MemoryMixer(16, "gated_deltanet", 2, head_dim=8)
    with pytest.raises(MixerError, match="x must be"):
        m(torch.randn(2, 5, 8))
    with pytest.raises(MixerError, match="one token"):
        m.step(torch.randn(2, 3, 16), m.init_state(2))
    with pytest.raises(MixerError, match="x must be a floating tensor"):
        m([[0.0] * 16])
    with pytest.raises(TypeError, match="^output_state must be a bool"):
        m(torch.randn(2, 5, 16), output_state="no")


def test_inputs_on_another_device_or_dtype_are_named():
    """x, or a state tensor, on another device or in a dtype the layer cannot compute with: one line naming it
    (was torch's raw RuntimeError from inside the projection or the memory)."""
    m = MemoryMixer(16, "gated_deltanet", 2, head_dim=8)
    x = torch.randn(2, 5, 16)
    with pytest.raises(fw.InputError, match=r"^x is on meta, the layer's parameters on cpu: move one"):
        m(x.to("meta"))
    for dt in (torch.float64, torch.bfloat16):
        with pytest.raises(TypeError, match=rf"^x is {dt}, the layer's parameters torch.float32: convert one"):
            m(x.to(dt))
    with pytest.raises(fw.InputError, match=r"^state.memory is on meta, x on cpu: move one"):
        m(x, m.init_state(2, device="meta"))
    kv = MemoryMixer(16, "softmax_attention", 2, head_dim=8)
    with pytest.raises(fw.InputError, match=r"^state.memory.k is on meta, x on cpu"):
        kv(x, kv.init_state(2, device="meta"))
    with torch.device("meta"):  # a meta layer still traces shapes on meta inputs
        meta = MemoryMixer(16, "gated_deltanet", 2, head_dim=8)
    assert meta(x.to("meta"))[0].shape == x.shape
    with pytest.raises(fw.InputError, match=r"^x is on cpu, the layer's parameters on meta"):
        meta(x)


@pytest.mark.parametrize("name", ["gated_deltanet", "softmax_attention"])
def test_empty_inputs_and_bad_state_arguments_are_named(name):
    """x with no sequence or no position was torch's raw 'cannot reshape tensor of 0 elements'; init_state(dtype=
    "float32") torch's 'zeros(): argument dtype must be torch.dtype'; state_size(seq_len=-5) was answered."""
    m = MemoryMixer(16, name, 2, head_dim=8)
    for shape in ((2, 0, 16), (0, 3, 16)):
        with pytest.raises(MixerError, match=rf"^x must hold at least one sequence and one position, got shape "
                                             rf"\{list(shape)}"):
            m(torch.randn(*shape))
    with pytest.raises(fw.InputError, match="^dtype must be a torch.dtype, e.g. torch.float32, got the string"):
        m.init_state(2, dtype="float32")
    with pytest.raises(fw.InputError, match="^batch_size must be an int ≥ 0, got -1"):
        m.init_state(-1)
    with pytest.raises(fw.InputError, match="^seq_len must be an int ≥ 0, got -5"):
        m.state_size(2, -5)


def test_autocast_takes_inputs_it_casts_and_names_those_it_does_not():
    """Under bf16 autocast a float32 layer computes in bf16: x in float32, bfloat16 or float16 is cast to bf16
    by the first matmul (the same output for the same values); float64, which autocast never casts, is named."""
    m = MemoryMixer(16, "gated_deltanet", 2, head_dim=8)
    x = torch.randn(2, 5, 16).bfloat16()  # values exact in every half dtype below
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys = [m(x.to(dt))[0] for dt in (torch.bfloat16, torch.float32)]
        with pytest.raises(TypeError, match=r"^x is torch.float64, the layer's parameters torch.float32 \(computed "
                                            r"in torch.bfloat16 under torch.autocast\)"):
            m(x.double())
    assert all(y.dtype == torch.bfloat16 for y in ys) and torch.equal(ys[0], ys[1])


def test_gate_initializations():
    gdn = MemoryMixer(16, "gated_deltanet", 4, head_dim=8)
    a_floor, a_max, dt_floor, dt_max = 1e-4, 16, 1e-4, 0.1  # MambaDecay's initial ranges (layers/gates.py)
    for name, lo in (("gated_deltanet", 0.0), ("mamba2", 1.0), ("kda", 1.0)):
        m = MemoryMixer(64, name, 16, head_dim=8)
        A = m.decay.A_log.exp()
        assert (A >= max(lo, a_floor) - GATE_A_LOW_SLACK).all() and (A <= a_max + GATE_A_HIGH_SLACK).all()
        dt = torch.nn.functional.softplus(m.decay.dt_bias)
        assert (dt >= dt_floor * (1 - GATE_DT_REL_SLACK)).all() and (dt <= dt_max * (1 + GATE_DT_REL_SLACK)).all()
        assert getattr(m.decay.A_log, "_no_weight_decay", False)
    x = torch.randn(2, 5, 16)
    g, _ = gdn.decay(x)
    assert g.dtype == torch.float32 and (g <= 0).all()
    gla = MemoryMixer(16, "gla", 2, head_dim=8)
    assert isinstance(gla.decay, GLAGate)
    gk = gla.decay(x)
    assert gk.shape == (2, 5, 2, 8) and (gk <= 0).all() and (gk >= -math.inf).all()
    assert (gk > -1.0).all() or gk.min() > -10  # logsigmoid / 16 is mild at init
    mesa = MemoryMixer(16, "mesanet", 2, head_dim=8)
    lamb = torch.nn.functional.softplus(mesa.lamb_raw) + 0.25
    assert torch.allclose(lamb, torch.ones_like(lamb))
    dp = MemoryMixer(16, "deltaproduct", 2, head_dim=8)
    b = dp.beta(x)
    assert b.shape == (2, 5, 2, 2) and (b <= 2).all() and b.max() > 0  # [B, T, n_h, H], negative eigenvalues
    path = SoftmaxAttention(16, 2, head_dim=8, model="path_attention")
    assert path.w_proj[0].out_features == 32 and path.w_conv.kernel_size == 3
    ttt = MemoryMixer(16, "ttt_mlp", 2, head_dim=8, head_v_dim=8)
    # the official TTT-MLP: both layers' inner biases (zero), interleaved after their weights
    assert [tuple(p.shape) for p in ttt.memory_init] == [(2, 8, 32), (2, 1, 32), (2, 32, 8), (2, 1, 8)]
    assert abs(ttt.memory_init[0].std().item() - 0.02) < TTT_INIT_STD
    assert not ttt.memory_init[1].any() and not ttt.memory_init[3].any()
    assert torch.equal(ttt.ln_weight.data, torch.ones(2, 8)) and not ttt.ln_bias.any()  # per-head inner LN
    comba = MemoryMixer(16, "comba", 2, head_dim=8)
    assert torch.equal(comba.probe_correction.data, torch.ones(2)) and comba.o_norm.activation == "sigmoid"
    m2 = MemoryMixer(16, "mamba2", 2, head_dim=8)
    assert m2.D is not None and m2.q_conv.conv.bias is not None and not m2.o_norm.norm_before_gate


def test_bfloat16_forward_keeps_the_state_in_fp32():
    for name in ("gated_deltanet", "softmax_attention", "fox"):
        m = MemoryMixer(16, name, 2, head_dim=8).to(torch.bfloat16)
        x = torch.randn(2, 6, 16, dtype=torch.bfloat16)
        y, st = m(x, output_state=True)
        assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
        y1, st = m.step(x[:, :1], st)
        if name == "gated_deltanet":
            assert st.memory.dtype == torch.float32
        else:
            assert st.memory.k.dtype == torch.bfloat16
            assert st.memory.c is None or st.memory.c.dtype == torch.float32


def test_omeganet_layer_beta_is_bounded_by_construction():
    """β·b·c·‖φ(k)‖² ≤ 1 (the l2/Omega step is nonexpansive whatever the keys), even at a saturated gate."""
    from fastweights.layers import MemoryMixer

    layer = MemoryMixer(32, "omeganet", 2)
    assert layer.preset.beta == "bounded"
    with torch.no_grad():
        layer.beta.proj.weight.fill_(10.0)
    beta = layer.beta(torch.ones(1, 5, 32))
    assert (beta * fw.zoo.get("omeganet").step_normalizer() <= 1.0).all()
