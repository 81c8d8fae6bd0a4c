"""``pedestrian demo --check autograd``: the paper's own check, every gradient against PyTorch autograd.

Optional, and the only place the ``pedestrian`` package runs an autograd engine: PyTorch is
imported here, lazily, when this check is asked for (``pip install -e ".[torch]"``). The library
itself never calls it -- this is an *oracle*, as in the test suite.

:func:`autograd_gradients` restates the GPT's forward pass (docs/EQUATIONS.md, "The minimal GPT")
in plain torch operations, on a copy of the model's parameters, and lets autograd produce the loss,
every parameter gradient, every error signal ``Δ1 … Δ12`` and each block's ``Δcausal`` (the
gradient at the masked, scaled scores ``ρ_causal``). It imports none of the library's layer
functions, so a mistake in them cannot hide in both sides. Configurations it restates: learned or
no positions, any activation, layer-norm ``eps``, biases or not, tied or untied logits, causal or
not; no RoPE, LoRA or dropout (the demo's model has none of them).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["AUTOGRAD_RTOL", "autograd_gradients"]

#: per tensor, ``max|ours − autograd| <= AUTOGRAD_RTOL · max|autograd|`` passes (float64: the two
#: sides differ by rounding only; tests/paper/test_model.py holds them to the same bound)
AUTOGRAD_RTOL = 1e-9


def autograd_gradients(model, tokens, targets) -> tuple[float, dict, dict]:
    """Loss, parameter gradients and error signals of ``model`` on one batch, by PyTorch autograd.

    Args:
        model: a :class:`pedestrian.GPT` (any dtype; the oracle runs in float64).
        tokens, targets: ``(B, T)`` integer ids (targets ``-100`` are ignored).

    Returns:
        ``(loss, grads, deltas)``: ``grads`` maps every name of ``model.params`` to a float64
        array; ``deltas`` uses the keys of :meth:`GPT.deltas` (``"Δ12"``, ``"Δ11"``,
        ``"blocks.{i}.Δ10"`` … ``"blocks.{i}.Δ2"``, ``"blocks.{i}.Δcausal"`` ``(B, n_heads, T, T)``,
        ``"Δ1"``).

    Raises:
        ImportError: PyTorch is not installed.
        ValueError: a configuration this oracle does not restate (RoPE, LoRA, dropout).
    """
    import torch

    c = model.config
    if c.position_encoding == "rope" or model.lora_targets or c.dropout:
        raise ValueError("--check autograd restates models without RoPE, LoRA or dropout only")
    P = {k: torch.tensor(np.asarray(v, dtype=np.float64), requires_grad=True)
         for k, v in model.state_dict().items()}
    tok = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    tgt = torch.as_tensor(np.asarray(targets), dtype=torch.long)
    B, T = tok.shape
    H, dqk, dh = c.n_heads, c.d_qk, c.d_head
    kept: dict = {}

    def keep(name, t):
        t.retain_grad()
        kept[name] = t
        return t

    def norm(x, name):
        mu = x.mean(-1, keepdim=True)
        xhat = (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + c.ln_eps)
        y = xhat * P[name + ".weight"]
        return y + P[name + ".bias"] if name + ".bias" in P else y

    def fc(x, name):
        y = x @ P[name + ".weight"]
        return y + P[name + ".bias"] if name + ".bias" in P else y

    def heads(t, width):                                     # (B, T, H·w) -> (B, H, T, w)
        return t.reshape(B, T, H, width).transpose(1, 2)

    activation = {"relu": torch.relu, "gelu": torch.nn.functional.gelu,
                  "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}[c.activation]
    future = torch.arange(T)[None, :] > torch.arange(T)[:, None]        # key after query
    a1 = P["tok_emb.weight"][tok]
    if "pos_emb.weight" in P:
        a1 = a1 + P["pos_emb.weight"][:T][None]
    x = keep("Δ1", a1)
    for i in range(c.n_blocks):
        p = f"blocks.{i}."
        a2 = keep(p + "Δ2", norm(x, p + "ln1"))
        q, k, v = (heads(fc(a2, p + "attn." + n), w) for n, w in (("q", dqk), ("k", dqk), ("v", dh)))
        scores = q @ k.transpose(-1, -2) / math.sqrt(dqk)                # ρ_scaled (B, H, T, T)
        causal = keep(p + "Δcausal", scores.masked_fill(future, -math.inf) if c.causal else scores * 1.0)
        a3 = keep(p + "Δ3", (torch.softmax(causal, dim=-1) @ v).transpose(1, 2).reshape(B, T, H * dh))
        a4 = keep(p + "Δ4", fc(a3, p + "attn_proj"))
        a5 = keep(p + "Δ5", x + a4)
        a6 = keep(p + "Δ6", norm(a5, p + "ln2"))
        a7 = keep(p + "Δ7", fc(a6, p + "mlp_expand"))
        a8 = keep(p + "Δ8", activation(a7))
        a9 = keep(p + "Δ9", fc(a8, p + "mlp_contract"))
        x = keep(p + "Δ10", a5 + a9)
    a11 = keep("Δ11", norm(x, "ln_final"))
    a12 = keep("Δ12", a11 @ P["tok_emb.weight"].T if c.tie_weights else fc(a11, "logits"))
    logits, t = a12.reshape(B * T, -1), tgt.reshape(-1)
    counted = t != -100
    n = int(counted.sum())
    if n:
        picked = torch.log_softmax(logits, dim=-1).gather(1, torch.where(counted, t, 0)[:, None])[:, 0]
        loss = -(picked * counted).sum() / n
    else:
        loss = (logits * 0.0).sum()
    loss.backward()
    grads = {k: (np.zeros(tuple(v.shape)) if v.grad is None else v.grad.numpy().copy()) for k, v in P.items()}
    deltas = {k: v.grad.numpy().copy() for k, v in kept.items()}
    return float(loss.detach()), grads, deltas
