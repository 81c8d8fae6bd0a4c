"""Forward and backward on real text, then check every hand-derived gradient by finite differences.

Takes a few windows of the bundled Shakespeare (or --data), a character tokenizer and a tiny
float64 GPT, runs a0 -> a12 and back, prints the size of every error signal Δ12 ... Δ1 (how the
gradient flows back through the paper's numbered activations), and compares, for every
parameter tensor, a few gradient entries with central finite differences
(L(θ+h) − L(θ−h)) / 2h. An entry passes when |numeric − analytic| <= atol + rtol·|numeric|
(finite differences themselves are only good to about h² + ε/h ≈ 1e-10 absolute); exit status 1
if any entry fails. The relative error |numeric − analytic| / |numeric| is shown only where
|numeric| >= atol ('-' otherwise: a gradient that is exactly zero, e.g. that of the attention
key bias, which softmax's shift invariance cancels, has no meaningful relative error).

--properties instead measures the properties the paper states about positions (sections 2-3):
permutation equivariance without positions or mask, broken by RoPE, learned positions or the
causal mask; RoPE scores that depend only on the query-key offset; KV-cache logits equal to a
full forward for each position encoding. Each line gives the measured deviation and the bound
it is held to; exit status 1 if any property does not behave as stated.

Examples:
  pedestrian demo
  pedestrian demo --properties
  pedestrian demo --entries 10 --seed 3
  pedestrian demo --data my_text.txt --step 1e-6
"""

from __future__ import annotations

import argparse

import numpy as np

from ..config import GPTConfig
from ..data import TokenDataset, load_corpus
from ..model import GPT
from ..tokenizer import CharTokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", help="text file or folder (default: the bundled Shakespeare)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--entries", type=int, default=3, help="entries checked per parameter tensor (>= 1)")
    parser.add_argument("--step", type=float, default=1e-5, help="finite-difference step h (> 0)")
    parser.add_argument("--rtol", type=float, default=1e-6, help="relative tolerance")
    parser.add_argument("--atol", type=float, default=1e-8, help="absolute tolerance")
    parser.add_argument("--properties", action="store_true",
                        help="measure the paper's position properties instead (see above)")


def run(args: argparse.Namespace) -> int:
    import math

    if args.properties:
        return run_properties(args)

    if args.entries < 1:
        raise ValueError(f"--entries must be a positive integer, got {args.entries}")
    if not (math.isfinite(args.step) and args.step > 0):
        raise ValueError(f"--step must be a finite number > 0 (e.g. 1e-5), got {args.step}")
    for name in ("rtol", "atol"):
        v = getattr(args, name)
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"--{name} must be a finite number >= 0, got {v}")
    text = load_corpus(args.data)[:200_000]
    tokenizer = CharTokenizer.from_text(text)
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, context_length=16, d_model=24, n_heads=3,
                       n_blocks=2, d_qk=6, d_head=8)
    model = GPT(config, seed=args.seed, dtype="float64")
    rng = np.random.default_rng(args.seed)
    for name, p in model.params.items():          # larger random weights than the init, so every
        if name.endswith("bias"):                 # path carries a visible signal
            p[...] = rng.normal(0, 0.1, p.shape)
        elif p.ndim == 2:
            p[...] = rng.normal(0, 0.3, p.shape)
    x, y = TokenDataset(ids).get_batch(rng, 4, config.context_length)
    print(f"text: {len(text):,} characters, vocabulary {tokenizer.vocab_size}; "
          f"batch {x.shape}, first window: {tokenizer.decode(x[0])!r}")
    print(f"model: {config}")
    loss = model.loss(x, y)
    grads = {k: v.copy() for k, v in model.backward(keep_deltas=True).items()}
    print(f"loss a12 -> {loss:.6f} nats/char (uniform guess: {np.log(tokenizer.vocab_size):.4f})\n")
    print("error signals (Δ_i = dL/da_i), root mean square:")
    for name, delta in model.deltas().items():
        if not name.endswith("Δcausal"):
            print(f"  {name:<16} {tuple(delta.shape)!s:<14} {np.sqrt(np.mean(delta ** 2)):.3e}")
    print(f"\n{'parameter':<30}{'entries':>8}{'max abs err':>14}{'max rel err':>14}")
    failed = 0
    for name, p in model.params.items():
        flat_index = rng.choice(p.size, size=min(args.entries, p.size), replace=False)
        abs_errs, rel_errs = [], []
        for fi in flat_index:
            idx = np.unravel_index(fi, p.shape)
            old = p[idx]
            p[idx] = old + args.step
            up = model.loss(x, y)
            p[idx] = old - args.step
            down = model.loss(x, y)
            p[idx] = old
            numeric = (up - down) / (2 * args.step)
            analytic = grads[name][idx]
            err = abs(numeric - analytic)
            abs_errs.append(err)
            if abs(numeric) >= args.atol and abs(numeric) > 0:
                rel_errs.append(err / abs(numeric))
            failed += err > args.atol + args.rtol * abs(numeric)
        rel = f"{max(rel_errs):>14.2e}" if rel_errs else f"{'-':>14}"
        print(f"{name:<30}{len(abs_errs):>8}{max(abs_errs):>14.2e}{rel}")
    print(f"\n{failed} entries outside |numeric − analytic| <= {args.atol:g} + {args.rtol:g}·|numeric| "
          f"-> {'OK' if not failed else 'FAILED'}")
    return 0 if not failed else 1


