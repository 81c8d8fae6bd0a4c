"""The demo's models: a tiny float64 GPT on real text whose weights are larger than the
initialisation, so every path carries a visible signal (:func:`demo_model`, what ``pedestrian
demo`` checks every gradient of), and the paper's statements about positions measured on such
models (:func:`measure_properties`, sections 2-3: permutation equivariance and what breaks it,
RoPE scores that depend only on offsets, the KV cache equal to a full forward), as text by
:func:`properties_text`.
"""

from __future__ import annotations

import numpy as np

from ..config import GPTConfig
from ..model import GPT
from ..text.data import load_corpus
from ..text.tokenizer import CharTokenizer
from ..text.tokens import TokenDataset


#: ``demo_model(arch="llama")``'s fields beside the widths: RMS norm, SwiGLU, RoPE with Llama 3's
#: frequency scaling (an original context of 8 < 16, so every kind of plane -- kept, stretched,
#: smoothed -- occurs), grouped-query attention 4:2, no biases, tied logits
LLAMA_DEMO = dict(d_model=24, n_heads=4, n_kv_heads=2, d_qk=6, d_head=6, d_mlp=40, norm="rmsnorm",
                  mlp="swiglu", activation="silu", position_encoding="rope", bias=False, tie_weights=True,
                  rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8))


def demo_model(data=None, seed: int = 0, kernels=None, rng=None, arch: str = "gpt2"):
    """The demo's model and batch: ``(model, x, y, tokenizer, text)``.

    A float64 GPT (2 blocks, 3 heads, d_model 24, d_qk 6, d_head 8, context 16; ``arch="llama"``:
    :data:`LLAMA_DEMO`'s 4 query and 2 key/value heads of width 6, RMS norm, SwiGLU of width 40,
    RoPE with Llama 3 scaling) with larger random
    weights than the initialisation (so every path carries a visible signal), and 4 windows of
    16 characters of ``data`` (default: the bundled Shakespeare), drawn from ``rng`` (default:
    a new generator seeded with ``seed``; the caller's generator goes on from there): ``x`` and
    ``y`` are ``(4, 16)`` int64 ids, ``y`` the next character of each. ``kernels``: as
    :class:`pedestrian.GPT`.

    Raises:
        FileNotFoundError, UnicodeDecodeError, ValueError: ``data`` cannot be read as a corpus,
            or ``arch`` is neither ``"gpt2"`` nor ``"llama"``.
    """
    if arch not in ("gpt2", "llama"):
        raise ValueError(f"unknown arch {arch!r}; choose 'gpt2' or 'llama'")
    text = load_corpus(data)[:200_000]
    tokenizer = CharTokenizer.from_text(text)
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    widths = LLAMA_DEMO if arch == "llama" else dict(d_model=24, n_heads=3, d_qk=6, d_head=8)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, context_length=16, n_blocks=2, **widths)
    model = GPT(config, seed=seed, dtype="float64", kernels=kernels)
    rng = np.random.default_rng(seed) if rng is None else rng
    for name, p in model.params.items():          # larger random weights than the init, so every
        if name.endswith("bias"):                 # path carries a visible signal
            p[...] = rng.normal(0, 0.1, p.shape)
        elif p.ndim == 2:
            p[...] = rng.normal(0, 0.3, p.shape)
    x, y = TokenDataset(ids).get_batch(rng, 4, config.context_length)
    return model, x, y, tokenizer, text


# ------------------------------------------------------------------------------------------------
# the paper's statements about positions, measured
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
    from ..model.kv_cache import KVCache

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


def properties_text(data=None, seed: int = 0) -> tuple[str, bool]:
    """``(text, ok)``: :func:`measure_properties` on two windows of ``data`` (default: the bundled
    Shakespeare; ``seed`` draws them and the models), one line per property with its deviation,
    bound and verdict -- what ``pedestrian demo --properties`` prints; ``ok``: every property
    behaves as the paper states.

    Raises:
        FileNotFoundError, UnicodeDecodeError, ValueError: ``data`` cannot be read as a corpus.
    """
    lines = []
    say = lines.append
    text = load_corpus(data)[:200_000]
    tokenizer = CharTokenizer.from_text(text)
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    x, _ = TokenDataset(ids).get_batch(np.random.default_rng(seed), 2, 12)
    say(f"text windows {x.shape}, first: {tokenizer.decode(x[0])!r}; float64 models with 2 blocks, "
        "3 heads, d_model 24 (RoPE rotates half of each head's d_qk)")
    say(f"\n{'positions':<10}{'mask':<8}{'property':<52}{'deviation':>10}  {'bound':<10}result")
    rows = measure_properties(x, tokenizer.vocab_size, seed=seed)
    for r in rows:
        bound = ("<= " if r["kind"] == "equal" else ">  ") + f"{r['bound']:.0e}"
        verdict = ("holds" if r["kind"] == "equal" else "broken, as stated") if r["ok"] else "NOT AS STATED"
        say(f"{r['encoding']:<10}{r['mask']:<8}{r['claim']:<52}{r['deviation']:>10.2e}  {bound:<10}{verdict}")
    failed = sum(not r["ok"] for r in rows)
    say(f"\ndeviation: max|a − b| / max|b| over the compared arrays. {len(rows) - failed} of {len(rows)} "
        f"properties as the paper states -> {'OK' if not failed else 'FAILED'}")
    return "\n".join(lines), not failed
