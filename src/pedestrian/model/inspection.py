"""The paper's names for what a :class:`~pedestrian.model.gpt.GPT`'s last forward and backward
kept (``a0 … a12``, ``Δ12 … Δ1``): the dictionaries :meth:`GPT.activations` and
:meth:`GPT.deltas` return, built from the chain's per-block records; and whether a forward kept
what is asked of it.
"""

from __future__ import annotations


class Named(dict):
    """An inspection dictionary; a name the step did not keep (``not_kept``: name -> why) raises a
    ``KeyError`` that says why and how to keep it (the fused head's ``a12``, ``Δ12``)."""

    def __init__(self, items=(), not_kept=None):
        super().__init__(items)
        self.not_kept = dict(not_kept or {})

    def __missing__(self, key):
        if key in self.not_kept:
            raise KeyError(f"{key} {self.not_kept[key]}")
        raise KeyError(key)

    def like(self, items) -> "Named":
        """Other values under the same names and the same ``not_kept``."""
        return Named(items, self.not_kept)


def _unkept(name: str, f) -> dict:
    """``{name: why}`` when the record ``f`` ran the fused head (``a12`` / ``Δ12`` never made whole)."""
    from .head import NOT_KEPT

    return {name: NOT_KEPT} if getattr(f, "head", None) is not None else {}


def named_activations(f, attention_weights) -> dict:
    """:meth:`GPT.activations`' dictionary from a forward's record ``f``; ``attention_weights``
    makes a block's ``P`` from its attention cache. After a fused loss there is no ``"a12"``."""
    out = Named({"a0": f.a0, "a1": f.a1}, _unkept("a12", f))
    for i, b in enumerate(f.blocks):
        for n in _numbers(b, 2, 11):
            out[f"blocks.{i}.a{n}"] = getattr(b, f"a{n}")
        out[f"blocks.{i}.P"] = attention_weights(b.attn)
    out.update(a11=f.a11, **({} if out.not_kept else {"a12": f.a12}))
    return out


def named_deltas(top, blocks) -> dict:
    """:meth:`GPT.deltas`' dictionary from what :meth:`GPT._backward` returned (no ``"Δ12"``
    after a fused loss: ``top.d12`` is ``None``)."""
    from .head import NOT_KEPT

    out = Named({} if top.d12 is None else {"Δ12": top.d12}, {"Δ12": NOT_KEPT} if top.d12 is None else {})
    for i, D in reversed(list(enumerate(blocks))):              # in the order the backward ran
        out.update({f"blocks.{i}.Δ{n}": getattr(D, f"d{n}") for n in reversed(_numbers(D, 2, 11))})
        out[f"blocks.{i}.Δcausal"] = D.causal
    out.update({"Δ11": top.d11, "Δ1": top.d1})
    return out


def _numbers(block, first: int, stop: int) -> list:
    """The activation (or signal) numbers ``first … stop − 1`` a block kept: SwiGLU's ``7_gate``,
    ``7_up`` in place of ``7``; a plugged MLP's block has no ``7``, ``8``; the norms after the
    sublayers add ``4_post``, ``9_post`` (:mod:`pedestrian.model.placement`)."""
    prefix = "a" if hasattr(block, "a2") else "d"
    extra = {7: ["7_gate", "7_up"], 4: ["4_post"], 9: ["9_post"]}
    numbers = [m for n in range(first, stop) for m in [str(n), *extra.get(n, [])]]
    return [m for m in numbers if hasattr(block, prefix + m)]


def require_forward(f, backward: bool = False):
    """A thread's last forward record ``f``, if it kept what inspection (or, ``backward``, the
    backward) needs; else ``ValueError`` naming what to run again."""
    if f is None:
        raise ValueError("no forward pass has been run yet")
    if f.recomputed and not backward:
        raise ValueError("the last forward ran with model.recompute on, which keeps only each block's "
                         "input: set model.recompute = False and run the forward again to inspect it")
    if not f.kept:
        raise ValueError("the last forward ran with keep_activations=False (generation does): "
                         "run model.forward(tokens) again to keep its activations")
    if backward and f.a12 is None and getattr(f, "head", None) is None:
        raise ValueError("the last forward's backward wrote over what it read and let it go (model.recompute): "
                         "run model.loss(tokens, targets) again before another backward")
    return f
