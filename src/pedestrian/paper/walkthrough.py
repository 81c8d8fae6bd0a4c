"""The paper's section 3 on numbers: one attention head forward and backward, every matrix kept.

:func:`head_example` runs the data flow of the paper's Table 1 on a tiny random example
(``T = 4`` tokens, ``d = 3`` features, ``d_ρ = 2``, ``d_h = 2`` by default) and returns every
intermediate matrix by name, forward (``q, k, v``, ``ρ_raw → ρ_scaled → ρ_causal → ρ``, ``a = ρ v``)
and backward (``Δv``, ``Δρ``, ``Δcausal``, ``Δraw``, ``Δq``, ``Δk``, the three input branches and
their sum ``Δ_{i-1}^h``, the six parameter gradients). It computes through the library's own
reference layer functions (:mod:`pedestrian.layers`: ``linear_forward``, ``attention_mask``,
``softmax_forward``, ``softmax_backward``, ``linear_backward``) one step at a time, following
``docs/EQUATIONS.md`` ("One attention head"); no autograd. ``pedestrian demo --head`` prints it.

:func:`mask_comparison` runs the same numbers through two causal masks: the paper's literal
Hadamard product ``m ∘ ρ_scaled`` with a 0/1 matrix ``m`` (which leaks weight to future tokens:
``exp(0) = 1``) and the ``−∞`` mask the project implements, and reports the weight each query puts
on future tokens and whether ``Δscaled = Δcausal`` holds (it does only with ``−∞``).
``pedestrian demo --mask`` prints it.

Names follow the paper (``w_q`` is the paper's ``w_{q_h}``, ``(d, d_ρ)``, multiplied from the
right: ``q = x w_q + b_q``). Arrays are float64 NumPy, one sequence (no batch axis).
"""

from __future__ import annotations

import math

import numpy as np

from ..layers import (attention_head_backward, attention_head_forward, attention_mask, linear_backward,
                      linear_forward, softmax_backward, softmax_forward)

__all__ = ["HEAD_INPUTS", "HEAD_KEYS", "HEAD_LABELS", "head_inputs", "head_example", "mask_comparison",
           "against_the_layer"]

#: the inputs of the worked example: the head's input ``x = a_{i-1}``, its six parameters and the
#: upstream error signal ``Δ = Δ_i^h``
HEAD_INPUTS = ("x", "w_q", "b_q", "w_k", "b_k", "w_v", "b_v", "delta")

#: every array :func:`head_example` returns, in the order of the paper's Table 1
HEAD_KEYS = HEAD_INPUTS + (
    "q", "k", "v", "rho_raw", "rho_scaled", "rho_causal", "rho", "a",
    "delta_v", "delta_rho", "delta_causal", "delta_raw", "delta_q", "delta_k",
    "delta_in_q", "delta_in_k", "delta_in_v", "delta_in",
    "dw_q", "db_q", "dw_k", "db_k", "dw_v", "db_v")

