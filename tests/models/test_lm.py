"""LM over every zoo model: prefill + recurrent decoding reproduces the full forward (fp32), cached
greedy generation equals greedy decoding by repeated full forwards, the model trains (the loss
falls on a tiny copy task); hybrids, sampling, states and errors."""

import re

import pytest
import torch
import torch.nn.functional as F

import fastweights as fw
from fastweights.layers import MixerState
from fastweights.models import LM, GenerationError, LMConfig, LMState, sample_next
from fastweights.state import KVCache
from tests.tolerances import CHECKPOINT_F64, DECODE_F64_REL, DECODE_REL, DECODE_REL_DEFAULT, GREEDY_TIE_REL

ZOO = fw.zoo.names()
VOCAB = 32


def tiny_config(name, **kw) -> LMConfig:
    r = fw.zoo.resolve(name)
    K = 4 if r.feature_map.kind == "polynomial" else 8  # keep K' = C(K + 2, 2) small
    base = dict(vocab_size=VOCAB, d_model=16, n_layers=2, mixer=name, num_heads=2, head_dim=K,
                head_v_dim=K if r.memory.residual_ln else None)
    base.update(kw)
    return LMConfig(**base)


def decode_logits(model, ids, prefill_len):
    logits, state = model.prefill(ids[:, :prefill_len])
    outs = [logits]
    for t in range(prefill_len, ids.shape[1]):
        lt, state = model.step(ids[:, t], state)
        outs.append(lt[:, None])
    return torch.cat(outs, 1), state


def assert_same_greedy(model, prompt, n):
    """Cached == uncached greedy; a divergence is accepted only at a near-tie of the top logits."""
    a = model.generate(prompt, n)
    b = model.generate(prompt, n, use_cache=False)
    if torch.equal(a, b):
        return
    logits = model(a[:, :-1])
    for row in range(a.shape[0]):
        diff = (a[row] != b[row]).nonzero()
        if len(diff) == 0:
            continue
        t = diff[0].item()
        lt = logits[row, t - 1]
        gap = (lt.max() - lt[b[row, t]]).abs().item()
        assert gap < GREEDY_TIE_REL * lt.abs().max().item(), f"row {row} diverges at {t} with a logit gap {gap}"


@pytest.mark.parametrize("name", ZOO)
def test_prefill_and_decode_equal_full_forward(name):
    model = LM(tiny_config(name))
    ids = torch.randint(0, VOCAB, (2, 20))
    full = model(ids)
    assert full.shape == (2, 20, VOCAB) and full.dtype == torch.float32
    dec, state = decode_logits(model, ids, prefill_len=9)
    rel = ((dec - full).abs().max() / full.abs().max()).item()
    assert rel < DECODE_REL.get(name, DECODE_REL_DEFAULT), rel
    assert isinstance(state, LMState) and state.position == 20
    assert model.state_bytes(state) == model.state_size(2, 20)


def test_prefill_and_decode_equal_full_forward_in_float64_for_atlas():
    """ATLAS's fp32 gap (DECODE_REL) is rounding that its Newton–Schulz step amplifies: in float64 the chunk
    and recurrent forms agree to DECODE_F64_REL."""
    model = LM(tiny_config("atlas")).double()
    ids = torch.randint(0, VOCAB, (2, 20))
    full = model(ids)
    dec, _ = decode_logits(model, ids, prefill_len=9)
    assert ((dec - full).abs().max() / full.abs().max()).item() < DECODE_F64_REL


@pytest.mark.parametrize("name", ZOO)
def test_cached_greedy_generation_equals_full_forwards(name):
    model = LM(tiny_config(name))
    prompt = torch.randint(0, VOCAB, (3, 5))
    out = model.generate(prompt, 12)
    assert out.shape == (3, 17) and torch.equal(out[:, :5], prompt)
    assert_same_greedy(model, prompt, 12)


def copy_batch(B, n, gen):
    """[x, SEP, x]: n content tokens from 2..VOCAB−1, the separator 1; the loss is on the copy."""
    x = torch.randint(2, VOCAB, (B, n), generator=gen)
    return torch.cat([x, torch.ones(B, 1, dtype=torch.long), x], dim=1)


