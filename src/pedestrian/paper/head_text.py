"""One attention head on screen: the worked example of the paper's section 3 (its Table 1) and
the two causal masks, as text (:func:`head_text`, :func:`mask_text`) or as JSON objects
(:func:`head_json`, :func:`mask_json`) -- what ``pedestrian demo --head`` and ``--mask`` print.

The numbers are :mod:`pedestrian.paper.walkthrough`'s (the library's reference layer functions,
one step at a time); this module only lays them out. Matrices print one row per line, ``-inf``
as ``−∞``; JSON arrays are float64 nested lists (row-major), a masked score ``null``.
"""

from __future__ import annotations

import numpy as np

from .walkthrough import HEAD_INPUTS, HEAD_KEYS, HEAD_LABELS, against_the_layer

__all__ = ["ZERO_BOUND", "head_text", "mask_text", "head_json", "mask_json"]

#: |value| under which a number that must be 0 (row sums of Δcausal, ∂L/∂b_k) counts as rounding:
#: the sums in question are of O(1) terms, each rounded to ~1e-16
ZERO_BOUND = 1e-12


def _matrix(a: np.ndarray, fmt: str = "{:9.4f}") -> list[str]:
    """Rows of ``a`` (1-D: one row) as text, one line each, ``-inf`` written ``−∞``."""
    a = np.atleast_2d(a)
    return ["[" + " ".join(("      −∞ " if np.isneginf(v) else fmt.format(v + 0.0)) for v in row) + " ]"
            for row in a]                                   # + 0.0: a signed zero prints as 0


def _shape(a: np.ndarray) -> str:
    return "(" + " × ".join(str(n) for n in a.shape) + ")"


def _block(label: str, a: np.ndarray, note: str = "", fmt: str = "{:9.4f}") -> str:
    head = f"{label}  {_shape(a)}" + (f"  {note}" if note else "")
    return "\n".join([head] + ["    " + line for line in _matrix(a, fmt)]) + "\n"


def _side_by_side(blocks: list[list[str]], gap: int = 4) -> list[str]:
    width = [max(len(s) for s in b) for b in blocks]
    rows = max(len(b) for b in blocks)
    return ["".join((b[r] if r < len(b) else "").ljust(w + gap) for b, w in zip(blocks, width)).rstrip()
            for r in range(rows)]


def _json_value(a: np.ndarray):
    """Nested lists of float64, row-major; ``-inf`` (a masked score) as ``None`` (JSON ``null``)."""
    return np.where(np.isneginf(a), None, a.astype(object)).tolist() if np.isneginf(a).any() else a.tolist()


def head_json(ex: dict) -> dict:
    """The example ``ex`` as one JSON object: every key of ``HEAD_KEYS``, float64 nested lists."""
    return {k: _json_value(ex[k]) for k in HEAD_KEYS}


def mask_json(cmp: dict) -> dict:
    """The comparison ``cmp`` as one JSON object (``pedestrian demo --mask --json``)."""
    out = {k: _json_value(cmp[k]) for k in ("mask", "rho_scaled", "delta_rho")}
    for name in ("hadamard", "neg_inf"):
        out[name] = {k: (v if isinstance(v, float) else _json_value(v)) for k, v in cmp[name].items()}
    return out


def head_text(ex: dict, seed: int = 0, causal: bool = True) -> tuple[str, bool]:
    """``(text, ok)``: the example ``ex`` of :func:`~pedestrian.paper.walkthrough.head_example`
    (drawn with ``seed``, with or without the causal mask), every matrix with its symbol, shape
    and formula, and its check against the one-call reference layer
    (:func:`~pedestrian.paper.walkthrough.against_the_layer`); ``ok``: both of that check's
    numbers within :data:`ZERO_BOUND`."""
    lines = []
    say = lines.append
    T, d = ex["x"].shape
    d_rho, d_h = ex["w_q"].shape[1], ex["w_v"].shape[1]
    say(f"One attention head on numbers (paper section 3, Table 1): T = {T} tokens, d = {d}, "
        f"d_ρ = {d_rho}, d_h = {d_h}, " + ("causal mask (−∞ above the diagonal)" if causal else "no mask")
        + f", seed {seed}, float64.")
    say("Rows are tokens (query α down the side), columns features -- or keys β in the T × T "
        "matrices. Formulas: docs/EQUATIONS.md, \"One attention head\".\n")

    def show(key: str, fmt: str = "{:9.4f}", extra: str = "") -> None:
        symbol, formula = HEAD_LABELS[key]
        sep = ": " if key in HEAD_INPUTS else " = "
        say(_block(f"{symbol}", ex[key], sep.strip() + " " + formula + extra, fmt))

    say("== inputs (random, one decimal; --seed N draws others) ==\n")
    for key in HEAD_INPUTS[:-1]:
        show(key)
    say("== forward: a_{i-1} -> q, k, v -> ρ_raw -> ρ_scaled -> ρ_causal -> ρ -> a ==\n")
    for key in ("q", "k", "v", "rho_raw", "rho_scaled", "rho_causal", "rho", "a"):
        show(key, extra="   (each row sums to 1)" if key == "rho" else "")
    say("== backward: Δ_i^h -> Δv, Δρ -> Δcausal = Δscaled -> Δraw -> Δq, Δk -> Δ_{i-1}^h ==\n")
    show("delta")
    for key in ("delta_v", "delta_rho", "delta_causal"):
        show(key)
    sums = ex["delta_causal"].sum(axis=1)
    say("row sums of Δcausal (0 up to rounding, because each row of ρ sums to 1):")
    say("    " + _matrix(sums, "{:9.1e}")[0] + "\n")
    say("Δscaled = Δcausal: the mask is a fixed −∞, so nothing flows through it, and Δcausal is "
        "already 0 wherever ρ is 0 (compare the paper's 0/1 mask: pedestrian demo --mask).\n")
    for key in ("delta_raw", "delta_q", "delta_k"):
        show(key)
    say("== the three branches into the input, and their sum ==\n")
    for key in ("delta_in_q", "delta_in_k", "delta_in_v", "delta_in"):
        show(key)
    say("== parameter gradients ==\n")
    for key in ("dw_q", "db_q", "dw_k", "db_k", "dw_v", "db_v"):
        show(key, fmt="{:9.1e}" if key == "db_k" else "{:9.4f}")
    diff, zero = against_the_layer(ex, causal)      # the one-call reference layer, the zeros
    say(f"The library's reference layer on the same inputs (pedestrian.layers.attention_head_forward / "
        f"_backward): a, Δcausal, Δ_{{i-1}}^h and the six gradients agree to {diff:.1e}.")
    say(f"∂L/∂b_k and the row sums of Δcausal are rounding: largest |·| = {zero:.1e} "
        f"({'<=' if zero <= ZERO_BOUND else 'NOT <='} {ZERO_BOUND:.0e}).")
    say("Machine-readable: pedestrian demo --head --json; every gradient of a whole GPT: pedestrian demo.")
    return "\n".join(lines), diff <= ZERO_BOUND and zero <= ZERO_BOUND


