"""What each fast kernel buys: every layer function, reference against fast, on one thread.

For each function of ``pedestrian.layers.MODEL_FUNCTIONS`` that the fast path implements itself,
times the reference (:mod:`pedestrian.layers`) and the fast (:mod:`pedestrian.kernels`) version
on the shapes of a training step of a config (char-small: B·T = 12·64, d 128; gpt2-124M:
B·T = 4·64, d 768), and one generated token (T = 1 against a 256-token KV cache). Each figure is
the median of ``--repeats`` calls measured in *CPU time of the calling thread*
(``time.thread_time``), with BLAS and pedestrian held to one thread: a busy machine stretches wall
time, not thread time, so the ratios hold on a shared machine.

    python3 benchmarks/bench_kernels.py                 # char-small and gpt2-124M, prints markdown
    python3 benchmarks/bench_kernels.py --config char-small --repeats 200

Run by hand; never a timed test. The table it prints is the one in ``docs/kernels.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PEDESTRIAN_NUM_THREADS"):
    os.environ[_var] = "1"                       # before NumPy loads its BLAS

import numpy as np  # noqa: E402

CONFIGS = {"char-small": dict(B=12, T=64, d=128, H=4, V=65), "gpt2-124M": dict(B=4, T=64, d=768, H=12, V=50257)}


def median_us(fn, repeats: int) -> float:
    fn()                                         # warm-up (and the pool's first arrays)
    times = []
    for _ in range(repeats):
        t0 = time.thread_time_ns()
        fn()
        times.append(time.thread_time_ns() - t0)
    return float(np.median(times)) / 1e3


def cases(c: dict, rng: np.random.Generator):
    """``(label, function name, args builder)``: each builder returns the call's arguments for a
    given module (caches come from that module's own forward)."""
    B, T, d, H, V = c["B"], c["T"], c["d"], c["H"], c["V"]
    f32 = np.float32
    x = rng.standard_normal((B, T, d)).astype(f32)
    w, b = (1 + 0.1 * rng.standard_normal(d)).astype(f32), (0.1 * rng.standard_normal(d)).astype(f32)
    W = (0.02 * rng.standard_normal((d, 4 * d))).astype(f32)
    a7 = rng.standard_normal((B, T, 4 * d)).astype(f32)
    qkv = rng.standard_normal((B, T, 3 * d)).astype(f32)
    logits = rng.standard_normal((B, T, V)).astype(f32)
    targets = rng.integers(0, V, (B, T))
    tok = (0.02 * rng.standard_normal((V, d))).astype(f32)
    pos = (0.02 * rng.standard_normal((1024, d))).astype(f32)
    tokens = rng.integers(0, V, (B, T))
    dh = d // H
    out = [
        ("layer norm forward", lambda K: (K.layernorm_forward, (x, w, b, 1e-5), {})),
        ("layer norm backward", lambda K: (K.layernorm_backward, (x, K.layernorm_forward(x, w, b, 1e-5)[1]),
                                           dict(dweight=np.empty(d, f32), dbias=np.empty(d, f32)))),
        ("GELU-tanh forward", lambda K: (K.activation_forward, (a7, "gelu_tanh"), {})),
        ("GELU-tanh backward", lambda K: (K.activation_backward, (a7, K.activation_forward(a7, "gelu_tanh")[1],
                                                                  "gelu_tanh"), {})),
        ("GELU forward", lambda K: (K.activation_forward, (a7, "gelu"), {})),
        ("GELU backward", lambda K: (K.activation_backward, (a7, K.activation_forward(a7, "gelu")[1], "gelu"), {})),
        ("linear forward (d → 4d)", lambda K: (K.linear_forward, (x, W, np.zeros(4 * d, f32)), {})),
        ("linear backward (d → 4d)", lambda K: (K.linear_backward, (a7, x, W),
                                                dict(dweight=np.empty_like(W), dbias=np.empty(4 * d, f32)))),
        ("attention forward", lambda K: (K.multi_head_attention_forward, (qkv, H, dh, dh), dict(causal=True))),
        ("attention backward", lambda K: (K.multi_head_attention_backward,
                                          (x, K.multi_head_attention_forward(qkv, H, dh, dh, causal=True)[1]), {})),
        ("cross-entropy forward", lambda K: (K.cross_entropy_forward, (logits, targets), {})),
        ("cross-entropy backward", lambda K: (K.cross_entropy_backward, (K.cross_entropy_forward(logits, targets)[1],),
                                              {})),
        ("embedding forward", lambda K: (K.embedding_forward, (tokens, tok, pos), {})),
        ("skip add", lambda K: (K.add, (x, x), {})),
    ]
    return out


def decode_cases(c: dict, rng: np.random.Generator):
    """One generated token (B = 1, T = 1) against a 256-token KV cache."""
    from pedestrian.layers import KVBlock

    d, H = c["d"], c["H"]
    dh = d // H
    f32 = np.float32
    x = rng.standard_normal((1, 1, d)).astype(f32)
    w, b = np.ones(d, f32), np.zeros(d, f32)
    W = (0.02 * rng.standard_normal((d, 4 * d))).astype(f32)
    qkv = rng.standard_normal((1, 1, 3 * d)).astype(f32)
    keys = rng.standard_normal((1, H, 512, dh)).astype(f32)
    values = rng.standard_normal((1, H, 512, dh)).astype(f32)
    a7 = rng.standard_normal((1, 1, 4 * d)).astype(f32)
    return [
        ("token: layer norm", lambda K: (K.layernorm_forward, (x, w, b, 1e-5), {})),
        ("token: linear (d → 4d)", lambda K: (K.linear_forward, (x, W, np.zeros(4 * d, f32)), {})),
        ("token: GELU-tanh", lambda K: (K.activation_forward, (a7, "gelu_tanh"), {})),
        ("token: attention, 256 cached", lambda K: (K.multi_head_attention_forward, (qkv, H, dh, dh),
                                                    dict(causal=True, kv_cache=KVBlock(keys, values, 256)))),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="all", choices=["all", *CONFIGS])
    ap.add_argument("--repeats", type=int, default=100)
    args = ap.parse_args(argv)
    import pedestrian.kernels as fast
    import pedestrian.layers as reference
    from pedestrian.kernels.workspace import Workspace

    names = list(CONFIGS) if args.config == "all" else [args.config]
    lines = ["| config | layer function | reference µs | fast µs | fast / reference |", "|---|---|---|---|---|"]
    for name in names:
        c = CONFIGS[name]
        rng = np.random.default_rng(0)
        for label, build in cases(c, rng) + decode_cases(c, rng):
            row = []
            for K in (reference, fast):
                fn, a, kw = build(K)
                ws = Workspace()                 # as inside a model step: the fast kernels' pool

                def call():
                    with ws:
                        fn(*a, **kw)
                row.append(median_us(call, args.repeats))
            lines.append(f"| {name} | {label} | {row[0]:.0f} | {row[1]:.0f} | {row[1] / row[0]:.2f} |")
            print(lines[-1], file=sys.stderr)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