#: key -> (the paper's symbol, the formula that produced it); what ``pedestrian demo --head`` prints
HEAD_LABELS = {
    "x": ("x = a_{i-1}", "the head's input, one row per token"),
    "w_q": ("w_q", "query weights"), "b_q": ("b_q", "query bias"),
    "w_k": ("w_k", "key weights"), "b_k": ("b_k", "key bias"),
    "w_v": ("w_v", "value weights"), "b_v": ("b_v", "value bias"),
    "delta": ("Δ = Δ_i^h", "upstream error signal ∂L/∂a (random: what the layers above would send)"),
    "q": ("q", "a_{i-1} w_q + b_q"), "k": ("k", "a_{i-1} w_k + b_k"), "v": ("v", "a_{i-1} w_v + b_v"),
    "rho_raw": ("ρ_raw", "q kᵀ"),
    "rho_scaled": ("ρ_scaled", "ρ_raw / √d_ρ"),
    "rho_causal": ("ρ_causal", "ρ_scaled, −∞ where the key comes after the query"),
    "rho": ("ρ", "softmax of each row of ρ_causal"),
    "a": ("a_i^h", "ρ v"),
    "delta_v": ("Δv", "ρᵀ Δ"),
    "delta_rho": ("Δρ", "Δ vᵀ"),
    "delta_causal": ("Δcausal", "ρ ∘ (Δρ − rowsum(Δρ ∘ ρ))   (softmax backward; = Δscaled)"),
    "delta_raw": ("Δraw", "Δscaled / √d_ρ"),
    "delta_q": ("Δq", "Δraw k"),
    "delta_k": ("Δk", "Δrawᵀ q"),
    "delta_in_q": ("Δq w_qᵀ", "query branch"),
    "delta_in_k": ("Δk w_kᵀ", "key branch"),
    "delta_in_v": ("Δv w_vᵀ", "value branch"),
    "delta_in": ("Δ_{i-1}^h", "Δq w_qᵀ + Δk w_kᵀ + Δv w_vᵀ"),
    "dw_q": ("∂L/∂w_q", "a_{i-1}ᵀ Δq"), "db_q": ("∂L/∂b_q", "Σ_tokens Δq"),
    "dw_k": ("∂L/∂w_k", "a_{i-1}ᵀ Δk"), "db_k": ("∂L/∂b_k", "Σ_tokens Δk ≡ 0 (rows of Δcausal sum to 0)"),
    "dw_v": ("∂L/∂w_v", "a_{i-1}ᵀ Δv"), "db_v": ("∂L/∂b_v", "Σ_tokens Δv = Σ_tokens Δ"),
}


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def head_inputs(T: int = 4, d: int = 3, d_rho: int = 2, d_h: int = 2, seed: int = 0) -> dict:
    """Random inputs of the worked example of paper section 3, rounded to one decimal (easy to
    redo by hand).

    Args:
        T: tokens (the paper's ``n_T``), ``>= 1``.
        d: input features; ``d_rho``: query/key width ``d_ρ``; ``d_h``: value width (all ``>= 1``).
        seed: NumPy generator seed.

    Returns:
        ``{name: float64 array}`` for :data:`HEAD_INPUTS`: ``x (T, d)``; ``w_q, w_k (d, d_ρ)``;
        ``b_q, b_k (d_ρ,)``; ``w_v (d, d_h)``; ``b_v (d_h,)``; ``delta (T, d_h)``. Entries of
        ``x``, the weights and ``delta`` are ``N(0, 1)``, the biases ``N(0, 0.5²)``.

    Raises:
        ValueError: a size below 1.
    """
    _check_sizes(T=T, d=d, d_rho=d_rho, d_h=d_h)
    rng = np.random.default_rng(seed)
    shapes = dict(x=(T, d), w_q=(d, d_rho), b_q=(d_rho,), w_k=(d, d_rho), b_k=(d_rho,),
                  w_v=(d, d_h), b_v=(d_h,), delta=(T, d_h))
    out = {}
    for name in HEAD_INPUTS:
        scale = 0.5 if name.startswith("b_") else 1.0
        out[name] = np.round(rng.normal(0.0, scale, shapes[name]), 1) + 0.0   # + 0.0: no "-0.0"
    return out


def _as_inputs(inputs: dict) -> dict:
    """Validate the shapes of a :func:`head_inputs`-like dict; float64 copies."""
    missing = [k for k in HEAD_INPUTS if k not in inputs]
    if missing:
        raise ValueError(f"head inputs lack {', '.join(missing)}")
    a = {k: np.array(inputs[k], dtype=np.float64) for k in HEAD_INPUTS}
    if a["x"].ndim != 2:
        raise ValueError(f"x must be (T, d), got shape {a['x'].shape}")
    T, d = a["x"].shape
    d_rho, d_h = a["w_q"].shape[-1], a["w_v"].shape[-1]
    want = dict(w_q=(d, d_rho), b_q=(d_rho,), w_k=(d, d_rho), b_k=(d_rho,), w_v=(d, d_h), b_v=(d_h,),
                delta=(T, d_h))
    for k, shape in want.items():
        if a[k].shape != shape:
            raise ValueError(f"{k} must have shape {shape} for x of shape {(T, d)}, got {a[k].shape}")
    _check_sizes(T=T, d=d, d_rho=d_rho, d_h=d_h)
    return a


