"""bfloat16 mixed precision: the kernel table of a model made with ``GPT(..., precision="bf16")``.

docs/EQUATIONS.md, "Mixed precision (bf16)", as PyTorch's CUDA autocast does it: the parameters
(master weights), their gradients and AdamW's moments stay float32; every matrix product takes
bfloat16 operands and gives a bfloat16 result; what autocast runs in float32 -- the norms'
statistics, the softmax, log-sum-exp and the loss -- runs in float32 here too. The chain
(:mod:`pedestrian.model.gpt`) does not change: the model calls this table, which wraps each
function of the base table (the GPU's Triton kernels on CUDA, the reference layers on CPU tensors)
with the casts of its kind:

==================  ======================================================================
kind                what the wrapper does (``bf(x)``: x rounded to bfloat16)
==================  ======================================================================
product             ``linear``, ``lora``: operands ``bf(x)``, ``bf(W)``, ``bf(b)``, ``bf(Δ)``;
                    the result bfloat16; ``dW``, ``db`` (and LoRA's ``dD``, ``dU``) written
                    into the float32 gradient arrays (one rounding to bfloat16, as autocast's
                    weight cast gives its gradient back); LoRA's dropout mask applied in the
                    input's dtype before the cast (``1/(1−p)`` never rounded to bfloat16)
float32             norms (the skip fused in), embedding, RoPE, attention, cross-entropy, the
                    skip ``add``: bfloat16 inputs widened to float32 (exactly), float32 out
elementwise         activation, SwiGLU gate: computed in float32 on the bfloat16 input, the
                    result rounded once to bfloat16 (as torch's bfloat16 kernels do)
fused head          ``head_loss``: per chunk of rows, the product in bfloat16, the chunk's
                    cross-entropy and ``Δ12`` in float32, ``Δ12`` rounded to bfloat16 for the
                    two products of the backward, ``dW`` and ``db`` summed in float32
dropout             computed in float32, the result in its input's dtype, the mask float32
==================  ======================================================================

So the residual stream (``a1``, ``a5``, ``a10``) and the norms' outputs are float32, the
products' outputs (``qkv``, ``a4``, ``a7``, ``a9``) and the activation's (``a8``) bfloat16, as
they are under autocast in a model written with ``torch.nn``; the logits are the bfloat16
product's values widened to float32 (the loss reads them in float32, as autocast's does). One
difference from autocast: the attention runs in float32 on the bfloat16 ``q``, ``k``, ``v``
(flash attention keeps its scores in float32 too, and the GPU's Triton attention takes float32),
where a hand-written attention under autocast rounds the scores and the softmax's output to
bfloat16: more accurate, and slower than a bfloat16 attention kernel would be.
The bfloat16 copy of a weight is made by the product that reads it (``W.to(bfloat16)``, 6 bytes
of traffic per parameter, twice a step) and let go after it.

NumPy has no bfloat16 arithmetic: :func:`check_precision` refuses ``precision="bf16"`` on the
NumPy backend, and float16 (which needs a loss scale) everywhere, each in one line.
"""

from __future__ import annotations

from types import SimpleNamespace

from ..backend import array_namespace
from ..layers import MODEL_FUNCTIONS
from ..layers.checks import check_float, check_ids
from ..layers.head_loss import HeadLossCache, head_chunk_rows
from ..layers.head_loss import head_loss_backward as reference_head_loss_backward
from ..layers.loss import IGNORE_INDEX, count_divisor

__all__ = ["PRECISIONS", "check_precision", "kernels_for", "mixed_table"]

#: the values of ``GPT(..., precision=)`` and ``pedestrian train --precision``
PRECISIONS = ("float32", "bf16")

_FLOAT16 = ("fp16", "float16", "half")