@pytest.mark.parametrize("name", ZOO)
def test_trains_on_a_tiny_copy_task(name):
    torch.manual_seed(torch.seed())
    model = LM(tiny_config(name, d_model=32))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    n = 6
    ids = copy_batch(16, n, torch.Generator().manual_seed(torch.seed()))
    losses = []
    for _ in range(40):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits[:, n:].reshape(-1, VOCAB), ids[:, n + 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(map(lambda x: x == x, losses)), "nan loss"
    assert sum(losses[-3:]) / 3 < 0.5 * losses[0], losses


def test_hybrid_three_to_one():
    cfg = LMConfig(vocab_size=VOCAB, d_model=16, n_layers=4, num_heads=2, head_dim=8,
                   mixer=("gated_deltanet", "gated_deltanet", "gated_deltanet", "softmax_attention"))
    model = LM(cfg)
    kinds = [b.mixer.recipe.name for b in model.blocks]
    assert kinds == ["gated_deltanet"] * 3 + ["softmax_attention"]
    ids = torch.randint(0, VOCAB, (2, 14))
    dec, state = decode_logits(model, ids, 6)
    assert ((dec - model(ids)).abs().max() / model(ids).abs().max()).item() < DECODE_REL_DEFAULT
    assert [type(s.memory) for s in state.layers] == [torch.Tensor] * 3 + [KVCache]
    assert all(isinstance(s, MixerState) for s in state.layers)
    grow = model.state_size(2, 100) - model.state_size(2, 10)
    assert grow == 2 * 90 * 2 * (8 + 8) * 4  # only the softmax layer's KV cache grows
    assert_same_greedy(model, ids[:, :4], 8)


def test_sampling():
    model = LM(tiny_config("gated_deltanet"))
    prompt = torch.randint(0, VOCAB, (4, 3))
    greedy = model.generate(prompt, 6)
    assert torch.equal(model.generate(prompt, 6, do_sample=True, top_k=1), greedy)
    assert torch.equal(model.generate(prompt, 6, do_sample=True, top_p=1e-6), greedy)
    a = model.generate(prompt, 6, do_sample=True, temperature=2.0, generator=torch.Generator().manual_seed(3))
    b = model.generate(prompt, 6, do_sample=True, temperature=2.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.min() >= 0 and a.max() < VOCAB
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    draws = torch.stack([sample_next(logits, do_sample=True, top_k=2) for _ in range(200)])
    assert set(draws.flatten().tolist()) <= {2, 3}
    draws = torch.stack([sample_next(logits, do_sample=True, top_p=0.6) for _ in range(200)])
    assert set(draws.flatten().tolist()) == {3}  # p(3) ≈ 0.64 already reaches 0.6
    draws = torch.stack([sample_next(logits, do_sample=True, top_p=0.7) for _ in range(200)])
    assert set(draws.flatten().tolist()) <= {2, 3}
    assert model.generate(prompt, 0).shape == prompt.shape


def test_structure_and_errors():
    model = LM(tiny_config("softmax_attention", mlp="none"))
    assert all(b.mlp is None for b in model.blocks)
    names = [n for n, _ in model.named_parameters()]
    assert not any("head" in n for n in names)  # the head is the embedding (tied)
    with pytest.raises(GenerationError, match="input_ids must be an integer tensor"):
        model(torch.randn(2, 3))
    with pytest.raises(GenerationError, match="at least one token"):
        model.generate(torch.zeros(2, 0, dtype=torch.long), 3)
    with pytest.raises(GenerationError, match="max_new_tokens"):
        model.generate(torch.zeros(2, 1, dtype=torch.long), -1)
    with pytest.raises(GenerationError, match="temperature"):
        model.generate(torch.zeros(2, 1, dtype=torch.long), 2, do_sample=True, temperature=0)
    with pytest.raises(GenerationError, match="top_p"):
        model.generate(torch.zeros(2, 1, dtype=torch.long), 2, do_sample=True, top_p=1.5)
    _, st = model.prefill(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(GenerationError, match="one token"):
        model.step(torch.zeros(2, 2, dtype=torch.long), st)
    with pytest.raises(TypeError, match="LMConfig"):
        LM({"vocab_size": 3})


# ------------------------------------------------------------------ bad input (issue 12)
def _pair(mixers=("gated_deltanet", "softmax_attention"), d=16, vocab=32):
    return LM(LMConfig(vocab_size=vocab, d_model=d, n_layers=len(mixers), mixer=mixers, num_heads=2))


@pytest.mark.parametrize("bad", [[[40]], [[-1]], [[3, 32]]])
def test_token_ids_outside_the_vocabulary_are_an_input_error(bad):
    import fastweights as fw

    lm = _pair()
    ids = torch.tensor(bad)
    for call in (lambda: lm(ids), lambda: lm.prefill(ids), lambda: lm.generate(ids, 2)):
        with pytest.raises(fw.InputError, match=r"input_ids must be token ids in \[0, vocab_size=32\)"):
            call()
    _, st = lm.prefill(torch.randint(0, 32, (1, 4)))
    with pytest.raises(fw.InputError, match="token_ids must be token ids"):
        lm.step(ids[:, -1], st)


def test_padding_positions_may_hold_any_id_but_tokens_may_not():
    """Padding (attention_mask 0) is never read, so its ids are not looked up: a tokenizer's pad id
    past the vocabulary is accepted there (forward, hidden, prefill), and the logits of the real tokens
    are those of the same ids with another pad; an out-of-range id at a real token is still an error."""
    import fastweights as fw

    lm = _pair().double()
    ids = torch.randint(0, 32, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    pad_out, pad_in = ids.clone(), ids.clone()
    pad_out[1, :2], pad_in[1, :2] = 32, 0
    want = lm(pad_in, attention_mask=mask)
    assert torch.equal(lm(pad_out, attention_mask=mask)[1, 2:], want[1, 2:])
    assert torch.equal(lm.prefill(pad_out, attention_mask=mask)[0], lm.prefill(pad_in, attention_mask=mask)[0])
    bad = pad_out.clone()
    bad[0, 3] = 32
    with pytest.raises(fw.InputError, match=r"input_ids must be token ids in \[0, vocab_size=32\), got 32"):
        lm(bad, attention_mask=mask)


def test_a_batch_of_zero_rows_is_an_input_error():
    import fastweights as fw

    lm = _pair()
    with pytest.raises(fw.InputError, match="at least one sequence"):
        lm(torch.zeros(0, 5, dtype=torch.long))
    with pytest.raises(fw.InputError, match="at least one sequence"):
        lm.generate(torch.zeros(0, 5, dtype=torch.long), 3)


def test_token_ids_on_the_meta_device_are_an_input_error_naming_them():
    """(The vocabulary check read their values: torch's raw 'Tensor.item() cannot be called on meta tensors'.)"""
    import fastweights as fw

    with torch.device("meta"):
        lm = LM(tiny_config("gated_deltanet"))
    ids = torch.zeros(2, 5, dtype=torch.long, device="meta")
    for call in (lambda: lm(ids), lambda: lm.generate(ids, 2), lambda: lm.prefill(ids)):
        with pytest.raises(fw.InputError, match="^input_ids is on the meta device .*; give it on cpu or cuda$"):
            call()


def test_step_with_another_models_state_names_the_layer():
    lm = _pair()
    ids = torch.randint(0, 32, (2, 5))
    _, own = lm.prefill(ids)
    lm.step(ids[:, 0], own)  # its own state is fine
    _, other = _pair(("gla", "softmax_attention")).prefill(ids)  # same shapes, another mixer
    with pytest.raises(GenerationError, match="its layer 0 is gla, this model's layer 0 is gated_deltanet"):
        lm.step(ids[:, 0], other)
    _, wider = _pair(d=32).prefill(ids)
    with pytest.raises(GenerationError, match=r"layers\[0\] is not a state of this model's layer 0 \(gated_deltanet\)"):
        lm.step(ids[:, 0], wider)
    with pytest.raises(GenerationError, match="for 1 sequence"):
        lm.step(ids[:1, 0], own)  # the state holds 2 rows
    untagged = LMState(layers=wider.layers)  # a hand-built state: caught by its shapes
    with pytest.raises(GenerationError, match="memory has shape"):
        lm.prefill(ids, untagged)
    _, three = _pair(("gated_deltanet",) * 3).prefill(ids)
    with pytest.raises(GenerationError, match="2 layers: gated_deltanet, softmax_attention"):
        lm.step(ids[:, 0], three)


def test_generate_stops_at_eos_and_pads_ended_rows():
    torch.manual_seed(int(torch.randint(0, 2**30, ())))
    lm = _pair(("gated_deltanet",), vocab=16).eval()
    prompt = torch.randint(0, 16, (3, 4))
    ref = lm.generate(prompt, 12)
    eos = int(ref[0, 6])  # row 0's third new token
    out = lm.generate(prompt, 12, eos_token_id=eos, pad_token_id=0)
    for row, full in zip(out, ref):
        new, ref_new = row[4:], full[4:]
        hits = (ref_new == eos).nonzero()
        end = int(hits[0]) if len(hits) else None
        stop = len(new) if end is None else end + 1
        assert torch.equal(new[:stop], ref_new[:stop])  # identical up to and including the end token
        assert (new[stop:] == 0).all()  # padded after it
    ends = [(r[4:] == eos).nonzero() for r in ref]
    if all(len(e) for e in ends):  # every row ends: generation stops at the last row's end
        assert out.shape[1] == 4 + max(int(e[0]) for e in ends) + 1
    else:
        assert out.shape[1] == 4 + 12
    other = (eos + 1) % 16
    one = lm.generate(prompt[:1], 12, eos_token_id=[eos, other])  # either id ends the row
    assert one.shape[1] <= 4 + 3 and int(one[0, -1]) in (eos, other)
    assert torch.equal(lm.generate(prompt[:1], 12, eos_token_id=[eos, other], use_cache=False), one)
    with pytest.raises(GenerationError, match="eos_token_id must be a token id"):
        lm.generate(prompt, 3, eos_token_id=16)
    with pytest.raises(GenerationError, match="give eos_token_id too"):
        lm.generate(prompt, 3, pad_token_id=0)


def test_gradient_checkpointing_per_block_gives_the_same_gradients():
    model = LM(tiny_config("gated_deltanet", mixer=("gated_deltanet", "softmax_attention"), n_layers=4)).double()
    ids = torch.randint(0, VOCAB, (2, 9))
    model(ids).square().mean().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_gradient_checkpointing(every_n_layers=3)  # blocks 0 and 3
    runs = []
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: runs.append(i))
    model(ids).square().mean().backward()
    assert sorted(runs) == [0, 0, 1, 2, 3, 3] and model.gradient_checkpointing
    assert all((p.grad - r).abs().max() < CHECKPOINT_F64 for p, r in zip(model.parameters(), ref))
    model.set_gradient_checkpointing(False)
    assert not model.gradient_checkpointing
    with pytest.raises(ValueError, match="every_n_layers"):
        model.set_gradient_checkpointing(every_n_layers=0)


@pytest.mark.parametrize("value", ["no", "False", 0, 1, None, [False]])
def test_gradient_checkpointing_takes_a_bool_only(value):
    """A string such as "no" (truthy) once turned checkpointing on: every value but True / False is refused."""
    model = LM(tiny_config("deltanet"))
    with pytest.raises(TypeError, match=f"^enable must be a bool \\(True or False\\), got {re.escape(repr(value))}"):
        model.set_gradient_checkpointing(value)
    assert not model.gradient_checkpointing
    with pytest.raises(TypeError, match="^checkpoint_fn must be None or a callable"):
        model.set_gradient_checkpointing(True, checkpoint_fn="torch.utils.checkpoint")
    assert not model.gradient_checkpointing


def test_sample_next_takes_a_bool_do_sample():
    logits = torch.randn(2, VOCAB)
    with pytest.raises(TypeError, match="^do_sample must be a bool"):
        sample_next(logits, do_sample="no")