def head_example(inputs: dict | None = None, *, T: int = 4, d: int = 3, d_rho: int = 2, d_h: int = 2,
                 seed: int = 0, causal: bool = True) -> dict:
    """One attention head, forward and backward, every intermediate matrix kept (paper section 3,
    Table 1; EQUATIONS.md "One attention head").

    Args:
        inputs: ``{name: array}`` for :data:`HEAD_INPUTS` (shapes as :func:`head_inputs` gives);
            ``None`` draws them with :func:`head_inputs` from ``T, d, d_rho, d_h, seed``.
        causal: mask the future (``ρ_causal = −∞`` where key position ``β`` > query position ``α``);
            ``False``: no mask (``ρ_causal = ρ_scaled``).

    Returns:
        ``{key: float64 array}`` for every key of :data:`HEAD_KEYS`, in that order: the inputs;
        ``q, k (T, d_ρ)``, ``v (T, d_h)``; ``rho_raw, rho_scaled, rho_causal, rho (T, T)``;
        ``a (T, d_h)``; ``delta_v (T, d_h)``; ``delta_rho, delta_causal, delta_raw (T, T)``;
        ``delta_q, delta_k (T, d_ρ)``; ``delta_in_q, delta_in_k, delta_in_v, delta_in (T, d)``;
        ``dw_q, dw_k (d, d_ρ)``, ``db_q, db_k (d_ρ,)``, ``dw_v (d, d_h)``, ``db_v (d_h,)``.
        ``rho_causal`` holds ``-inf`` at masked entries. ``Δscaled`` is not a key: it equals
        ``delta_causal`` (see :func:`mask_comparison`).

    Raises:
        ValueError: missing inputs, inconsistent shapes, or a size below 1.
    """
    a = _as_inputs(head_inputs(T, d, d_rho, d_h, seed) if inputs is None else inputs)
    x, delta = a["x"], a["delta"]
    T, d_rho = x.shape[0], a["w_q"].shape[1]
    out = dict(a)
    # ---- forward (Table 1, top to bottom) -----------------------------------------------------
    q, _ = linear_forward(x, a["w_q"], a["b_q"])                            # (T, d_ρ)
    k, _ = linear_forward(x, a["w_k"], a["b_k"])                            # (T, d_ρ)
    v, _ = linear_forward(x, a["w_v"], a["b_v"])                            # (T, d_h)
    rho_raw = q @ k.T                                                       # (T, T)
    rho_scaled = rho_raw / math.sqrt(d_rho)                                 # (T, T)
    if causal:
        allowed = attention_mask(T, T, causal=True, like=x)                 # β <= α
        rho_causal = np.where(allowed, rho_scaled, -np.inf)
    else:
        rho_causal = rho_scaled.copy()
    rho = softmax_forward(rho_causal)                                       # (T, T), rows sum to 1
    out.update(q=q, k=k, v=v, rho_raw=rho_raw, rho_scaled=rho_scaled, rho_causal=rho_causal, rho=rho,
               a=rho @ v)                                                   # (T, d_h)
    # ---- backward (Table 1, bottom to top) ----------------------------------------------------
    delta_v = rho.T @ delta                                                 # (T, d_h)
    delta_rho = delta @ v.T                                                 # (T, T)
    delta_causal = softmax_backward(delta_rho, rho)                         # (T, T), rows sum to 0
    delta_raw = delta_causal / math.sqrt(d_rho)                             # Δscaled = Δcausal
    delta_q = delta_raw @ k                                                 # (T, d_ρ)
    delta_k = delta_raw.T @ q                                               # (T, d_ρ)
    out.update(delta_v=delta_v, delta_rho=delta_rho, delta_causal=delta_causal, delta_raw=delta_raw,
               delta_q=delta_q, delta_k=delta_k)
    grads = {}
    for p, d_out in (("q", delta_q), ("k", delta_k), ("v", delta_v)):      # three FC backwards
        grads["dw_" + p] = np.zeros_like(a["w_" + p])
        grads["db_" + p] = np.zeros_like(a["b_" + p])
        out["delta_in_" + p] = linear_backward(d_out, x, a["w_" + p], dweight=grads["dw_" + p],
                                               dbias=grads["db_" + p])     # (T, d)
    out["delta_in"] = out["delta_in_q"] + out["delta_in_k"] + out["delta_in_v"]
    out.update(grads)
    return {key: out[key] for key in HEAD_KEYS}


