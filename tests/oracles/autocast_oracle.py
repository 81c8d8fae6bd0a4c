"""PyTorch autocast's bfloat16 mixed precision on the GPT of :mod:`torch_reference`: the oracle of
``GPT(..., precision="bf16")`` (tests/system/test_bf16.py). Imports nothing from ``pedestrian``.

The model is written as a ``torch.nn`` user writes it (``F.linear``, ``F.gelu`` / ``F.silu``,
``F.layer_norm`` / RMS norm, a hand-written attention, ``F.cross_entropy``) and run under
``torch.autocast(device_type="cpu", dtype=torch.bfloat16)``; autograd gives the float32
gradients. The CPU's autocast lists differ from CUDA's (on the CPU, layer norm, softmax and
log-softmax run in the input's dtype), so CUDA's float32 list is applied here by hand: the
norms, the softmax and the cross-entropy take ``x.float()``, as CUDA autocast casts them. So:

- products (``F.linear``, ``@``): bfloat16 operands (weights cast from their float32 masters),
  fp32 accumulation, one rounding of the result to bfloat16;
- the residual stream ``x + a4`` (float32 + bfloat16) is float32 (type promotion);
- norms, softmax, loss in float32; activations on bfloat16 inputs (computed in float32 inside
  torch's kernels, the result rounded to bfloat16);
- gradients reach the float32 parameters through autocast's casts (each cast's backward
  converts the gradient back to float32) and are summed there in float32 (tied weights: the
  head's and the lookup's parts).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from torch_reference import _rope, derived_dims  # noqa: E402  (tests/oracles on sys.path)

__all__ = ["autocast_loss_and_grads"]


def _norm(cfg: dict, params: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    """A norm in float32 (CUDA autocast's list): the input widened first."""
    x, w, eps = x.float(), params[f"{name}.weight"], float(cfg["ln_eps"])
    if cfg.get("norm", "layernorm") == "rmsnorm":
        return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w
    return F.layer_norm(x, (x.shape[-1],), w, params.get(f"{name}.bias"), eps)


def _linear(params: dict, name: str, x: torch.Tensor, weight=None, bias: bool = True) -> torch.Tensor:
    W = params[f"{name}.weight"] if weight is None else weight                # (f_in, f_out)
    return F.linear(x, W.t(), params.get(f"{name}.bias") if bias else None)  # autocast: bfloat16


def _activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "relu":
        return F.relu(x)
    if kind == "gelu":
        return F.gelu(x)
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if kind == "silu":
        return F.silu(x)
    raise ValueError(f"unknown activation {kind!r}")


def _forward(params: dict, cfg: dict, tok: torch.Tensor) -> torch.Tensor:
    dd = derived_dims(cfg)
    B, T = tok.shape
    H, dqk, dh, Hkv = dd["n_heads"], dd["d_qk"], dd["d_head"], dd["n_kv_heads"]
    group = H // Hkv
    pos = torch.arange(T)
    rope = cfg.get("position_encoding", "learned") == "rope"
    x = params["tok_emb.weight"][tok]                                         # (B, T, d) float32
    if cfg.get("position_encoding", "learned") == "learned":
        x = x + params["pos_emb.weight"][pos][None]
    future = torch.arange(T)[None, :] > torch.arange(T)[:, None]
    for i in range(dd["n_blocks"]):
        p = f"blocks.{i}"
        a2 = _norm(cfg, params, f"{p}.ln1", x)                                # float32
        q, k, v = (_linear(params, f"{p}.attn.{n}", a2) for n in "qkv")       # bfloat16
        if rope:
            q = _rope(q, H, dqk, pos, float(cfg["rope_base"]), float(cfg["rope_fraction"]), cfg.get("rope_scaling"))
            k = _rope(k, Hkv, dqk, pos, float(cfg["rope_base"]), float(cfg["rope_fraction"]), cfg.get("rope_scaling"))
        heads = []
        for h in range(H):
            j = h // group
            S = (q[..., h * dqk:(h + 1) * dqk] @ k[..., j * dqk:(j + 1) * dqk].transpose(-1, -2)) / math.sqrt(dqk)
            if cfg["causal"]:
                S = S.masked_fill(future, float("-inf"))
            P = torch.softmax(S.float(), dim=-1)                              # float32 (CUDA's list)
            heads.append(P @ v[..., j * dh:(j + 1) * dh])                     # bfloat16
        a4 = _linear(params, f"{p}.attn_proj", torch.cat(heads, dim=-1))
        a5 = x + a4                                                           # float32
        a6 = _norm(cfg, params, f"{p}.ln2", a5)
        if cfg.get("mlp", "standard") == "swiglu":
            a8 = F.silu(_linear(params, f"{p}.mlp_gate", a6)) * _linear(params, f"{p}.mlp_expand", a6)
        else:
            a8 = _activation(_linear(params, f"{p}.mlp_expand", a6), cfg["activation"])
        x = a5 + _linear(params, f"{p}.mlp_contract", a8)                     # float32
    a11 = _norm(cfg, params, "ln_final", x)
    if cfg["tie_weights"]:
        return _linear(params, "logits", a11, weight=params["tok_emb.weight"].t(), bias=False)
    return _linear(params, "logits", a11)                                    # bfloat16


def autocast_loss_and_grads(params_f32: dict, cfg: dict, tokens, targets):
    """``(loss, grads)`` of one step under bfloat16 autocast: ``params_f32`` ``name -> float32
    array`` (pedestrian's names and ``(f_in, f_out)`` layout), ``tokens``, ``targets`` ``(B, T)``
    (``-100``: ignored). ``loss`` a float; ``grads`` ``name -> float32 tensor``."""
    params = {n: torch.tensor(v, dtype=torch.float32, requires_grad=True) for n, v in params_f32.items()}
    tok, tgt = torch.as_tensor(tokens, dtype=torch.long), torch.as_tensor(targets, dtype=torch.long)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logits = _forward(params, cfg, tok)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in params.items() if p.grad is not None}