# ------------------------------------------------------------------------------------------------
# --properties: the paper's statements about positions, measured (issue 14)
# ------------------------------------------------------------------------------------------------
#: float64 bounds. Equalities: the two sides compute the same sums in another order (permuted
#: rows, shifted angles, cached keys); a handful of rounded operations per entry through a
#: two-block model stays below 1e-12 relative (observed ~1e-15). Shifted RoPE angles reach
#: ~1,000 radians, rounded to ~1e3·eps ≈ 1e-13: bound 1e-10. Broken properties must deviate by
#: more than 1e-3 -- a real difference, not rounding.
EQUAL_BOUND, SHIFT_BOUND, BROKEN_BOUND = 1e-12, 1e-10, 1e-3


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _property_model(encoding: str, causal: bool, vocab_size: int, seed: int) -> GPT:
    """A two-block float64 model with weights larger than the initialisation (so attention is far
    from uniform and every path carries a visible signal)."""
    config = GPTConfig(vocab_size=vocab_size, context_length=16, d_model=24, n_heads=3, n_blocks=2,
                       causal=causal, position_encoding=encoding, rope_fraction=0.5 if encoding == "rope" else 1.0)
    model = GPT(config, seed=seed, dtype="float64")
    rng = np.random.default_rng(seed + 1)
    for name, p in model.params.items():
        p[...] = rng.normal(0, 0.1 if p.ndim == 1 else 0.4, p.shape) + (1.0 if ".ln" in name and name.endswith("weight") else 0.0)
    model.training = False
    return model


