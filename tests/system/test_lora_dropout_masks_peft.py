"""LoRA dropout draws the masks PEFT draws: one per PEFT module. PEFT's ``lora_dropout`` calls are
counted with forward hooks on a transformers model (a Llama with q, k, v, o, gate, up, down
adapted: 7 a block; a GPT-2 with c_attn, c_proj, c_fc, mlp.c_proj: 4, its q, k, v being one
``c_attn``); pedestrian's draws are counted on the same folder's model in one training forward."""

from __future__ import annotations

import re

import numpy as np
import pytest
from chat_fixtures import hf_instruct_model
from hf_fixtures import hf_model as gpt2_model
from hf_fixtures import save_hf_dir, torch, transformers

from pedestrian.interop.hf import load_hf_model

peft = pytest.importorskip("peft")
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

LLAMA = (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
         ["q", "k", "v", "attn_proj", "mlp_gate", "mlp_expand", "mlp_contract"])
GPT2 = (["c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"], ["q", "k", "v", "attn_proj", "mlp_expand", "mlp_contract"])


def peft_counts(hf, modules, x) -> dict[int, int]:
    """``{block: lora_dropout calls}`` in one training forward of PEFT's model."""
    model = peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.25,
                                                    target_modules=modules)).train()
    counts: dict[int, int] = {}
    for name, module in model.named_modules():
        if name.endswith("lora_dropout.default"):
            block = int(re.search(r"\.(?:layers|h)\.(\d+)\.", name).group(1))
            module.register_forward_hook(lambda *_, b=block: counts.__setitem__(b, counts.get(b, 0) + 1))
    model(torch.as_tensor(x))
    return counts


def pedestrian_draws(d, targets, x) -> list:
    """The adapter-dropout masks one training forward draws, in order."""
    model = load_hf_model(d, dtype="float64")
    model.add_lora(targets, rank=2, dropout=0.25)
    model.training = True
    draws = []
    draw = model._lora_mask

    def counted(a):
        draws.append(draw(a))
        return draws[-1]

    model._lora_mask = counted
    model.forward(x)
    return draws


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_mask_counts_per_block_equal_peft(tmp_path, family):
    if family == "llama":
        hf, (modules, targets) = hf_instruct_model("llama3"), LLAMA
        hf.save_pretrained(str(tmp_path))
        per_block = 7
    else:
        hf, (modules, targets) = gpt2_model(), GPT2
        save_hf_dir(hf, tmp_path)
        per_block = 4
    x = np.random.default_rng(0).integers(0, 200, (2, 6))
    counts = peft_counts(hf.float(), modules, x)
    n_blocks = hf.config.num_hidden_layers
    assert counts == {i: per_block for i in range(n_blocks)}
    draws = pedestrian_draws(tmp_path, targets, x)
    assert len(draws) == per_block * n_blocks                          # the same draws, block by block
    first = draws[:per_block]
    assert all(m is not None for m in first)
    if family == "llama":                              # q, k, v: three masks of the same input, each its own
        assert not np.array_equal(first[0], first[1]) and not np.array_equal(first[1], first[2])


def test_llama_gradients_with_dropout_equal_peft_with_the_same_masks(tmp_path):
    """Training with dropout on all 7 Llama projections: the loss and every adapter gradient equal
    PEFT's autograd with its dropout modules holding the masks pedestrian drew (float64), so each
    of q, k, v (and gate, up) takes its own mask where PEFT's module does."""
    import copy

    from lora_masks import replay_masks

    from pedestrian.interop.peft_modules import peft_module

    hf = hf_instruct_model("llama3")
    hf.save_pretrained(str(tmp_path))
    x = np.random.default_rng(1).integers(0, 200, (2, 6))
    y = np.roll(x, -1, axis=1)
    model = load_hf_model(tmp_path, dtype="float64")
    model.add_lora(LLAMA[1], rank=2, alpha=1.5, dropout=0.25, seed=4)
    rng = np.random.default_rng(2)
    for k in model.lora_state_dict():                     # U != 0, so the masks change the loss
        model.params[k][...] = rng.normal(0, 0.3, model.params[k].shape)
    model.training = True
    masks = replay_masks(model, copy.deepcopy(model.dropout_rng), *x.shape)
    loss = model.loss(x, y)
    grads = model.backward()

    class FixedMask(torch.nn.Module):
        def __init__(self, mask):
            super().__init__()
            self.mask = torch.as_tensor(mask)

        def forward(self, a):
            return a * self.mask

    ref = peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=3, lora_dropout=0.25,
                                                  target_modules=LLAMA[0])).double().train()
    names = {peft_module(fc, model.config)[0]: fc for fc in model.lora_targets}
    for name, module in ref.named_modules():
        if hasattr(module, "lora_dropout") and "default" in module.lora_dropout:
            fc = names[name.removeprefix("base_model.model.")]
            module.lora_dropout["default"] = FixedMask(masks[fc])
            with torch.no_grad():                          # PEFT's A = D^T, B = U^T
                module.lora_A["default"].weight.copy_(torch.as_tensor(model.params[f"{fc}.lora_D"].T))
                module.lora_B["default"].weight.copy_(torch.as_tensor(model.params[f"{fc}.lora_U"].T))
    logits = ref(torch.as_tensor(x)).logits
    ref_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.as_tensor(y).reshape(-1))
    ref_loss.backward()
    # transformers keeps its rotary table and RMSNorm in float32 (tests/system/test_hf_llama_dirs.py):
    # agreement to ~1e-7 relative, where a mask shared by q, k, v instead of three would differ at O(1)
    assert abs(loss - ref_loss.item()) <= 1e-6 * abs(loss)
    for name, module in ref.named_modules():
        if hasattr(module, "lora_dropout") and "default" in module.lora_dropout:
            fc = names[name.removeprefix("base_model.model.")]
            for ours, theirs in ((grads[f"{fc}.lora_D"], module.lora_A["default"].weight.grad.T),
                                 (grads[f"{fc}.lora_U"], module.lora_B["default"].weight.grad.T)):
                theirs = theirs.numpy()
                assert np.max(np.abs(ours - theirs)) <= 1e-5 * np.max(np.abs(theirs)), fc