#: contract function -> kind (module docstring); every function of ``MODEL_FUNCTIONS`` has one
KINDS = {
    **dict.fromkeys(("linear_forward", "linear_backward"), "product"),
    **dict.fromkeys(("linear_activation_forward", "linear_activation_backward", "lora_forward", "lora_backward",
                     "dropout_forward"), "written out"),
    **dict.fromkeys(("layernorm_forward", "layernorm_backward", "rmsnorm_forward", "rmsnorm_backward",
                     "add_layernorm_forward", "add_layernorm_backward", "add_rmsnorm_forward",
                     "add_rmsnorm_backward", "embedding_forward", "embedding_backward", "rope_forward",
                     "rope_backward", "multi_head_attention_forward", "multi_head_attention_backward",
                     "attention_weights", "cross_entropy_forward", "cross_entropy_backward", "add",
                     "softcap_forward", "softcap_backward"), "float32"),
    **dict.fromkeys(("activation_forward", "activation_backward", "swiglu_forward", "swiglu_backward"),
                    "elementwise"),
    **dict.fromkeys(("head_loss_forward", "head_loss_backward"), "head"),
    **dict.fromkeys(("dropout_backward", "moe_load_balancing_loss"), "as is"),
    **dict.fromkeys(("moe_router_forward", "moe_router_backward", "moe_gather", "moe_scatter", "moe_combine_forward",
                     "moe_combine_backward"), "float32"),    # the routing in float32; the experts' products: linear
    **dict.fromkeys(("swiglu_mlp_forward", "swiglu_mlp_backward"), "refused"),
}

#: keyword arguments that are outputs (gradient arrays written in place, or a bfloat16 array a
#: product adds into): never cast
_OUTPUTS = frozenset(("dweight", "dbias", "dD", "dU", "add_to", "dtok", "dpos", "dw_gate", "dw_up", "dw_down"))


def check_precision(precision, backend: str, dtype) -> None:
    """Raise ``ValueError`` (one line) for a precision a model cannot run: not one of
    :data:`PRECISIONS`, float16 (named: use bf16), bf16 on the NumPy backend or with float64
    parameters."""
    name = str(precision).lower()
    if name in _FLOAT16:
        raise ValueError(f"precision={precision!r} is not supported: float16 needs a loss scale, which pedestrian "
                         "does not have; use precision='bf16' (bfloat16 products, float32 master weights) on a GPU")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose 'float32' or 'bf16'")
    if precision == "bf16" and backend != "torch":
        raise ValueError("precision='bf16' needs backend='torch' (on a GPU: device='cuda'): NumPy has no "
                         "bfloat16 products")
    dtype_name = dtype if isinstance(dtype, str) else str(dtype).rsplit(".", 1)[-1]
    if precision == "bf16" and dtype_name != "float32":
        raise ValueError(f"precision='bf16' keeps float32 master weights: use dtype='float32', not {dtype_name!r}")


def kernels_for(base_for, precision: str, kernels, device, dtype, backend: str):
    """The model's table: ``base_for(kernels, device, dtype)`` (:func:`pedestrian.gpu.kernels_for`)
    for float32; for bf16 :func:`mixed_table` over it, whose base on CPU tensors is the reference
    layers (the CPU fast kernels are numba over NumPy, float32 / float64 only).

    Raises:
        ValueError: :func:`check_precision`'s."""
    check_precision(precision, backend, dtype)
    if precision != "bf16":
        return base_for(kernels, device, dtype)
    on_cpu = device is None or device.type == "cpu"
    return mixed_table(base_for("reference" if on_cpu else kernels, device, dtype))


def _torch():
    import torch

    return torch


def _bf16(x):
    """``x`` rounded to bfloat16 (a float tensor of another float dtype), else ``x`` itself."""
    torch = _torch()
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.bfloat16:
        return x.to(torch.bfloat16)
    return x


def _f32(x):
    """A bfloat16 tensor widened to float32 (exact), else ``x`` itself."""
    torch = _torch()
    if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16:
        return x.float()
    return x


def _cast_args(cast, args, kwargs):
    return ([cast(a) for a in args],
            {k: (v if k in _OUTPUTS else cast(v)) for k, v in kwargs.items()})


