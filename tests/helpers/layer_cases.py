"""Every layer a model calls, as small cases for tests over both paths and both array kinds
(tests/system/test_nonfinite_layers.py, tests/system/test_layer_inputs.py).

A case is ``f(K, arr, bad) -> {output name: array}``: it runs the layer's forward and backward from
the kernel module ``K`` (``pedestrian.layers`` or ``pedestrian.kernels``) on fixed random inputs,
with one entry set to ``bad`` (``None``: none); ``arr`` turns a NumPy array into the backend's
(identity, ``torch.from_numpy``, or a cast to a half-precision tensor).
"""

from __future__ import annotations

import math

import numpy as np

import pedestrian.layers as reference
from pedestrian.kernels.attention_tiled import TILED_MIN_T
from pedestrian.layers import KVBlock

BAD = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf}
H, D_QK, D_HEAD = 2, 3, 4
QKV = H * (2 * D_QK + D_HEAD)


def _rng():
    return np.random.default_rng(31)


def _put(a, index, bad):
    a = a.copy()
    if bad is not None:
        a[index] = bad
    return a


# Each case: f(K, arr, bad) -> {output name: array}, running the layer forward and backward with
# one bad entry; ``arr`` turns a NumPy array into the backend's (identity or torch.from_numpy).
def _activation(name, where):
    def run(K, arr, bad):
        rng = _rng()
        x, d = rng.standard_normal((2, 3, 5)), rng.standard_normal((2, 3, 5))
        x, d = (_put(x, (1, 2, 3), bad), d) if where == "x" else (x, _put(d, (0, 1, 1), bad))
        y, cache = K.activation_forward(arr(x), name)
        return {"y": y, "dx": K.activation_backward(arr(d), cache, name)}
    return run


def _layernorm(where):
    def run(K, arr, bad):
        rng = _rng()
        x, w, b, d = (rng.standard_normal(s) for s in ((2, 3, 6), 6, 6, (2, 3, 6)))
        if where == "x":
            x = _put(x, (1, 0, 2), bad)
        elif where == "w":
            w = _put(w, 4, bad)
        else:
            d = _put(d, (0, 2, 1), bad)
        y, cache = K.layernorm_forward(arr(x), arr(w), arr(b), 1e-5)
        dw, db = arr(np.zeros(6)), arr(np.zeros(6))
        dx = K.layernorm_backward(arr(d), cache, dweight=dw, dbias=db)
        return {"y": y, "dx": dx, "dw": dw, "db": db}
    return run


def _linear(where, rows):
    def run(K, arr, bad):
        rng = _rng()
        x, W, b, d = (rng.standard_normal(s) for s in ((2, rows, 5), (5, 4), 4, (2, rows, 4)))
        if where == "x":
            x = _put(x, (1, 0, 2), bad)
        elif where == "w":
            W = _put(W, (3, 1), bad)
        else:
            d = _put(d, (0, 1, 3), bad)
        y, cache = K.linear_forward(arr(x), arr(W), arr(b))
        dW, db = arr(np.zeros((5, 4))), arr(np.zeros(4))
        dx = K.linear_backward(arr(d), cache, arr(W), dweight=dW, dbias=db)
        return {"y": y, "dx": dx, "dW": dW, "db": db}
    return run


def _add(K, arr, bad):
    rng = _rng()
    return {"y": K.add(arr(_put(rng.standard_normal((2, 3, 4)), (1, 1, 1), bad)), arr(rng.standard_normal((2, 3, 4))))}


def _cross_entropy(column):
    def run(K, arr, bad):
        rng = _rng()
        logits = _put(rng.standard_normal((2, 3, 7)), (0, 1, column), bad)  # target of row (0, 1): 2
        targets = np.array([[1, 2, 3], [0, -100, 6]])
        loss, cache = K.cross_entropy_forward(arr(logits), arr(targets))
        return {"loss": loss, "dlogits": K.cross_entropy_backward(cache)}
    return run


def _embedding(where):
    def run(K, arr, bad):
        rng = _rng()
        tokens = np.array([[1, 2, 1], [0, 1, 4]])
        tok, pos, d = rng.standard_normal((5, 4)), rng.standard_normal((6, 4)), rng.standard_normal((2, 3, 4))
        if where == "tok":
            tok = _put(tok, (1, 2), bad)
        elif where == "pos":
            pos = _put(pos, (2, 0), bad)
        else:
            d = _put(d, (1, 2, 3), bad)
        a1, cache = K.embedding_forward(arr(tokens), arr(tok), arr(pos))
        dtok, dpos = arr(np.zeros((5, 4))), arr(np.zeros((6, 4)))
        K.embedding_backward(arr(d), cache, dtok=dtok, dpos=dpos)
        return {"a1": a1, "dtok": dtok, "dpos": dpos}
    return run


