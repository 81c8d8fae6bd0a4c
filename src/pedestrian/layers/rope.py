"""Rotary position embeddings, RoPE (paper section 2, "non-adjustable positional embeddings";
EQUATIONS.md "RoPE").

RoPE (Su et al. 2021, "RoFormer", eq. 34) turns pairs of query and key features by an angle
proportional to the token's position ``t``: pair ``j`` of the ``r`` rotated dimensions turns by
``t·θ_j`` with ``θ_j = base^(−2j/r)``, ``j = 0 … r/2 − 1``. Since ``R(tθ)ᵀ R(sθ) = R((s − t)θ)``,
the score of query ``α`` and key ``β`` depends on their positions only through ``β − α``: the
rotation injects *relative* position and breaks the permutation equivariance of non-causal
attention (paper section 3), with no parameter to learn.

Pairing: GPT-NeoX's ``rotate_half`` convention (also Hugging Face's Llama and GPT-NeoX
``apply_rotary_pos_emb``): dimension ``j`` pairs with ``j + r/2`` inside each head, not the
interleaved pairs ``(2j, 2j+1)`` of GPT-J / the RoFormer paper. With ``r < d_qk``
(``rope_fraction < 1``, GPT-NeoX's ``rotary_pct``) the first ``r`` dimensions of each head turn and
the remaining ``d_qk − r`` pass through. Values are never rotated.

Backward: a rotation is orthogonal, ``R(φ)⁻¹ = R(φ)ᵀ = R(−φ)``; the layer is linear in its input,
so ``Δ_in = R(−tθ) Δ``, the same formula with the sine's sign flipped. The angles are
constants (no parameter gradient).

Reference implementation: the paper's math only, written against the array API standard.
"""

from __future__ import annotations

import math

from ..backend import array_namespace


def llama3_theta(theta, scaling):
    """Llama 3's frequency scaling of the table ``θ`` (EQUATIONS.md "RoPE as Hugging Face Llama
    applies it"; transformers' ``_compute_llama3_parameters``). With ``L =
    original_max_position_embeddings`` and the wavelength ``λ_j = 2π / θ_j``: ``θ_j / factor``
    where ``λ_j > L / low_freq_factor``, ``θ_j`` where ``λ_j < L / high_freq_factor``, else
    ``(1 − s) θ_j / factor + s θ_j`` with ``s = (L / λ_j − low) / (high − low)``.

    Args:
        theta: ``(r/2,)`` float64 frequencies (radians per position).
        scaling: a :class:`pedestrian.config.RopeScaling` (``factor``, ``low_freq_factor``,
            ``high_freq_factor``, ``original_max_position_embeddings``).

    Returns:
        ``(r/2,)`` the scaled frequencies. Only the angles change: forward and backward stay
        rotations.
    """
    xp = array_namespace(theta)
    L, factor = scaling.original_max_position_embeddings, scaling.factor
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / theta                                            # λ_j (r/2,)
    s = (L / wavelength - low) / (high - low)                                   # (r/2,)
    smooth = (1 - s) * theta / factor + s * theta                               # (r/2,)
    return xp.where(wavelength > L / low, theta / factor,                       # (r/2,)
                    xp.where(wavelength < L / high, theta, smooth))


def rope_angles(positions, rotated: int, base: float, like, scaling=None):
    """``cos(t·θ_j)`` and ``sin(t·θ_j)`` for every position ``t`` and pair ``j``.

    Args:
        positions: integer array ``(T,)`` or ``(B, T)`` (a left-padded row counts from its first
            real token).
        rotated: ``r``, an even number of rotated dimensions per head.
        base: ``θ_j = base^(−2j/r)``.
        like: an array of the model's dtype, backend and device.
        scaling: ``None``, Llama 3's frequency scaling (:func:`llama3_theta`) or the linear one
            (``rope_type="linear"``: every ``θ_j / factor``, transformers' ``_compute_linear_scaling_rope_parameters``).

    Returns:
        ``(cos, sin)``, each ``(T, 1, r/2)`` or ``(B, T, 1, r/2)`` in ``like``'s dtype (the ``1``
        broadcasts over the heads). The angles are formed in float64: ``t·θ`` rounded to float32
        would be off by ``t·2⁻²⁴`` radians, 6e-5 at ``t = 1000``.
    """
    xp = array_namespace(like)
    half = rotated // 2
    j = xp.astype(xp.arange(half, device=like.device), xp.float64)              # (r/2,)
    theta = base ** (-2.0 * j / rotated)                                        # θ_j (r/2,)
    if scaling is not None and scaling.rope_type == "linear":
        theta = theta / scaling.factor                                          # (r/2,) Gemma 3's global layers
    elif scaling is not None:
        theta = llama3_theta(theta, scaling)                                    # (r/2,)
    t = xp.astype(positions, xp.float64)                                        # (T,) or (B, T)
    angle = t[..., None, None] * theta                                          # (…, T, 1, r/2)
    return xp.astype(xp.cos(angle), like.dtype), xp.astype(xp.sin(angle), like.dtype)