def _wrap(kind: str, f, name: str):
    """``f`` with the casts of its ``kind`` (module docstring)."""
    if kind in ("as is", "written out"):                # (written out: replaced in mixed_table)
        return f
    if kind == "refused":
        def refused(*args, **kwargs):
            raise NotImplementedError(f"{name} has no bfloat16 form: the model's chain calls "
                                      "swiglu_forward / swiglu_backward")
        return refused
    if kind == "product":
        def product(*args, **kwargs):
            a, k = _cast_args(_bf16, args, kwargs)
            return f(*a, **k)
        return product
    if kind == "float32":
        def float32(*args, **kwargs):
            a, k = _cast_args(_f32, args, kwargs)
            return f(*a, **k)
        return float32

    def elementwise(*args, **kwargs):               # float32 arithmetic, the result rounded once
        a, k = _cast_args(_f32, args, kwargs)
        out = f(*a, **k)
        if name.endswith("_forward"):
            return _bf16(out[0]), out[1]            # (y, cache): the cache as the base keeps it
        return tuple(map(_bf16, out)) if isinstance(out, tuple) else _bf16(out)
    return elementwise


def mixed_table(base) -> SimpleNamespace:
    """``base`` (a kernel table: every function of ``MODEL_FUNCTIONS`` and ``name``) with each
    function wrapped for bfloat16 mixed precision (module docstring); ``name`` kept, and
    ``precision = "bf16"``."""
    functions = vars(base) if isinstance(base, SimpleNamespace) else dict(base)
    table = {name: _wrap(KINDS[name], functions[name], name) for name in MODEL_FUNCTIONS}

    def head_loss_forward(h, weight, bias, targets, ignore_index: int = IGNORE_INDEX, *, n_total=None,
                          grad: bool = True, grad_weight: bool = True, chunk_rows: int | None = None,
                          softcap: float | None = None):
        """The fused head (:func:`pedestrian.layers.head_loss.head_loss_forward`'s contract) in
        mixed precision, a chunk of rows at a time: ``z_c = bf(h_c) bf(W) + bf(b)`` (bfloat16
        product) widened to float32, the table's float32 cross-entropy of the chunk (divided by
        the whole count, so the chunks' losses add up), ``Δ12_c`` rounded to bfloat16, ``Δ11_c =
        Δ12_c bf(W)ᵀ`` and ``h_cᵀ Δ12_c`` (bfloat16 products), ``dW``, ``db`` summed in float32."""
        torch = _torch()
        check_float(h, "the head's input")
        check_ids(targets, weight.shape[1], "target", ignore_index=ignore_index)
        d, V = weight.shape
        rows = head_chunk_rows(V, 4) if chunk_rows is None else int(chunk_rows)   # (float32 logits)
        if rows < 1:
            raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
        w16, b16 = _bf16(weight), _bf16(bias)                                # (d, V), (V,)
        h16, t = _bf16(h).reshape(-1, d), targets.reshape(-1)                # (N, d), (N,)
        n_counted = (t != ignore_index).sum() if n_total is None else n_total  # 0-d, never read
        dW = torch.zeros((d, V), dtype=torch.float32, device=h.device) if grad and grad_weight else None
        db = torch.zeros((V,), dtype=torch.float32, device=h.device) if dW is not None and bias is not None else None
        loss, dh = torch.zeros((), dtype=torch.float32, device=h.device), []
        for lo in range(0, h16.shape[0], rows):
            h_c = h16[lo:lo + rows]                                          # (n, d) bfloat16
            z, _ = functions["linear_forward"](h_c, w16, b16)                # (n, V) bfloat16 product
            if softcap is not None:                                          # capped in float32
                z, cap = table["softcap_forward"](z, softcap)
            loss_c, ce = table["cross_entropy_forward"](z, t[lo:lo + rows], ignore_index, n_total=n_counted)
            loss = loss + loss_c                                             # 0-d float32
            if not grad:
                continue
            delta = table["cross_entropy_backward"](ce)                      # (n, V) Δ12_c
            if softcap is not None:
                delta = table["softcap_backward"](delta, cap)                # through the cap, float32
            delta = _bf16(delta)
            dh.append(delta @ w16.T)                                         # (n, d) Δ11_c, bfloat16
            if dW is not None:
                dW += (h_c.T @ delta).float()                                # (d, V) summed in float32
                if db is not None:
                    db += delta.sum(dim=0).float()                           # (V,)
        d11 = None
        if grad:
            d11 = torch.cat(dh).reshape(h.shape) if dh else torch.zeros(h.shape, dtype=torch.bfloat16, device=h.device)
        C = count_divisor(array_namespace(h), n_counted, loss)
        return loss, HeadLossCache(d11, dW, db, C, (*h.shape[:-1], V))

    def linear_activation_forward(x, weight, bias, name):
        """The expand layer's product in bfloat16, then its activation (the two wrapped calls)."""
        a7, _ = table["linear_forward"](x, weight, bias)                     # (..., f_out) bfloat16
        a8, act = table["activation_forward"](a7, name)                      # (..., f_out) bfloat16
        return (a7, a8), (_bf16(x), act)

    def linear_activation_backward(delta, cache, weight, name, *, dweight=None, dbias=None):
        """``(Δ6, Δ7)``: the activation's backward, then the product's (the two wrapped calls)."""
        x, act = cache
        d7 = table["activation_backward"](delta, act, name)
        return table["linear_backward"](d7, x, weight, dweight=dweight, dbias=dbias), d7

    def lora_forward(x, lora_D, lora_U, alpha, mask=None, *, add_to=None):
        """The adapter's branch in bfloat16 products on ``bf(x ∘ m)``; the mask ``m`` kept as it
        is (exact: ``1/(1−p)`` is not rounded to bfloat16) for the backward."""
        x_in = x if mask is None else x * mask                               # (..., f_in)
        y, (x16, h, _) = functions["lora_forward"](_bf16(x_in), _bf16(lora_D), _bf16(lora_U), alpha, None,
                                                   add_to=add_to)
        return y, (x16, h, mask)

    def lora_backward(delta, cache, lora_D, lora_U, alpha, *, dD=None, dU=None, need_input=True, add_to=None):
        """``dD``, ``dU`` made in bfloat16 (the base's products write arrays of their operands'
        dtype) and copied into the float32 gradients; the input signal masked as the forward."""
        torch = _torch()
        x16, h, mask = cache
        made = [None if g is None else torch.empty(g.shape, dtype=torch.bfloat16, device=g.device) for g in (dD, dU)]
        share = functions["lora_backward"](_bf16(delta), (x16, h, None), _bf16(lora_D), _bf16(lora_U), alpha,
                                           dD=made[0], dU=made[1], need_input=need_input)
        for grad, m in zip((dD, dU), made):
            if grad is not None:
                grad.copy_(m)                                                # (f_in, r), (r, f_out)
        if share is None:
            return None
        share = share if mask is None else share * mask                      # (..., f_in)
        if add_to is None:
            return share
        add_to += share
        return add_to

    def dropout_forward(x, p, rng):
        """Dropout in float32 (the mask's ``1/(1−p)`` exact), the result in ``x``'s dtype."""
        y, mask = functions["dropout_forward"](_f32(x), p, rng)
        return (y if y.dtype == x.dtype else y.to(x.dtype)), mask

    float32_embedding = table["embedding_forward"]

    def embedding_forward(tokens, tok_weight, pos_weight, positions=None, *, scale=None):
        """The embedding in float32, a ``scale`` (Gemma's ``√d``) rounded to bfloat16 first, as
        transformers' ``embed_scale`` is in a bfloat16 model (55.4256 -> 55.5 at ``d = 3072``)."""
        if scale is not None:
            scale = float(_torch().tensor(scale, dtype=_torch().bfloat16))
            return float32_embedding(tokens, tok_weight, pos_weight, positions, scale=scale)
        return float32_embedding(tokens, tok_weight, pos_weight, positions)

    table.update(lora_forward=lora_forward, lora_backward=lora_backward, dropout_forward=dropout_forward,
                 embedding_forward=embedding_forward)
    table.update(head_loss_forward=head_loss_forward, head_loss_backward=reference_head_loss_backward,
                 linear_activation_forward=linear_activation_forward,
                 linear_activation_backward=linear_activation_backward)
    return SimpleNamespace(**table, name=functions["name"], precision="bf16")
