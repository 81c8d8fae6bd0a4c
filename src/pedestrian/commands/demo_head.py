"""``pedestrian demo --head`` and ``--mask``: one attention head on numbers, every matrix on screen.

The computation is :mod:`pedestrian.paper.walkthrough` (the library's reference layer functions, one
step at a time); this module only prints it, as text or as one JSON object.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from ..paper.walkthrough import HEAD_INPUTS, HEAD_KEYS, HEAD_LABELS, against_the_layer, head_example, mask_comparison

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


def _sizes(args: argparse.Namespace) -> dict:
    return dict(T=args.T, d=args.d, d_rho=args.d_rho, d_h=args.d_h, seed=args.seed)


def _json_value(a: np.ndarray):
    """Nested lists of float64, row-major; ``-inf`` (a masked score) as ``None`` (JSON ``null``)."""
    return np.where(np.isneginf(a), None, a.astype(object)).tolist() if np.isneginf(a).any() else a.tolist()


def run_head(args: argparse.Namespace) -> int:
    """Print :func:`pedestrian.paper.walkthrough.head_example` (text, or ``--json``)."""
    causal = not args.no_causal
    ex = head_example(**_sizes(args), causal=causal)
    if args.json:
        print(json.dumps({k: _json_value(ex[k]) for k in HEAD_KEYS}))
        return 0
    T, d = ex["x"].shape
    d_rho, d_h = ex["w_q"].shape[1], ex["w_v"].shape[1]
    print(f"One attention head on numbers (paper section 3, Table 1): T = {T} tokens, d = {d}, "
          f"d_ρ = {d_rho}, d_h = {d_h}, " + ("causal mask (−∞ above the diagonal)" if causal else "no mask")
          + f", seed {args.seed}, float64.")
    print("Rows are tokens (query α down the side), columns features -- or keys β in the T × T "
          "matrices. Formulas: docs/EQUATIONS.md, \"One attention head\".\n")

    def show(key: str, fmt: str = "{:9.4f}", extra: str = "") -> None:
        symbol, formula = HEAD_LABELS[key]
        sep = ": " if key in HEAD_INPUTS else " = "
        print(_block(f"{symbol}", ex[key], sep.strip() + " " + formula + extra, fmt))

    print("== inputs (random, one decimal; --seed N draws others) ==\n")
    for key in HEAD_INPUTS[:-1]:
        show(key)
    print("== forward: a_{i-1} -> q, k, v -> ρ_raw -> ρ_scaled -> ρ_causal -> ρ -> a ==\n")
    for key in ("q", "k", "v", "rho_raw", "rho_scaled", "rho_causal", "rho", "a"):
        show(key, extra="   (each row sums to 1)" if key == "rho" else "")
    print("== backward: Δ_i^h -> Δv, Δρ -> Δcausal = Δscaled -> Δraw -> Δq, Δk -> Δ_{i-1}^h ==\n")
    show("delta")
    for key in ("delta_v", "delta_rho", "delta_causal"):
        show(key)
    sums = ex["delta_causal"].sum(axis=1)
    print("row sums of Δcausal (0 up to rounding, because each row of ρ sums to 1):")
    print("    " + _matrix(sums, "{:9.1e}")[0] + "\n")
    print("Δscaled = Δcausal: the mask is a fixed −∞, so nothing flows through it, and Δcausal is "
          "already 0 wherever ρ is 0 (compare the paper's 0/1 mask: pedestrian demo --mask).\n")
    for key in ("delta_raw", "delta_q", "delta_k"):
        show(key)
    print("== the three branches into the input, and their sum ==\n")
    for key in ("delta_in_q", "delta_in_k", "delta_in_v", "delta_in"):
        show(key)
    print("== parameter gradients ==\n")
    for key in ("dw_q", "db_q", "dw_k", "db_k", "dw_v", "db_v"):
        show(key, fmt="{:9.1e}" if key == "db_k" else "{:9.4f}")
    diff, zero = against_the_layer(ex, causal)      # the one-call reference layer, the zeros
    print(f"The library's reference layer on the same inputs (pedestrian.layers.attention_head_forward / "
          f"_backward): a, Δcausal, Δ_{{i-1}}^h and the six gradients agree to {diff:.1e}.")
    print(f"∂L/∂b_k and the row sums of Δcausal are rounding: largest |·| = {zero:.1e} "
          f"({'<=' if zero <= ZERO_BOUND else 'NOT <='} {ZERO_BOUND:.0e}).")
    print("Machine-readable: pedestrian demo --head --json; every gradient of a whole GPT: pedestrian demo.")
    return 0 if diff <= ZERO_BOUND and zero <= ZERO_BOUND else 1


def run_mask(args: argparse.Namespace) -> int:
    """Print :func:`pedestrian.paper.walkthrough.mask_comparison` (text, or ``--json``)."""
    cmp = mask_comparison(**_sizes(args))
    if args.json:
        out = {k: _json_value(cmp[k]) for k in ("mask", "rho_scaled", "delta_rho")}
        for name in ("hadamard", "neg_inf"):
            out[name] = {k: (v if isinstance(v, float) else _json_value(v)) for k, v in cmp[name].items()}
        print(json.dumps(out))
        return 0
    had, inf = cmp["hadamard"], cmp["neg_inf"]
    T = cmp["mask"].shape[0]
    print(f"The causal mask two ways on the same numbers as `pedestrian demo --head --seed {args.seed}` "
          f"(T = {T}; paper section 3.1, \"Final enhancements\").")
    print("The paper writes ρ_causal = m ∘ ρ_scaled, a Hadamard product with the 0/1 matrix m. Taken "
          "literally a masked score becomes 0, and exp(0) = 1: the future gets weight. The project "
          "puts −∞ there instead (exp(−∞) = 0).\n")
    print(_block("m", cmp["mask"], "1 where the key is not after the query (β <= α)", "{:4.0f}"))
    print(_block("ρ_scaled", cmp["rho_scaled"], "= q kᵀ / √d_ρ (the same under both masks)"))
    cols = ["paper, literally: m ∘ ρ_scaled", "this project: −∞ where m = 0"]
    rows = [("ρ_causal", "rho_causal", "{:9.4f}"), ("ρ = softmax(ρ_causal)", "rho", "{:9.4f}"),
            ("Δcausal = ∂L/∂ρ_causal = ρ ∘ (Δρ − rowsum(Δρ ∘ ρ))", "delta_causal", "{:9.4f}"),
            ("Δscaled = ∂L/∂ρ_scaled = m ∘ Δcausal (chain rule through either mask)", "delta_scaled", "{:9.4f}")]
    for label, key, fmt in rows:
        print(label)
        blocks = [[c] + _matrix(cmp[n][key], fmt) for c, n in zip(cols, ("hadamard", "neg_inf"))]
        print("\n".join("    " + line for line in _side_by_side(blocks)) + "\n")
    print("weight each query puts on future tokens, Σ_{β>α} ρ_αβ:")
    print(f"    {'query α':<10}{'m ∘ ρ_scaled':>14}{'−∞':>10}")
    for alpha in range(T):
        print(f"    {alpha:<10}{had['future_weight'][alpha]:>14.4f}{inf['future_weight'][alpha]:>10.4f}")
    ok = inf["max_scaled_minus_causal"] == 0.0 and float(np.max(inf["future_weight"])) == 0.0
    print(f"\nmax |Δscaled − Δcausal|: {had['max_scaled_minus_causal']:.4f} with m ∘ ρ_scaled "
          f"(Δcausal is not 0 at the masked entries; they hold the constant 0, so Δscaled = m ∘ Δcausal "
          f"drops it there), {inf['max_scaled_minus_causal']:.1e} with −∞.")
    print(f"So \"Δscaled = Δcausal\" (paper section 3.2) holds with −∞ only: "
          f"{'as stated' if ok else 'NOT AS STATED'}. Largest future weight: "
          f"{float(np.max(had['future_weight'])):.4f} (0/1 mask) against "
          f"{float(np.max(inf['future_weight'])):.1e} (−∞).")
    return 0 if ok else 1
