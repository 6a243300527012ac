"""A transformers Qwen3-Next whose linear-attention layers were swapped for fastweights' (`swap_linear_attention`)
runs fastweights' Triton kernels on a GPU (the layer's routes: chunk form "triton" on "cuda"), and its logits over a
prompt and a left-padded batch stay those of the original model (fp32; the kernels' fp32 dots use TF32 operands
where Triton picks them, hence the tolerance)."""

import pytest
import torch

from tests.tolerances import SWAP_CUDA_TF32_REL

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_swapped_qwen3_next_runs_the_triton_rows_on_cuda():
    from transformers.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM

    import fastweights.convert as fc
    from fastweights.convert import qwen3_next
    from tests.convert.test_transformers_layers import randomize

    cfg = Qwen3NextConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                          linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
                          linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=32, rms_norm_eps=1e-6, max_position_embeddings=512,
                          layer_types=["linear_attention", "full_attention"], pad_token_id=0)
    torch.manual_seed(torch.seed() % 2**31)
    orig = randomize(Qwen3NextForCausalLM(cfg)).eval().cuda()
    for p in orig.parameters():
        p.data.mul_(0.3)  # (randomize's scale, smaller: 128-wide layers)
    import copy

    model = qwen3_next.swap_linear_attention(copy.deepcopy(orig))
    ids = torch.randint(1, 64, (2, 200), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    with torch.no_grad():
        want = orig(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask).logits
    layers = [m for m in model.modules() if isinstance(m, fc.AsTransformersLayer)]
    assert layers and all(m.mixer.routes.get("chunk") == ("triton", "cuda") for m in layers), \
        [m.mixer.routes for m in layers]
    real = mask.bool()
    err = ((got - want)[real].abs().max() / want[real].abs().max()).item()
    assert err < SWAP_CUDA_TF32_REL, err