def _attention(T, part, causal):
    """``part``: the q, k or v column block (entry at position 3, in the first tile) or the
    backward's ``Δ``."""
    def run(K, arr, bad):
        rng = _rng()
        qkv, d = rng.standard_normal((2, T, QKV)), rng.standard_normal((2, T, H * D_HEAD))
        column = {"q": 1, "k": H * D_QK + 4, "v": 2 * H * D_QK + 5}.get(part)
        qkv = _put(qkv, (1, 3, column), bad) if column is not None else qkv
        d = _put(d, (0, 3, 2), bad) if part == "delta" else d
        out, cache = K.multi_head_attention_forward(arr(qkv), H, D_QK, D_HEAD, causal=causal)
        p = K.attention_weights(cache)
        dqkv, _ = K.multi_head_attention_backward(arr(d), cache)
        return {"out": out, "P": p, "dqkv": dqkv}
    return run


def _kv_step(part, T_new):
    """A KV-cache step of ``T_new`` tokens after 5 cached ones: the bad entry in the new q/k/v
    or in a cached key; the outputs, ``P`` and the cache written."""
    def run(K, arr, bad):
        rng = _rng()
        L0, capacity = 5, 9
        keys, values = rng.standard_normal((2, H, capacity, D_QK)), rng.standard_normal((2, H, capacity, D_HEAD))
        qkv = rng.standard_normal((2, T_new, QKV))
        if part == "cached":
            keys = _put(keys, (0, 1, 2, 1), bad)
        else:
            qkv = _put(qkv, (1, T_new - 1, {"q": 0, "k": H * D_QK + 1, "v": 2 * H * D_QK + 2}[part]), bad)
        block = KVBlock(arr(keys), arr(values), L0, arr(np.array([0, 2])))
        out, cache = K.multi_head_attention_forward(arr(qkv), H, D_QK, D_HEAD, causal=True, kv_cache=block)
        return {"out": out, "P": K.attention_weights(cache), "keys": block.keys, "values": block.values}
    return run


def _dropout(K, arr, bad):
    rng = _rng()
    x = _put(rng.standard_normal((2, 3, 4)), (1, 2, 0), bad)
    y, mask = K.dropout_forward(arr(x), 0.25, np.random.default_rng(0))
    return {"y": y, "dx": K.dropout_backward(arr(_put(rng.standard_normal((2, 3, 4)), (0, 0, 1), bad)), mask)}


def _lora(K, arr, bad):
    rng = _rng()
    x, D, U, d = (rng.standard_normal(s) for s in ((2, 3, 5), (5, 2), (2, 4), (2, 3, 4)))
    D = _put(D, (1, 1), bad)
    y, cache = K.lora_forward(arr(x), arr(D), arr(U), 0.5)
    dD, dU = arr(np.zeros((5, 2))), arr(np.zeros((2, 4)))
    dx = K.lora_backward(arr(d), cache, arr(D), arr(U), 0.5, dD=dD, dU=dU)
    return {"y": y, "dx": dx, "dD": dD, "dU": dU}


def _rope(K, arr, bad):
    rng = _rng()
    qkv = _put(rng.standard_normal((2, 3, QKV)), (0, 1, 4), bad)
    y, cache = K.rope_forward(arr(qkv), H, D_QK)
    return {"y": y, "dx": K.rope_backward(arr(_put(rng.standard_normal((2, 3, QKV)), (1, 2, 0), bad)), cache)}


CASES = {
    **{f"{a}-{w}": _activation(a, w) for a in reference.ACTIVATIONS for w in ("x", "delta")},
    **{f"layernorm-{w}": _layernorm(w) for w in ("x", "w", "delta")},
    **{f"linear-{w}-{n}": _linear(w, rows) for w in ("x", "w", "delta") for n, rows in (("small", 3), ("blas", 500))},
    "add": _add,
    "cross_entropy-target": _cross_entropy(2), "cross_entropy-other": _cross_entropy(4),
    **{f"embedding-{w}": _embedding(w) for w in ("tok", "pos", "delta")},
    **{f"attention-{kind}-{'causal' if c else 'full'}-{p}": _attention(T, p, c)
       for kind, T in (("matrix", 7), ("tiled", TILED_MIN_T["numpy"])) for c in (True, False)
       for p in ("q", "k", "v", "delta")},
    **{f"kv_step-{n}-{p}": _kv_step(p, n) for n in (1, 3) for p in ("q", "k", "v", "cached")},
    "dropout": _dropout, "lora": _lora, "rope": _rope,
}


