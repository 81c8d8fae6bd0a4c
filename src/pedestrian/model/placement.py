"""Where a block's norms sit (``config.norm_placement``; docs/EQUATIONS.md, "Norms after the
sublayers"): the norm after a sublayer, and its backward, for the chain of
:mod:`pedestrian.model.gpt`::

    "pre"       a5 = x + a4                 a10 = a5 + a9                  (GPT-2, Llama)
    "post"      a5 = x + LN1post(a4)        a10 = a5 + LN2post(a9)         (OLMo 2; a2 = x, a6 = a5)
    "sandwich"  a5 = x + LN1post(a4)        a10 = a5 + LN2post(a9)         (Gemma; a2 = LN1(x), a6 = LN2(a5))

``a4_post = LN1post(a4)`` and ``a9_post = LN2post(a9)`` are kept under those names (their
signals ``Δ4_post``, ``Δ9_post``); the norms are the model's norm slot (layer norm, RMS norm or
a plugged one), parameters ``blocks.{i}.ln1_post``, ``blocks.{i}.ln2_post``.
"""

from __future__ import annotations

__all__ = ["post_norm", "post_norm_backward", "skip_backward"]


def post_norm(norm, b, name: str, w):
    """``b.<name>`` (``"a4"``, ``"a9"``), or with a norm after the sublayer (``w`` not ``None``)
    its norm, kept as ``b.<name>_post`` (the norm's cache as ``b.<name>_norm``)."""
    if w is None:
        return getattr(b, name)
    out, cache = norm.forward(getattr(b, name), w)
    setattr(b, f"{name}_post", out)
    setattr(b, f"{name}_norm", cache)
    return out


def post_norm_backward(norm, D, delta, b, n: int, g):
    """Backward of :func:`post_norm` for ``a<n>``: ``delta`` (the signal at the branch) through the
    block ``b``'s norm after the sublayer when it has one (``D.d<n>_post`` keeps ``delta``; writes
    ``g``, ``None``: frozen), else ``delta`` itself."""
    cache = getattr(b, f"a{n}_norm", None)
    if cache is None:
        return delta
    setattr(D, f"d{n}_post", delta)
    return norm.backward(delta, cache, g)


def skip_backward(norm, K, delta, cache, delta_skip, g):
    """The signal at a skip's output that feeds a norm before a sublayer: ``Δ_skip + normᵀ(Δ)``
    (writes ``g``), or with no norm there (``cache`` ``None``: ``"post"``, where ``a2 = x`` and
    ``a6 = a5``) ``Δ_skip + Δ``."""
    return K.add(delta, delta_skip) if cache is None else norm.add_backward(delta, cache, delta_skip, g)