def _rotate(qkv, n_qk: int, d_qk: int, rotated: int, cos, sin):
    """``qkv`` with the first ``r`` dimensions of each of its ``n_qk`` q and k heads turned by the
    angles whose cosine and sine are given (the forward's ``sin``, or ``−sin`` for the inverse)."""
    xp = array_namespace(qkv)
    B, T, width = qkv.shape
    half = rotated // 2
    qk = xp.reshape(qkv[..., :n_qk * d_qk], (B, T, n_qk, d_qk))                # q heads, then k heads
    x1, x2 = qk[..., :half], qk[..., half:rotated]                              # (B, T, H+H_kv, r/2) each
    y1 = x1 * cos - x2 * sin                                                    # (B, T, H+H_kv, r/2)
    y2 = x2 * cos + x1 * sin                                                    # (B, T, H+H_kv, r/2)
    turned = xp.concat([y1, y2, qk[..., rotated:]], axis=-1)                    # (B, T, H+H_kv, d_qk)
    return xp.concat([xp.reshape(turned, (B, T, n_qk * d_qk)),                 # (B, T, width)
                      qkv[..., n_qk * d_qk:]], axis=-1)


def rope_forward(qkv, n_heads: int, d_qk: int, positions=None, *, base: float = 10_000.0,
                 rotated: int | None = None, n_kv_heads: int | None = None, scaling=None):
    """Rotate every head's queries and keys by their token's position (RoPE, GPT-NeoX pairing).

    For each head's ``q`` (and ``k``) row ``x`` at position ``t`` and each ``j < r/2``::

        y_j       = x_j cos(tθ_j) − x_{j+r/2} sin(tθ_j)
        y_{j+r/2} = x_{j+r/2} cos(tθ_j) + x_j sin(tθ_j)        θ_j = base^(−2j/r)

    and ``y_j = x_j`` for ``j >= r``; the value columns pass through.

    Args:
        qkv: ``(B, T, n_heads·d_qk + n_kv_heads·(d_qk + d_head))``, the fused projection
            ``[q | k | v]`` (head ``h`` owns columns ``h·d_qk …`` of the q and of the k part), float.
        n_heads, d_qk: the query heads and the query/key width per head (Hugging Face's ``head_dim``).
        positions: integer positions ``(T,)`` or ``(B, T)``; ``None`` for ``0 … T-1``. A KV-cache
            step passes the cache's positions (:meth:`pedestrian.model.kv_cache.KVCache.positions`), so
            cached keys are stored already rotated.
        base: RoPE's base (10,000 in RoFormer and GPT-NeoX).
        rotated: ``r``, the even number of dimensions rotated per head (``None``: ``d_qk``, or
            ``d_qk − 1`` if that is odd).
        n_kv_heads: key heads (grouped-query attention; ``None``: ``n_heads``).
        scaling: ``None`` or a :class:`pedestrian.config.RopeScaling` (Llama 3's frequency
            scaling, :func:`llama3_theta`; changes only ``θ_j``).

    Returns:
        ``(y, cache)``: ``y`` shaped like ``qkv``, a new array; ``cache = (cos, sin, n_heads +
        n_kv_heads, d_qk, r)`` for the backward.

    Raises:
        ValueError: ``rotated`` odd, below 2 or above ``d_qk``.
    """
    xp = array_namespace(qkv)
    r = d_qk - d_qk % 2 if rotated is None else rotated
    if r % 2 or not 2 <= r <= d_qk:
        raise ValueError(f"RoPE rotates an even number 2 <= r <= d_qk={d_qk} of dimensions, got r={r}")
    T = qkv.shape[1]
    pos = xp.arange(T, device=qkv.device) if positions is None else positions   # (T,) or (B, T)
    cos, sin = rope_angles(pos, r, base, qkv, scaling)                          # (…, T, 1, r/2)
    n_qk = n_heads + (n_heads if n_kv_heads is None else n_kv_heads)           # q heads, then k heads
    return _rotate(qkv, n_qk, d_qk, r, cos, sin), (cos, sin, n_qk, d_qk, r)


def rope_backward(delta, cache):
    """``Δ_in = R(−tθ) Δ`` on the q and k columns (the transpose of a rotation is the rotation
    by the opposite angle); the value columns' signal passes through.

    Args:
        delta: shaped like the forward's ``qkv``, the signal at the rotated ``qkv``.
        cache: from :func:`rope_forward`.

    Returns:
        ``Δ`` at the unrotated ``qkv``, same shape, a new array.
    """
    cos, sin, n_qk, d_qk, r = cache
    return _rotate(delta, n_qk, d_qk, r, cos, -sin)