def measure_properties(tokens: np.ndarray, vocab_size: int, seed: int = 0) -> list[dict]:
    """Each property as ``{"name", "kind" ("equal" | "broken"), "deviation", "bound", "ok"}``.

    ``tokens``: ``(B, T)`` ids, ``T <= 16``. Permutation: a fixed random permutation ``π`` of the
    ``T`` positions; deviation ``max|logits(π·x) − π·logits(x)| / max|logits(x)|``. Offset:
    the same tokens fed at positions ``s … s+T-1`` (``KVCache.reset(first_position=s)``), the
    attention weights ``P`` of every block compared with those at ``0 … T-1``. KV cache: the
    tokens fed one at a time through a cache against one full forward.
    """
    from ..kv_cache import KVCache

    B, T = tokens.shape
    perm = np.random.default_rng(seed).permutation(T)
    out = []

    def record(encoding, causal, claim, kind, deviation, bound):
        ok = deviation <= bound if kind == "equal" else deviation > bound
        out.append(dict(encoding=encoding, mask="causal" if causal else "none", claim=claim, kind=kind,
                        deviation=deviation, bound=bound, ok=bool(ok)))

    for encoding, causal, kind, why in (
            ("none", False, "equal", "equivariant, §3"),
            ("rope", False, "broken", "RoPE breaks it, §2"),
            ("learned", False, "broken", "positions break it"),
            ("none", True, "broken", "the mask breaks it, §3")):
        model = _property_model(encoding, causal, vocab_size, seed)
        logits = np.asarray(model.forward(tokens))
        permuted = np.asarray(model.forward(tokens[:, perm]))
        record(encoding, causal, f"logits(π·x) = π·logits(x) ({why})", kind,
               _rel(permuted, logits[:, perm]), EQUAL_BOUND if kind == "equal" else BROKEN_BOUND)

    for encoding, kind in (("rope", "equal"), ("learned", "broken")):
        model = _property_model(encoding, True, vocab_size, seed)
        model.forward(tokens)
        plain = [np.asarray(p) for p in model.attention_weights()]
        worst = 0.0
        s = 16 - T if encoding == "learned" else 1000     # learned: the largest shift that exists
        if s > 0:
            cache = KVCache(model, B)
            cache.reset(first_position=s)
            model.forward(tokens, kv_cache=cache)
            worst = max(_rel(np.asarray(p), q) for p, q in zip(model.attention_weights(), plain))
        record(encoding, True, f"P at positions {s}… = P at 0… (" + ("offsets only, §2" if kind == "equal"
                                                                     else "absolute positions") + ")",
               kind, worst, SHIFT_BOUND if kind == "equal" else BROKEN_BOUND)

    for encoding in ("learned", "rope", "none"):
        model = _property_model(encoding, True, vocab_size, seed)
        full = np.asarray(model.forward(tokens))
        cache = KVCache(model, B)
        stepped = np.concatenate([np.asarray(model.forward(tokens[:, t:t + 1], kv_cache=cache))
                                  for t in range(T)], axis=1)
        record(encoding, True, "KV cache, token by token = full forward (§3)", "equal",
               _rel(stepped, full), EQUAL_BOUND)
    return out


def run_properties(args: argparse.Namespace) -> int:
    """``pedestrian demo --properties``: print :func:`measure_properties` on a window of text."""
    text = load_corpus(args.data)[:200_000]
    tokenizer = CharTokenizer.from_text(text)
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    x, _ = TokenDataset(ids).get_batch(np.random.default_rng(args.seed), 2, 12)
    print(f"text windows {x.shape}, first: {tokenizer.decode(x[0])!r}; float64 models with 2 blocks, "
          "3 heads, d_model 24 (RoPE rotates half of each head's d_qk)")
    print(f"\n{'positions':<10}{'mask':<8}{'property':<52}{'deviation':>10}  {'bound':<10}result")
    rows = measure_properties(x, tokenizer.vocab_size, seed=args.seed)
    for r in rows:
        bound = ("<= " if r["kind"] == "equal" else ">  ") + f"{r['bound']:.0e}"
        verdict = ("holds" if r["kind"] == "equal" else "broken, as stated") if r["ok"] else "NOT AS STATED"
        print(f"{r['encoding']:<10}{r['mask']:<8}{r['claim']:<52}{r['deviation']:>10.2e}  {bound:<10}{verdict}")
    failed = sum(not r["ok"] for r in rows)
    print(f"\ndeviation: max|a − b| / max|b| over the compared arrays. {len(rows) - failed} of {len(rows)} "
          f"properties as the paper states -> {'OK' if not failed else 'FAILED'}")
    return 0 if not failed else 1
