"""Every gradient of one backward, named as the paper names it and checked: what ``pedestrian
demo`` prints (:func:`check_model_gradients`).

The lines come in the order the backward produces them (:func:`gradient_lines`): the error
signals Δi = ∂L/∂ai, each block's Δcausal = ∂L/∂ρ_causal, and the gradient of every parameter.
Each is checked one of two ways:

- ``"fd"``: central finite differences on ``entries`` entries of each parameter,
  ``(L(θ+h) - L(θ-h)) / 2h``; an entry passes when ``|numeric - analytic| <= atol +
  rtol·|numeric|``; the column is the largest relative error over entries with
  ``|numeric| >= atol`` (``"-"`` where none is, and for the Δi, which are not parameters).
- ``"autograd"``: every tensor against PyTorch autograd of the test suite's independent model
  (``tests/oracles/torch_reference.py``, a source checkout only: the library runs no autograd);
  a line passes when ``max|ours - autograd| <= AUTOGRAD_RTOL · max|autograd|``.

A SwiGLU model (``config.mlp == "swiglu"``) has ``Δ7_up``, ``∂L/∂W_up``, ``Δ7_gate``, ``∂L/∂W_gate``
in place of ``Δ7``, ``∂L/∂W_expand`` (and ``W_down`` for ``W_contract``; :data:`SWIGLU_SYMBOLS`); an
RMS-norm model (``config.norm == "rmsnorm"``) has ``∂L/∂w_RMS1`` … in place of ``∂L/∂w_LN1`` …
(:data:`RMS_SYMBOLS`).

With learned positions or none, the key bias's gradient is identically zero (paper section 3:
``b_k`` adds ``q_α · b_k`` to every score of row ``α``, which the softmax cancels; every row of
Δcausal sums to 0): its line says so and passes when it is rounding noise, at most
``KEY_BIAS_RATIO`` of the query bias's. Under RoPE that rule is false -- key ``β`` gets
``R_{t_β} b_k``, a different vector at every position, so the shift is no longer the same along a
row (EQUATIONS.md, "RoPE backward") -- and the key bias is checked like any other parameter
(:func:`key_bias_vanishes`, :data:`KEY_BIAS_ROPE_NOTE`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: key-bias gradient / query-bias gradient above which the "≡ 0" line fails (rounding is ~1e-16)
KEY_BIAS_RATIO = 1e-12
#: autograd check: per tensor, max|ours − autograd| <= AUTOGRAD_RTOL · max|autograd| passes
#: (float64: the two differ by rounding only; tests/paper/test_model.py holds them to the same bound)
AUTOGRAD_RTOL = 1e-9
#: the test suite's autograd oracle, in a source checkout (src/pedestrian/paper/ -> the root)
ORACLE = Path(__file__).resolve().parents[3] / "tests" / "oracles" / "torch_reference.py"

#: model parameter -> the paper's symbol (layer norms: w, b; fully connected layers: W, b)
SYMBOLS = {
    "ln1.weight": "w_LN1", "ln1.bias": "b_LN1", "ln2.weight": "w_LN2", "ln2.bias": "b_LN2",
    "attn.q.weight": "W_q", "attn.q.bias": "b_q", "attn.k.weight": "W_k", "attn.k.bias": "b_k",
    "attn.v.weight": "W_v", "attn.v.bias": "b_v",
    "attn_proj.weight": "W_attProj", "attn_proj.bias": "b_attProj",
    "mlp_expand.weight": "W_expand", "mlp_expand.bias": "b_expand",
    "mlp_contract.weight": "W_contract", "mlp_contract.bias": "b_contract",
    "ln_final.weight": "w_LNfinal", "ln_final.bias": "b_LNfinal",
    "logits.weight": "W_logits", "logits.bias": "b_logits",
    "tok_emb.weight": "W_tok", "pos_emb.weight": "W_pos",
    "ln1_post.weight": "w_LN1post", "ln1_post.bias": "b_LN1post", "ln2_post.weight": "w_LN2post",
    "ln2_post.bias": "b_LN2post", "attn.q_norm.weight": "w_qnorm", "attn.k_norm.weight": "w_knorm",
}
#: RMS norm's names (weight only: no mean, no bias), in place of :data:`SYMBOLS`' layer-norm ones
RMS_SYMBOLS = {"ln1.weight": "w_RMS1", "ln2.weight": "w_RMS2", "ln_final.weight": "w_RMSfinal",
               "ln1_post.weight": "w_RMS1post", "ln2_post.weight": "w_RMS2post"}
#: printed under the table when a key bias is checked under RoPE (:func:`key_bias_vanishes` false)
KEY_BIAS_ROPE_NOTE = ("∂L/∂b_k is not ≡ 0 here: paper section 3's rule needs the same b_k on every key, and RoPE\n"
                      "turns key β's bias by its position, R(t_β θ) b_k, so q_α · R(t_β θ) b_k varies along a row\n"
                      "of scores and the softmax no longer cancels it; its line is checked like any other.")
#: the SwiGLU MLP's names (EQUATIONS.md "SiLU and the SwiGLU MLP"; Hugging Face gate_proj,
#: up_proj, down_proj), in place of :data:`SYMBOLS`' for those parameters
SWIGLU_SYMBOLS = {"mlp_gate.weight": "W_gate", "mlp_gate.bias": "b_gate", "mlp_expand.weight": "W_up",
                  "mlp_expand.bias": "b_up", "mlp_contract.weight": "W_down", "mlp_contract.bias": "b_down"}


def key_bias_vanishes(config) -> bool:
    """Whether ``∂L/∂b_k ≡ 0`` holds for a model of this config: with learned positions or none
    (paper section 3: the same ``b_k`` on every key shifts each row of scores by a constant), not
    with RoPE (the key bias is rotated by each key's position; EQUATIONS.md "RoPE backward")."""
    return config.position_encoding != "rope"


def gradient_lines(model) -> list:
    """``(label, kind, key)`` in the order the backward produces them, Δ12 first.

    ``kind`` is ``"delta"`` (``key`` into :meth:`GPT.deltas`) or ``"param"`` (into the grads).
    The key bias's label says ``(≡ 0, §3)`` only where :func:`key_bias_vanishes`, ``(RoPE: ≢ 0)``
    otherwise. A plugged layer's parameters (:mod:`pedestrian.model.slots`) are named as they are
    (``∂L/∂ln1.alpha``); a plugged MLP has no ``Δ8``, ``Δ7``.
    """
    c, names = model.config, set(model.params)
    swiglu = c.mlp == "swiglu"
    plugged = [s.name for s in model.parameters.specs if s.kind == "plugged"]
    plugged_mlp = "mlp" in model.slots.plugged
    symbols = {**SYMBOLS, **(SWIGLU_SYMBOLS if swiglu else {}), **(RMS_SYMBOLS if c.norm == "rmsnorm" else {})}
    k_bias_note = " (≡ 0, §3)" if key_bias_vanishes(c) else " (RoPE: ≢ 0)"
    out = []

    def params(prefix, *suffixes, where=""):
        for s in suffixes:
            name = f"{prefix}{s}"
            if name in names and name not in plugged:
                label = f"∂L/∂{symbols[s]}"
                if s == "attn.k.bias":
                    label += k_bias_note
                out.append((f"{label:<24}{where}", "param", name))
        place = f"{prefix}{suffixes[0].split('.')[0]}."
        for name in plugged:                               # a plugged layer's, at the same place
            if name.startswith(place):
                out.append((f"{'∂L/∂' + name[len(prefix):]:<24}{where}", "param", name))

    def delta(n, key, where=""):                           # n: 7, or "7_gate" (SwiGLU)
        out.append((f"{f'Δ{n} = ∂L/∂a{n}':<24}{where}", "delta", key))

    delta(12, "Δ12", "(logits)")
    params("", "logits.weight", "logits.bias")
    delta(11, "Δ11")
    params("", "ln_final.weight", "ln_final.bias")
    for i in reversed(range(c.n_blocks)):
        p, where = f"blocks.{i}.", f"block {i}"
        delta(10, p + "Δ10", where)
        if c.norm_placement != "pre":                      # the norm after the MLP (model/placement.py)
            delta("9_post", p + "Δ9_post", where)
            params(p, "ln2_post.weight", "ln2_post.bias", where=where)
        delta(9, p + "Δ9", where)
        params(p, "mlp_contract.weight", "mlp_contract.bias", where=where)
        if plugged_mlp:                                    # a6 -> a9 in one plugged layer
            params(p, "mlp.", where=where)
        elif swiglu:                                       # Δ8 -> Δ7_up, Δ7_gate -> Δ6 (their sum)
            delta(8, p + "Δ8", where)
            delta("7_up", p + "Δ7_up", where)
            params(p, "mlp_expand.weight", "mlp_expand.bias", where=where)
            delta("7_gate", p + "Δ7_gate", where)
            params(p, "mlp_gate.weight", "mlp_gate.bias", where=where)
        else:
            delta(8, p + "Δ8", where)
            params(p, "act.", where=where)                 # a plugged activation's parameters
            delta(7, p + "Δ7", where)
            params(p, "mlp_expand.weight", "mlp_expand.bias", where=where)
        delta(6, p + "Δ6", where)
        params(p, "ln2.weight", "ln2.bias", where=where)
        delta(5, p + "Δ5", where)
        if c.norm_placement != "pre":                      # the norm after the attention
            delta("4_post", p + "Δ4_post", where)
            params(p, "ln1_post.weight", "ln1_post.bias", where=where)
        delta(4, p + "Δ4", where)
        params(p, "attn_proj.weight", "attn_proj.bias", where=where)
        delta(3, p + "Δ3", where)
        out.append((f"{'Δcausal = ∂L/∂S':<24}{where}", "delta", p + "Δcausal"))
        params(p, "attn.q_norm.weight", "attn.k_norm.weight", where=where)   # the prelude's q/k norms
        params(p, "attn.q.weight", "attn.q.bias", "attn.k.weight", "attn.k.bias", "attn.v.weight",
               "attn.v.bias", where=where)
        delta(2, p + "Δ2", where)
        params(p, "ln1.weight", "ln1.bias", where=where)
    delta(1, "Δ1")
    params("", "tok_emb.weight", "pos_emb.weight")
    if c.tie_weights:                                      # W_tok's gradient sums both of its uses
        i = next(n for n, line in enumerate(out) if line[2] == "tok_emb.weight")   # (no pos_emb with RoPE)
        out[i] = (out[i][0].rstrip() + "  (embedding + tied logits)", "param", "tok_emb.weight")
    return out


def autograd_oracle():
    """The test suite's independent PyTorch model (:data:`ORACLE`), loaded as a module.

    Raises:
        ValueError: not a source checkout (the oracle is not installed with the package), or
            PyTorch missing; the message says how to go on.
    """
    if not ORACLE.is_file():
        raise ValueError(f"--check autograd runs the test suite's autograd oracle ({ORACLE.name} in tests/oracles/), "
                         "which only a source checkout has -- the library itself runs no autograd; run it from "
                         "a checkout, or use --check fd (finite differences)")
    try:
        __import__("torch")
    except ImportError:
        raise ValueError('--check autograd needs PyTorch: install it with pip install -e ".[torch]", '
                         "or use --check fd (finite differences, NumPy only)") from None
    spec = importlib.util.spec_from_file_location("pedestrian_autograd_oracle", ORACLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def finite_differences(model, name: str, grad: np.ndarray, x, y, entries: int, step: float, rtol: float,
                       atol: float, rng) -> tuple[bool, str]:
    """Central differences on ``entries`` entries (drawn from ``rng``) of parameter ``name``:
    ``(failed, column)`` -- the column as in the module docstring."""
    p = model.params[name]
    rel_errs, failed = [], False
    for fi in rng.choice(p.size, size=min(entries, p.size), replace=False):
        idx = np.unravel_index(fi, p.shape)
        old = p[idx]
        p[idx] = old + step
        up = model.loss(x, y)
        p[idx] = old - step
        down = model.loss(x, y)
        p[idx] = old
        numeric = (up - down) / (2 * step)
        err = abs(numeric - grad[idx])
        if abs(numeric) >= atol and abs(numeric) > 0:
            rel_errs.append(err / abs(numeric))
        failed |= bool(err > atol + rtol * abs(numeric))
    return failed, (f"{max(rel_errs):.1e}" if rel_errs else "-")


@dataclass
class GradientLine:
    """One printed line: ``label`` (the paper's name, and the block), the tensor's ``shape``,
    ``size`` (its largest ``|entry|``), the check's column ``shown`` and whether it ``failed``."""

    label: str
    shape: tuple
    size: float
    shown: str
    failed: bool


def check_model_gradients(model, x, y, check: str = "fd", *, entries: int = 3, step: float = 1e-5,
                          rtol: float = 1e-6, atol: float = 1e-8, rng=None, oracle=None) -> tuple[float, list, float | None]:
    """One forward and backward of ``model`` on ``(x, y)``, every gradient checked.

    ``check``: ``"fd"`` or ``"autograd"`` (module docstring); ``oracle``: the module of
    :func:`autograd_oracle` (loaded here when not given). ``rng`` draws the finite-difference
    entries (default: a new generator seeded with 0).

    Returns:
        ``(loss, lines, oracle_loss)``: the loss, one :class:`GradientLine` per
        :func:`gradient_lines` entry, and the oracle's loss (``None`` for ``"fd"``).
    """
    rng = np.random.default_rng(0) if rng is None else rng
    fused, model.fused_head = model.fused_head, False     # Δ12 is shown: the logits kept (model/head.py)
    try:
        loss = model.loss(x, y)
        grads = {k: np.array(v) for k, v in model.backward(keep_deltas=True).items()}
        deltas = {k: np.array(v) for k, v in model.deltas().items()}
    finally:
        model.fused_head = fused
    truth = None
    if check == "autograd":
        oracle = autograd_oracle() if oracle is None else oracle
        cfg = {k: getattr(model.config, k) for k in oracle.default_cfg()}
        if cfg.get("rope_scaling") is not None:            # the oracle reads Hugging Face's dict
            cfg["rope_scaling"] = cfg["rope_scaling"].to_hf()
        o_loss, _, o_grads, o_deltas = oracle.reference_loss_and_grads(model.state_dict(), cfg, x, y,
                                                                       keep_scores=True)
        truth = {"param": o_grads, "delta": o_deltas}
    kq = {i: float(np.max(np.abs(grads[f"blocks.{i}.attn.q.bias"])))
          for i in range(model.config.n_blocks) if f"blocks.{i}.attn.q.bias" in grads}
    lines = []
    for label, kind, key in gradient_lines(model):
        value = deltas[key] if kind == "delta" else grads[key]
        size = float(np.max(np.abs(value)))
        if truth is not None:                              # max |ours - autograd|
            expected = truth[kind][key]
            diff = float(np.max(np.abs(value - expected)))
            bad, shown = diff > AUTOGRAD_RTOL * float(np.max(np.abs(expected))), f"{diff:.1e}"
        if key.endswith("attn.k.bias") and key_bias_vanishes(model.config):   # ≡ 0: only rounding noise
            bad = size > KEY_BIAS_RATIO * kq[int(key.split(".")[1])]
            if truth is None:
                shown = "rounding" if not bad else "NOT ZERO"
        elif truth is not None:
            pass
        elif kind == "delta":
            bad, shown = False, "-"
        else:
            bad, shown = finite_differences(model, key, grads[key], x, y, entries, step, rtol, atol, rng)
        lines.append(GradientLine(label, tuple(value.shape), size, shown, bool(bad)))
    return loss, lines, (None if truth is None else o_loss)


def gradients_text(loss: float, lines: list, vocab_size: int, check: str = "fd", *, entries: int = 3,
                   step: float = 1e-5, rtol: float = 1e-6, atol: float = 1e-8,
                   oracle_loss: float | None = None) -> tuple[str, bool]:
    """``(text, passed)``: the result of :func:`check_model_gradients` as ``pedestrian demo``
    prints it -- the loss beside the uniform guess ``ln vocab_size``, the check and its pass
    rule, one line per gradient (label, shape, largest entry, the check's column, ``<- FAILED``
    on a failing line), the count of failures, and :data:`KEY_BIAS_ROPE_NOTE` when a key bias
    line is labelled ``(RoPE: ≢ 0)``."""
    import math

    out = [f"loss L = {loss:.6f} nats/char (uniform guess: ln {vocab_size} = {math.log(vocab_size):.4f})"]
    if check == "autograd":
        out.append(f"check: PyTorch autograd of the test suite's independent model (float64; its loss "
                   f"{oracle_loss:.6f}); pass max |ours - autograd| <= {AUTOGRAD_RTOL:g}·max |autograd| per tensor\n")
    else:
        out.append(f"check: central finite differences, h = {step:g}, {entries} entries per parameter; "
                   f"pass |numeric - analytic| <= {atol:g} + {rtol:g}·|numeric|\n")
    out.append(f"{'gradient':<37}{'shape':<14}{'max |·|':>10}{'autograd' if check == 'autograd' else 'check':>11}")
    for g in lines:
        # a failing line says so: in fd mode the column (a relative error) alone cannot tell,
        # since an entry near atol passes on its absolute error
        out.append(f"{g.label:<37}{str(g.shape):<14}{g.size:>10.1e}{g.shown:>11}" + ("  <- FAILED" if g.failed else ""))
    failed = sum(g.failed for g in lines)
    out.append(f"\n{failed} gradients fail the check -> {'OK' if not failed else 'FAILED'}")
    if any("(RoPE: ≢ 0)" in g.label for g in lines):
        out.append(KEY_BIAS_ROPE_NOTE)
    return "\n".join(out), not failed
