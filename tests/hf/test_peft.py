"""PEFT adapters, hooks and changed Linears reach the fast-weight layers' projections: a LoRA adapter on
every Linear of every zoo mixer trains (the base weights stay, every adapter moves) and the adapted
model's logits are the merged model's; a forward hook, a pre-hook and a Linear subclass (a stand-in for a
quantised Linear) on a projection change the logits exactly as the equivalent weights do. (The layers fuse
their projections into one matmul only while each is a plain, unhooked nn.Linear.)"""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

import fastweights as fw
import fastweights.hf as fh
from fastweights.models import LM
from tests.models.test_lm import VOCAB, tiny_config
from tests.tolerances import LORA_MERGED_F64_REL

ZOO = fw.zoo.names()


def mixer_linears(model) -> list[str]:
    """The names of every nn.Linear inside the model's mixers (projections and gates)."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and ".mixer." in name]


def train(model, steps: int = 3, lr: float = 1e-2) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 8))
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("name", ZOO)
def test_lora_on_every_mixer_projection_trains_and_equals_the_merged_model(name):
    model = fh.from_lm(LM(tiny_config(name, n_layers=1)).double())
    targets = mixer_linears(model)
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= {t.rsplit(".", 1)[-1] for t in targets}
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=targets, lora_dropout=0.0))
    base = {k: v.clone() for k, v in peft_model.named_parameters() if not v.requires_grad}
    adapters = {k: v.clone() for k, v in peft_model.named_parameters() if v.requires_grad}
    assert adapters and all("lora_" in k for k in adapters)
    train(peft_model)
    after = dict(peft_model.named_parameters())
    assert all(torch.equal(after[k], v) for k, v in base.items())  # the base weights stay
    still = [k for k, v in adapters.items() if "lora_B" in k and torch.equal(after[k], v)]
    assert not still, f"adapters that got no gradient: {still}"
    ids = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        adapted = peft_model(input_ids=ids).logits
        merged = peft_model.merge_and_unload()(input_ids=ids).logits
    assert (adapted - merged).abs().max() <= LORA_MERGED_F64_REL * merged.abs().max()


def test_lora_with_a_nonzero_start_changes_the_logits_as_its_merged_weights_do():
    """An adapter that starts away from zero (as PiSSA / OLoRA initializations do) acts at once, on the
    projections and on an untied head."""
    model = fh.from_lm(LM(tiny_config("gated_deltanet", n_layers=1, tie_word_embeddings=False)).double())
    ids = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "k_proj", "v_proj", "lm_head"],
                                                  init_lora_weights=False))
    with torch.no_grad():
        adapted = peft_model(input_ids=ids).logits
        merged = peft_model.merge_and_unload()(input_ids=ids).logits
    assert (adapted - plain).abs().max() > 1e3 * LORA_MERGED_F64_REL * plain.abs().max()
    assert (adapted - merged).abs().max() <= LORA_MERGED_F64_REL * merged.abs().max()


class RoundedLinear(nn.Linear):
    """A Linear whose forward rounds its weight to multiples of 1/8 (a quantised Linear's stand-in)."""

    def forward(self, x):
        return nn.functional.linear(x, torch.round(self.weight * 8) / 8)


@pytest.mark.parametrize("how", ["forward_hook", "pre_hook", "subclass", "global_hook"])
def test_a_hooked_or_changed_projection_is_honoured(how):
    lm = LM(tiny_config("gated_deltanet", n_layers=1)).double()
    mixer = lm.blocks[0].mixer
    ids = torch.randint(0, VOCAB, (2, 8))
    reference = LM(lm.config).double()
    reference.load_state_dict(lm.state_dict())
    ref_q = reference.blocks[0].mixer.q_proj
    with torch.no_grad():  # the weights whose plain matmul is what the hook or the subclass computes
        if how == "subclass":
            ref_q.weight.copy_(torch.round(ref_q.weight * 8) / 8)
        elif how != "global_hook":
            ref_q.weight.mul_(3.0)
    handles = []
    if how == "forward_hook":
        handles.append(mixer.q_proj.register_forward_hook(lambda m, args, out: out * 3.0))
    elif how == "pre_hook":
        handles.append(mixer.q_proj.register_forward_pre_hook(lambda m, args: (args[0] * 3.0,)))
    elif how == "subclass":
        q = RoundedLinear(mixer.q_proj.in_features, mixer.q_proj.out_features, bias=False).double()
        q.load_state_dict(mixer.q_proj.state_dict())
        mixer.q_proj = q
    else:  # a global hook sees every module call: here, it counts the calls of q_proj
        seen = []
        handles.append(nn.modules.module.register_module_forward_hook(
            lambda m, args, out: seen.append(m) if m is mixer.q_proj else None))
    try:
        with torch.no_grad():
            got = lm(ids)
    finally:
        for h in handles:
            h.remove()
    if how == "global_hook":
        assert seen == [mixer.q_proj]
    with torch.no_grad():
        want = reference(ids)
        plain = LM.forward(lm, ids) if how != "subclass" else None  # the hooks removed
    assert (got - want).abs().max() <= LORA_MERGED_F64_REL * want.abs().max()
    if plain is not None and how != "global_hook":  # the hook did change the logits
        assert (got - plain).abs().max() > 1e3 * LORA_MERGED_F64_REL * plain.abs().max()