def mask_comparison(inputs: dict | None = None, *, T: int = 4, d: int = 3, d_rho: int = 2, d_h: int = 2,
                    seed: int = 0) -> dict:
    """The paper's literal 0/1 Hadamard mask against the ``−∞`` mask, on the same numbers
    (paper section 3.1 "Final enhancements" and 3.2; EQUATIONS.md "One attention head").

    Both start from the same ``ρ_scaled`` and upstream ``Δ``. ``"hadamard"``:
    ``ρ_causal = m ∘ ρ_scaled`` with ``m`` the lower-triangular 0/1 matrix, as the paper writes
    it; a masked score becomes 0, and ``exp(0) = 1`` gives the future a weight. ``"neg_inf"``:
    ``ρ_causal = ρ_scaled`` where ``m = 1``, ``−∞`` elsewhere (what the project implements).
    Under both, the chain rule through the mask gives ``Δscaled = m ∘ Δcausal``; it equals
    ``Δcausal`` only when ``Δcausal`` is already 0 at the masked entries, i.e. only with ``−∞``.

    Args:
        inputs, T, d, d_rho, d_h, seed: as :func:`head_example`.

    Returns:
        ``{"mask": m (T, T) of 0.0/1.0, "rho_scaled": (T, T), "delta_rho": (T, T),
        "neg_inf": {...}, "hadamard": {...}}``; each of the last two maps ``rho_causal``,
        ``rho``, ``delta_causal``, ``delta_scaled`` (``(T, T)``), ``a`` (``(T, d_h)``),
        ``future_weight`` (``(T,)``: ``Σ_{β>α} ρ_αβ``, the weight query ``α`` puts on later
        tokens) and ``max_scaled_minus_causal`` (a float, ``max|Δscaled − Δcausal|``).

    Raises:
        ValueError: as :func:`head_example`.
    """
    ex = head_example(inputs, T=T, d=d, d_rho=d_rho, d_h=d_h, seed=seed, causal=True)
    T = ex["x"].shape[0]
    m = np.asarray(attention_mask(T, T, causal=True, like=ex["x"]), dtype=np.float64)   # 1: β <= α
    out = {"mask": m, "rho_scaled": ex["rho_scaled"], "delta_rho": ex["delta_rho"]}
    for name, rho_causal in (("neg_inf", np.where(m > 0, ex["rho_scaled"], -np.inf)),
                             ("hadamard", m * ex["rho_scaled"])):
        rho = softmax_forward(rho_causal)
        delta_causal = softmax_backward(ex["delta_rho"], rho)              # ∂L/∂ρ_causal
        delta_scaled = m * delta_causal                                     # ∂ρ_causal/∂ρ_scaled = m
        out[name] = dict(rho_causal=rho_causal, rho=rho, a=rho @ ex["v"],
                         future_weight=np.sum(rho * (1.0 - m), axis=1),
                         delta_causal=delta_causal, delta_scaled=delta_scaled,
                         max_scaled_minus_causal=float(np.max(np.abs(delta_scaled - delta_causal))))
    return out


def against_the_layer(ex: dict, causal: bool = True) -> tuple[float, float]:
    """The example ``ex`` of :func:`head_example` checked: ``(diff, zero)``.

    ``diff``: the largest ``|difference|`` between the step-by-step ``a``, ``Δ_{i-1}^h``,
    ``Δcausal`` and six parameter gradients and those of the library's one-call reference layer
    (:func:`pedestrian.layers.attention_head_forward` / ``_backward``) on the same inputs;
    ``zero``: the largest ``|entry|`` of what must be 0 (the row sums of ``Δcausal``, ``∂L/∂b_k``).
    Both are rounding in float64 (``pedestrian demo --head`` holds them to 1e-12).
    """
    out, cache = attention_head_forward(ex["x"][None], *(ex[k] for k in HEAD_INPUTS[1:-1]), causal=causal)
    delta_in, grads, delta_causal = attention_head_backward(ex["delta"][None], cache)
    pairs = [(out[0], ex["a"]), (delta_in[0], ex["delta_in"]), (delta_causal[0], ex["delta_causal"])]
    pairs += [(grads[k.replace("_", "")], ex["d" + k]) for k in ("w_q", "b_q", "w_k", "b_k", "w_v", "b_v")]
    diff = max(float(np.max(np.abs(np.asarray(u) - w))) for u, w in pairs)
    zero = max(float(np.max(np.abs(ex["delta_causal"].sum(axis=1)))), float(np.max(np.abs(ex["db_k"]))))
    return diff, zero
