"""The adapter-dropout masks a pedestrian training forward draws, replayed for the oracles.

:meth:`pedestrian.model.GPT.add_lora` documents the draws: one inverted-dropout mask per adapted
layer input (``rng.random(shape) >= p``, kept entries ``1/(1-p)``), from ``model.dropout_rng``,
in forward order, one per PEFT module: a GPT-2-shaped model's q, k, v adapters share the mask of
their common input (PEFT's one ``c_attn`` module), a Llama-family model draws one each for q, k,
v and for gate, up. With ``config.dropout = 0`` nothing else draws from that generator.
"""

from __future__ import annotations

import numpy as np


def replay_masks(model, rng: np.random.Generator, B: int, T: int) -> dict:
    """The masks a training forward draws, replayed from a copy of ``model.dropout_rng`` in the
    documented order: one per PEFT module, in forward order (``config.dropout = 0`` draws nothing)."""
    from pedestrian.model.params import qkv_shares_mask

    c, p = model.config, model.lora_dropout
    targets = set(model.lora_targets)

    def draw(width):
        keep = rng.random((B, T, width)) >= p
        return keep.astype(np.float64) * (1.0 / (1.0 - p))

    masks = {}
    for i in range(c.n_blocks):
        qkv = [f"blocks.{i}.attn.{x}" for x in "qkv" if f"blocks.{i}.attn.{x}" in targets]
        if qkv and qkv_shares_mask(c):
            m = draw(c.d_model)
            masks.update({name: m for name in qkv})
        else:
            masks.update({name: draw(c.d_model) for name in qkv})
        gate = [(f"blocks.{i}.mlp_gate", c.d_model)] if c.mlp == "swiglu" else []
        for name, width in ((f"blocks.{i}.attn_proj", c.n_heads * c.d_head), *gate,
                            (f"blocks.{i}.mlp_expand", c.d_model), (f"blocks.{i}.mlp_contract", c.d_mlp)):
            if name in targets:
                masks[name] = draw(width)
    if "logits" in targets:
        masks["logits"] = draw(c.d_model)
    return masks
