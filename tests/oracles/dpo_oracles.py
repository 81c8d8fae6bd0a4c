"""transformers' Llama as DPO's oracle (tests/system/test_dpo.py, test_dpo_trl.py): a float64
``LlamaForCausalLM``, pedestrian's model with its weights and LoRA adapters, the adapters added
to transformers' linears by forward hooks, and the DPO formula in torch (autograd)."""

from __future__ import annotations

import numpy as np
import pytest

from pedestrian import GPT

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from pedestrian.interop.hf_llama_config import config_from_hf  # noqa: E402
from pedestrian.interop.hf_llama_tensors import llama_state_from_hf  # noqa: E402

BETA = 0.1
TINY = dict(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5)
#: pedestrian layer kind -> the Llama module it adapts
MODULES = {"attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj",
           "attn_proj": "self_attn.o_proj", "mlp_gate": "mlp.gate_proj", "mlp_expand": "mlp.up_proj",
           "mlp_contract": "mlp.down_proj"}


def _rms_forward(self, x):
    """``LlamaRMSNorm.forward`` without its float32 casts (the same formula, float64 throughout)."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def hf_llama(tied: bool, seed: int = 0, **overrides):
    """A random float64 ``LlamaForCausalLM`` (float64 throughout: SDPA attention, the norm's
    formula and the rotary angles formed in float64, as tests/paper/test_llama_model.py does)
    and its pedestrian config."""
    cfg = transformers.LlamaConfig(**{**TINY, **overrides}, tie_word_embeddings=tied, attn_implementation="sdpa")
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0.0, 0.3)
    config = config_from_hf(cfg.to_dict())
    j = np.arange(config.d_qk // 2, dtype=np.float64)
    inv_freq = torch.as_tensor(config.rope_base ** (-2.0 * j / config.d_qk))

    def rotary_forward(x, position_ids):
        angle = position_ids[..., None].double() * inv_freq
        emb = torch.cat((angle, angle), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    hf.model.rotary_emb.forward = rotary_forward
    for module in hf.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = _rms_forward.__get__(module)
    return hf, config


def pedestrian_llama(hf, config, kernels, *, lora: bool = True, freeze_base: bool = True, seed: int = 3,
                     backend: str = "numpy"):
    """pedestrian's model with transformers' weights and (``lora``) adapters on every layer kind
    but the head, ``U`` drawn non-zero (a zero ``U`` would hide a wrong ``D`` gradient)."""
    model = GPT(config, dtype="float64", kernels=kernels, backend=backend)
    model.load_state_dict(llama_state_from_hf({k: v.detach().numpy() for k, v in hf.state_dict().items()}, config))
    if lora:
        model.add_lora(["q", "k", "v", "attn_proj", "mlp_gate", "mlp_expand", "mlp_contract"], 2, 0.7, seed=seed,
                       freeze_base=freeze_base)
        rng = np.random.default_rng(seed)
        for name, p in model.params.items():
            if name.endswith("lora_U"):
                p[...] = model.to_xp(rng.normal(0.0, 0.3, p.shape))
    return model


def pairs_batch(config, P=2, T=11, seed=1):
    """``2P`` rows (chosen, then rejected): random ids, the first 2-4 targets of a row ignored
    (its prompt) and some rows padded at the end with ignored targets."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, size=(2 * P, T))
    targets = rng.integers(0, config.vocab_size, size=(2 * P, T))
    for b in range(2 * P):
        targets[b, :rng.integers(2, 5)] = -100
    targets[1, T - 3:] = -100
    targets[2 * P - 1, T - 1:] = -100
    return tokens, targets


class TorchPolicy:
    """transformers' model with ``α x D U`` added to each adapted linear's output (forward hooks)."""

    def __init__(self, hf, model):
        self.hf, self.leaves, self.hooks = hf, {}, []
        for name in model.lora_targets:
            i, kind = name.split(".", 2)[1], name.split(".", 2)[2]
            module = hf.model.layers[int(i)].get_submodule(MODULES[kind])
            D = torch.tensor(model.params[f"{name}.lora_D"], requires_grad=True)
            U = torch.tensor(model.params[f"{name}.lora_U"], requires_grad=True)
            self.leaves[f"{name}.lora_D"], self.leaves[f"{name}.lora_U"] = D, U
            alpha = model.lora_alphas[name]
            self.hooks.append(module.register_forward_hook(
                lambda mod, args, out, D=D, U=U, alpha=alpha: out + alpha * (args[0] @ D) @ U))

    def remove(self):
        for h in self.hooks:
            h.remove()


def torch_logps(hf, tokens, targets):
    """``ℓ`` per row, autograd-tracked."""
    logits = hf(input_ids=torch.as_tensor(tokens)).logits                      # (2P, T, V)
    y = torch.as_tensor(targets)
    counted = y != -100
    lp = torch.log_softmax(logits, dim=-1).gather(-1, y.clamp(min=0)[..., None])[..., 0]
    return (lp * counted).sum(dim=1)


def torch_dpo(logp, ref, beta=BETA):
    P = logp.shape[0] // 2
    m = beta * ((logp[:P] - ref[:P]) - (logp[P:] - ref[P:]))
    return -torch.nn.functional.logsigmoid(m).mean(), m


def hf_grads(hf, config):
    grads = {k: p.grad.numpy() for k, p in hf.named_parameters()}
    if config.tie_weights:
        grads.pop("lm_head.weight", None)
    return llama_state_from_hf(grads, config)
