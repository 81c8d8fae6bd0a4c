"""The mixture of experts as the block's MLP (Mixtral, Qwen3-MoE, OLMoE; EQUATIONS.md, "Mixture of
experts"), and the load-balancing loss the model adds to its cross-entropy.

:class:`MoEMLP` fills the ``mlp`` slot of a model with ``config.n_experts > 0``: in a block of
:meth:`GPTConfig.is_moe <pedestrian.config.GPTConfig.is_moe>` it routes ``a6`` (the kernel
table's ``moe_router_forward``), lays the rows out grouped by expert (``moe_gather``), runs
each expert's SwiGLU on its rows as one product per layer through the model's fully connected
layer ``fc`` (so every expert's LoRA adapters run as on any layer) and adds the weighted outputs
(``moe_combine_forward``); its backward is that list reversed, the router's gradient last (with
the load-balancing loss's ``∂aux/∂π`` when the model's loss has it). Other blocks run the dense
:class:`~pedestrian.model.slots.BuiltinMLP`.

The block keeps ``b.route`` (the router's cache: ``π``, the chosen experts, their weights),
``b.experts`` (per expert its rows, SwiGLU cache and ``a8``) and ``b.combine``.
"""

from __future__ import annotations

from ..backend import array_namespace

__all__ = ["MoEMLP", "aux_loss", "kept_route"]


class MoEMLP:
    """The MLP slot of a mixture-of-experts model (``forward(fc, b, w, lora) -> a9``,
    ``backward(fc, D, b, w, g, lora) -> Δ6``, as :class:`~pedestrian.model.slots.BuiltinMLP`;
    ``D.aux``: the load-balancing loss's ``(E,)`` signal on ``π``, or ``None``)."""

    def __init__(self, config, kernels, dense):
        self.K, self.dense = kernels, dense
        self.k, self.renorm = config.n_experts_per_token, config.norm_topk_prob

    def forward(self, fc, b, w, lora):
        if w.router is None:                                                     # a dense block
            return self.dense.forward(fc, b, w, lora)
        K = self.K
        (_, offsets), b.route = K.moe_router_forward(b.a6, w.router.weight, self.k, self.renorm)
        rows = K.moe_gather(b.route)                                             # (N·k, d) by expert
        b.experts, outs = [], []
        for e, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):            # one product per layer
            x, ex = rows[lo:hi], w.experts[e]                                    # (n_e, d)
            a7 = fc(ex.mlp_gate_up, x, lora)                                     # (n_e, 2m) [gate | up]
            m = a7.shape[-1] // 2
            a8, act = K.swiglu_forward(a7[:, :m], a7[:, m:])                     # (n_e, m)
            outs.append(fc(ex.mlp_contract, a8, lora))                           # (n_e, d)
            b.experts.append((x, act, a8))
        y, b.combine = K.moe_combine_forward(array_namespace(rows).concat(outs, axis=0), b.route)
        return array_namespace(y).reshape(y, b.a6.shape)                         # (B, T, d)

    def backward(self, fc, D, b, w, g, lora):
        if w.router is None:
            return self.dense.backward(fc, D, b, w, g, lora)
        K, o = self.K, b.route.offsets
        xp = array_namespace(D.d9)
        d_outs, d_g = K.moe_combine_backward(xp.reshape(D.d9, (-1, D.d9.shape[-1])), b.combine, b.route)
        parts = []
        for e, (x, act, a8) in enumerate(b.experts):                            # g_e Δ into each expert
            ex, gx = w.experts[e], g.experts[e]
            d8 = fc(ex.mlp_contract, gx.mlp_contract, d_outs[o[e]:o[e + 1]], a8, lora)   # (n_e, m)
            d7 = K.swiglu_backward(d8, act, fused=True)                          # (n_e, 2m)
            parts.append(fc(ex.mlp_gate_up, gx.mlp_gate_up, d7, x, lora))        # (n_e, d)
        dx = K.moe_scatter(xp.concat(parts, axis=0), b.route)                    # (N, d)
        dx = dx + K.moe_router_backward(d_g, b.route, w.router.weight, d_pi=getattr(D, "aux", None),
                                        dweight=g.router.weight)                 # + the router's path
        return xp.reshape(dx, b.a6.shape)


def aux_loss(model, f, targets, n_total) -> None:
    """After a forward: ``f.aux`` (transformers' load-balancing loss over every mixture-of-experts
    block's rows, ``moe_load_balancing_loss`` of the routes kept in ``f.routes``), ``f.ce`` (the
    cross-entropy) and ``f.aux_grad`` (``coef · ∂aux/∂π``, ``(E,)``, or ``None``). With targets and
    ``config.output_router_logits``, ``coef · aux`` is added to ``f.loss_value`` (a slice of a larger
    batch, ``n_total``, adds it weighted by its share of the counted targets, so that the slices'
    losses add up to the mean of their ``aux``). Returns ``{"ce", "aux"}`` (``{}``: no routes), what
    :attr:`GPT.loss_parts <pedestrian.model.gpt.GPT.loss_parts>` reports."""
    c = model.config
    f.aux_grad, f.ce = None, getattr(f, "loss_value", None)
    if not f.routes:
        return {}
    f.aux, d_pi = model.kernels.moe_load_balancing_loss(f.routes, c.n_experts, c.n_experts_per_token)
    if c.output_router_logits and targets is not None:
        share = 1.0
        if n_total is not None:
            share = float(array_namespace(targets).sum(targets != -100)) / n_total
        f.loss_value = f.loss_value + c.router_aux_loss_coef * share * f.aux
        f.aux_grad = c.router_aux_loss_coef * share * d_pi
    return {"ce": f.ce, "aux": f.aux}


def kept_route(route):
    """The router's cache without its input rows: what the load-balancing loss reads (``π``, the
    choice) after the block has let its arrays go."""
    return type(route)(None, *tuple(route)[1:])
