"""Whole transformers models on fastweights' linear-attention layers (`swap_linear_attention`): tiny
random Qwen3-Next and Kimi-Linear models (both in transformers 5.17 and 5.24, CI's two environments:
imported here, so a release without one fails rather than skips) generate token-equal to themselves
after the swap — greedy, a left-padded batch, beam search, seeded sampling; fp32 — with transformers'
own cache and padding;
the cache holds the state in transformers' layout (a prefill by the original layer continues on
ours), and the swapped layers run through fastweights' routed functional API."""

import copy

import pytest
import torch
from transformers.models.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM
from transformers.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM

import fastweights.convert as fc
from fastweights.convert import kimi_linear, qwen3_next
from tests.convert.test_transformers_layers import randomize, rel_err
from tests.tolerances import CONVERT_MODEL_F32_REL

D, VOCAB = 32, 64
TOKENS = dict(pad_token_id=0, bos_token_id=None, eos_token_id=None)  # no early stop: every row generates N tokens


def qwen3_next_model():
    cfg = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                          linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
                          linear_conv_kernel_dim=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                          shared_expert_intermediate_size=16, rms_norm_eps=1e-6, max_position_embeddings=64,
                          layer_types=["linear_attention", "full_attention"], **TOKENS)
    return randomize(Qwen3NextForCausalLM(cfg)).eval()


def kimi_linear_model():
    cfg = KimiLinearConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=4,
                           qk_nope_head_dim=4, v_head_dim=8, moe_intermediate_size=16, num_local_experts=4,
                           num_experts_per_tok=2, linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4,
                           max_position_embeddings=64, layer_types=["linear_attention", "full_attention"], **TOKENS)
    return randomize(KimiLinearForCausalLM(cfg)).eval()


MODELS = {"qwen3_next": (qwen3_next_model, qwen3_next.swap_linear_attention),
          "kimi_linear": (kimi_linear_model, kimi_linear.swap_linear_attention)}


def swapped_layers(model) -> list:
    return [m for m in model.modules() if isinstance(m, fc.AsTransformersLayer)]


def left_padded(B=3, T=7):
    """ids [B, T] with rows 1.. left-padded by 1.. tokens (pad id 0), and their attention_mask."""
    ids = torch.randint(1, VOCAB, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    for b in range(1, B):
        mask[b, :b] = 0
        ids[b, :b] = 0
    return ids, mask


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("generic", [False, True])
def test_a_swapped_model_generates_token_equal_to_the_original(name, generic):
    build, swap = MODELS[name]
    model = build()
    ids, mask = left_padded()
    seed = int(torch.randint(0, 2**31, ()))

    def generations():
        """greedy (one prompt; the left-padded batch), beam search (cache rows reordered), sampling (seeded)."""
        torch.manual_seed(seed)
        return (model.generate(ids[:1], max_new_tokens=6, do_sample=False),
                model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False),
                model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, num_beams=2),
                model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=True, top_k=8))

    with torch.no_grad():
        want = generations()
        want_logits = model(ids, attention_mask=mask).logits
        assert (fc.swap_linear_attention if generic else swap)(model) is model
        assert len(swapped_layers(model)) == 1
        got = generations()
        got_logits = model(ids, attention_mask=mask).logits
    for kind, a, b in zip(("greedy", "greedy, padded", "beam search", "sampling"), got, want):
        assert torch.equal(a, b), kind
    real = mask.bool()
    assert rel_err(got_logits[real], want_logits[real]) < CONVERT_MODEL_F32_REL
    # the mixer ran fastweights' routed functional API: the chunk form for the prompt, the recurrent step after
    routes = swapped_layers(model)[0].mixer.routes
    assert {"chunk", "recurrent"} <= set(routes) and routes["chunk"][1] == "cpu"


@pytest.mark.parametrize("name", MODELS)
def test_the_cache_holds_the_state_in_transformers_layout(name):
    """A prompt prefilled by transformers' own layer continues on fastweights' (one token, then three)
    as on transformers': the conv inputs and the memory sit where transformers keeps them."""
    build, swap = MODELS[name]
    model = build()
    ours = swap(copy.deepcopy(model))
    assert len(swapped_layers(ours)) == 1 and not swapped_layers(model)
    ids = torch.randint(1, VOCAB, (2, 12))
    with torch.no_grad():
        out = model(ids[:, :8], use_cache=True)
        cache, cache_ours = out.past_key_values, copy.deepcopy(out.past_key_values)
        for a, b in ((8, 9), (9, 12)):
            want = model(ids[:, a:b], past_key_values=cache, use_cache=True).logits
            got = ours(ids[:, a:b], past_key_values=cache_ours, use_cache=True).logits
            assert rel_err(got, want) < CONVERT_MODEL_F32_REL


def test_what_a_swapped_layer_cannot_keep_is_refused():
    model = qwen3_next_model()
    with pytest.raises(fc.ConversionError, match="has no Qwen3NextGatedDeltaNet or KimiLinearDeltaAttention layer"):
        fc.swap_linear_attention(torch.nn.Linear(2, 2))
    with pytest.raises(fc.ConversionError, match="has no KimiLinearDeltaAttention layer"):
        kimi_linear.swap_linear_attention(model)
    layer = swapped_layers(qwen3_next.swap_linear_attention(model))[0]
    x = torch.randn(2, 5, D)
    with pytest.raises(fc.ConversionError, match=r"attention_mask must be transformers' 2-D padding mask \[B, T\]"):
        layer(x, attention_mask=torch.ones(2, 1, 5, 5))
    with pytest.raises(fc.ConversionError, match="packed sequences"):
        layer(x, cu_seq_lens_q=torch.tensor([0, 2, 5]))
    with torch.no_grad():
        cache = model(torch.randint(1, VOCAB, (2, 4)), use_cache=True).past_key_values
    cache.layers[0].record_past = True
    with pytest.raises(fc.ConversionError, match="records past states"):
        layer(x, cache=cache)
    with pytest.raises(fc.ConversionError, match="without layer_idx"):
        fc.AsTransformersLayer(layer.mixer)(x, cache=cache)
