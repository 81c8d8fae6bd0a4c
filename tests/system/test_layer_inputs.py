"""Bad arguments to the layer functions themselves (issue 31), on the reference and the fast path,
NumPy arrays and torch tensors: ids outside their table are refused with one line naming the
value, its position and the valid range (numba checks no bounds: a target equal to the
vocabulary size read and wrote one past its row, and the reference gave a wrong loss); dtypes the
kernels cannot run are refused by name; half-precision torch tensors run in the reference layers.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import pedestrian.kernels as fast
import pedestrian.layers as reference
from layer_cases import CASES, QKV
from pedestrian.backend import to_numpy
from pedestrian.layers import KVBlock

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PATHS = pytest.mark.parametrize("K", [reference, fast], ids=["reference", "fast"])
BACKENDS = pytest.mark.parametrize("backend", ["numpy", "torch"])


def _arr(backend):
    return torch.from_numpy if backend == "torch" else (lambda a: a)


def _one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


# ------------------------------------------------------------------------------------ ids
@PATHS
@BACKENDS
@pytest.mark.parametrize("target", [7, 8, -1, -101])
def test_cross_entropy_refuses_a_target_outside_the_vocabulary(K, backend, target):
    arr = _arr(backend)
    logits = np.random.default_rng(0).standard_normal((2, 3, 7))
    targets = np.array([[1, 2, 3], [0, -100, 6]])
    targets[1, 2] = target
    with pytest.raises(ValueError) as err:
        K.cross_entropy_forward(arr(logits), arr(targets))
    message = _one_line(err)
    assert f"target {target} at position (1, 2) is outside [0, 7) or the ignore index -100" in message


@PATHS
@BACKENDS
def test_cross_entropy_takes_another_ignore_index(K, backend):
    arr = _arr(backend)
    logits = np.random.default_rng(0).standard_normal((1, 2, 5))
    loss, _ = K.cross_entropy_forward(arr(logits), arr(np.array([[3, -1]])), ignore_index=-1)
    z = logits[0, 0]
    assert float(loss) == pytest.approx(np.log(np.exp(z).sum()) - z[3], rel=1e-12)
    with pytest.raises(ValueError, match=r"target -100 at position \(0, 1\) is outside \[0, 5\) or the ignore index -1"):
        K.cross_entropy_forward(arr(logits), arr(np.array([[3, -100]])), ignore_index=-1)


@PATHS
@BACKENDS
@pytest.mark.parametrize("token", [5, -1, 1000])
def test_embedding_refuses_a_token_outside_the_table(K, backend, token):
    arr = _arr(backend)
    rng = np.random.default_rng(0)
    tok, pos = rng.standard_normal((5, 4)), rng.standard_normal((6, 4))
    tokens = np.array([[1, 2, 1], [0, 1, 4]])
    tokens[1, 1] = token
    with pytest.raises(ValueError) as err:
        K.embedding_forward(arr(tokens), arr(tok), arr(pos))
    assert f"token id {token} at position (1, 1) is outside [0, 5)" in _one_line(err)
    good = np.array([[1, 2, 1], [0, 1, 4]])
    _, cache = K.embedding_forward(arr(good), arr(tok), arr(pos))
    with pytest.raises(ValueError, match=r"token id 4 at position \(1, 2\) is outside \[0, 3\)"):
        K.embedding_backward(arr(rng.standard_normal((2, 3, 4))), cache, dtok=arr(np.zeros((3, 4))))


@PATHS
@BACKENDS
def test_embedding_refuses_a_position_outside_the_table(K, backend):
    arr = _arr(backend)
    rng = np.random.default_rng(0)
    tok, pos = rng.standard_normal((5, 4)), rng.standard_normal((6, 4))
    tokens = np.array([[1, 2, 1], [0, 1, 4]])
    with pytest.raises(ValueError, match=r"position 6 at position \(1, 2\) is outside \[0, 6\)"):
        K.embedding_forward(arr(tokens), arr(tok), arr(pos), arr(np.array([[0, 1, 2], [4, 5, 6]])))
    with pytest.raises(ValueError, match=r"position 2 at position \(2,\) is outside \[0, 2\)"):
        K.embedding_forward(arr(tokens), arr(tok), arr(pos[:2]))


@BACKENDS
def test_a_kv_cache_step_past_the_capacity_is_refused(backend):
    """The fast KV-cache step wrote its keys past the cache's end (numba); the reference's slice
    assignment fails on the shapes."""
    arr = _arr(backend)
    rng = np.random.default_rng(0)
    keys, values = np.zeros((1, 2, 6, 3)), np.zeros((1, 2, 6, 4))
    block = KVBlock(arr(keys), arr(values), 5)
    for K in (reference, fast):
        with pytest.raises(ValueError):
            K.multi_head_attention_forward(arr(rng.standard_normal((1, 2, QKV))), 2, 3, 4, kv_cache=block)


# ---------------------------------------------------------------------------------- dtypes
def _dtype_calls(arr, dtype):
    rng = np.random.default_rng(0)
    x = lambda *s: arr(rng.standard_normal(s).astype(dtype))          # noqa: E731
    w = lambda *s: arr(rng.standard_normal(s))                         # noqa: E731
    return {
        "relu": lambda K: K.activation_forward(x(2, 3), "relu"),
        "gelu": lambda K: K.activation_forward(x(2, 3), "gelu"),
        "layernorm": lambda K: K.layernorm_forward(x(2, 3), w(3), w(3), 1e-5),
        "linear": lambda K: K.linear_forward(x(2, 3), w(3, 2)),
        "attention": lambda K: K.multi_head_attention_forward(x(1, 3, QKV), 2, 3, 4),
        "logits": lambda K: K.cross_entropy_forward(x(1, 2, 5), arr(np.array([[1, 2]]))),
        "token table": lambda K: K.embedding_forward(arr(np.array([[1, 2]])), x(5, 4), w(6, 4)),
    }


@PATHS
@BACKENDS
@pytest.mark.parametrize("dtype", ["int64", "int32", "complex128"])
@pytest.mark.parametrize("call", list(_dtype_calls(lambda a: a, np.float64)))
def test_dtypes_the_kernels_cannot_run_are_refused_by_name(K, backend, dtype, call):
    with pytest.raises(TypeError) as err:
        _dtype_calls(_arr(backend), dtype)[call](K)
    assert re.search(rf"got dtype (torch\.)?{dtype}", _one_line(err)), str(err.value)


# ------------------------------------------------------------------------------ half precision
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("case", [c for c in CASES if c.endswith(("-x", "-x-small", "-x-blas", "-q", "-target", "-tok"))
                                  or c in ("add", "dropout", "lora", "rope")])
def test_half_precision_tensors_run_in_the_reference_layers(case, dtype):
    """Every function of the seam with float16 / bfloat16 CPU tensors (it raised
    ``NotImplementedError: float16`` or an unsupported-ScalarType error): the results are those of
    the float32 reference on the same (rounded) inputs, within ``32 ε_half`` of the output's scale
    (sums of up to 256 terms, each rounding by ``ε/2`` if torch accumulates in half precision;
    measured at most 2.3 ε with torch 2.13 on x86), and keep the tensors' dtype."""
    half = lambda a: torch.from_numpy(a).to(dtype) if a.dtype.kind == "f" else torch.from_numpy(a)        # noqa: E731
    rounded = lambda a: half(a).to(torch.float32) if a.dtype.kind == "f" else torch.from_numpy(a)        # noqa: E731
    got = CASES[case](fast, half, None)
    expect = CASES[case](reference, rounded, None)
    eps = torch.finfo(dtype).eps
    for key, e in expect.items():
        g = got[key]
        assert g.dtype == dtype if hasattr(g, "dtype") and torch.is_tensor(g) else True, (key, g.dtype)
        g, e = np.asarray(to_numpy(g.float() if torch.is_tensor(g) else g), np.float64), np.asarray(to_numpy(e), np.float64)
        scale = max(float(np.max(np.abs(e))), 1e-3)
        assert float(np.max(np.abs(g - e))) <= 32 * eps * scale, (case, key, float(np.max(np.abs(g - e))) / scale / eps)
