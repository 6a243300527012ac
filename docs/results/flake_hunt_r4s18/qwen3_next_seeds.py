"""r4s18: the swapped tiny Qwen3-Next model's logits against the model itself (tests/convert/test_transformers_layers.py,
CONVERT_MODEL_F32_REL) over seeds [A, B): median, 90th percentile, max and the five worst. Usage:
PYTHONPATH=. python qwen3_next_seeds.py 0 2000"""
import sys, torch, copy
sys.argv=sys.argv
from tests.convert.test_transformers_layers import *  # noqa
import tests.convert.test_transformers_layers as M
import fastweights.convert as fc
errs=[]
for seed in range(int(sys.argv[1]), int(sys.argv[2])):
    torch.manual_seed(seed)
    cfg = M.Qwen3NextConfig(vocab_size=64, hidden_size=M.D, intermediate_size=48, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                          linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                          shared_expert_intermediate_size=16, rms_norm_eps=1e-6,
                          layer_types=["linear_attention"] * 3 + ["full_attention"])
    model = M.randomize(M.Qwen3NextForCausalLM(cfg)).eval()
    ids = torch.randint(0, 64, (2, 21))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        fc.swap_linear_attention(model)
        got = model(ids, use_cache=False).logits
    errs.append((M.rel_err(got, want), seed))
errs.sort()
import statistics
v=[e for e,_ in errs]
print("n", len(v), "median %.3g p90 %.3g max %.3g" % (statistics.median(v), v[int(.9*len(v))], v[-1]), errs[-5:])