def mask_text(cmp: dict, seed: int = 0) -> tuple[str, bool]:
    """``(text, ok)``: the comparison ``cmp`` of :func:`~pedestrian.paper.walkthrough.mask_comparison`
    (drawn with ``seed``) side by side; ``ok``: the −∞ mask leaves no weight on the future and
    ``Δscaled = Δcausal`` exactly, as the paper states."""
    lines = []
    say = lines.append
    had, inf = cmp["hadamard"], cmp["neg_inf"]
    T = cmp["mask"].shape[0]
    say(f"The causal mask two ways on the same numbers as `pedestrian demo --head --seed {seed}` "
        f"(T = {T}; paper section 3.1, \"Final enhancements\").")
    say("The paper writes ρ_causal = m ∘ ρ_scaled, a Hadamard product with the 0/1 matrix m. Taken "
        "literally a masked score becomes 0, and exp(0) = 1: the future gets weight. The project "
        "puts −∞ there instead (exp(−∞) = 0).\n")
    say(_block("m", cmp["mask"], "1 where the key is not after the query (β <= α)", "{:4.0f}"))
    say(_block("ρ_scaled", cmp["rho_scaled"], "= q kᵀ / √d_ρ (the same under both masks)"))
    cols = ["paper, literally: m ∘ ρ_scaled", "this project: −∞ where m = 0"]
    rows = [("ρ_causal", "rho_causal", "{:9.4f}"), ("ρ = softmax(ρ_causal)", "rho", "{:9.4f}"),
            ("Δcausal = ∂L/∂ρ_causal = ρ ∘ (Δρ − rowsum(Δρ ∘ ρ))", "delta_causal", "{:9.4f}"),
            ("Δscaled = ∂L/∂ρ_scaled = m ∘ Δcausal (chain rule through either mask)", "delta_scaled", "{:9.4f}")]
    for label, key, fmt in rows:
        say(label)
        blocks = [[c] + _matrix(cmp[n][key], fmt) for c, n in zip(cols, ("hadamard", "neg_inf"))]
        say("\n".join("    " + line for line in _side_by_side(blocks)) + "\n")
    say("weight each query puts on future tokens, Σ_{β>α} ρ_αβ:")
    say(f"    {'query α':<10}{'m ∘ ρ_scaled':>14}{'−∞':>10}")
    for alpha in range(T):
        say(f"    {alpha:<10}{had['future_weight'][alpha]:>14.4f}{inf['future_weight'][alpha]:>10.4f}")
    ok = inf["max_scaled_minus_causal"] == 0.0 and float(np.max(inf["future_weight"])) == 0.0
    say(f"\nmax |Δscaled − Δcausal|: {had['max_scaled_minus_causal']:.4f} with m ∘ ρ_scaled "
        f"(Δcausal is not 0 at the masked entries; they hold the constant 0, so Δscaled = m ∘ Δcausal "
        f"drops it there), {inf['max_scaled_minus_causal']:.1e} with −∞.")
    say(f"So \"Δscaled = Δcausal\" (paper section 3.2) holds with −∞ only: "
        f"{'as stated' if ok else 'NOT AS STATED'}. Largest future weight: "
        f"{float(np.max(had['future_weight'])):.4f} (0/1 mask) against "
        f"{float(np.max(inf['future_weight'])):.1e} (−∞).")
    return "\n".join(lines), ok
