"""The seam between the paper's reference layers (`pedestrian.layers`) and the fast kernels
(`pedestrian.kernels`), checked on the code itself:

- every function a model calls (``layers.MODEL_FUNCTIONS``) exists in both with the identical
  signature, so ``GPT(kernels=...)`` can swap them;
- the reference layers stay the paper's math: no ``out=`` argument, no torch branch
  (``is_torch_array``), no ``import torch``, and nothing from the fast path (read from the source);
- the switch itself: ``kernels_for``, ``PEDESTRIAN_KERNELS``, ``GPT(kernels=...)``.

Whether the two compute the same numbers is tested in tests/paper/ (every section file runs
both; tests/paper/test_model.py compares them on the whole gradient grid).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest

import pedestrian.kernels as fast
import pedestrian.layers as reference
from pedestrian.generation.sampling import Sampling
from pedestrian.config import GPTConfig
from pedestrian.kernels import KERNELS, kernels_for
from pedestrian.model import GPT

LAYERS_DIR = Path(reference.__file__).parent


@pytest.mark.parametrize("name", reference.MODEL_FUNCTIONS)
def test_every_model_function_has_a_fast_version_with_the_same_signature(name):
    ref, kern = getattr(reference, name), getattr(fast, name)
    assert callable(ref) and callable(kern)
    assert inspect.signature(kern) == inspect.signature(ref), (name, inspect.signature(kern), inspect.signature(ref))
    assert name in fast.__all__ and name in reference.__all__


def test_model_functions_are_the_ones_the_model_calls():
    """``MODEL_FUNCTIONS`` is complete: every ``K.<name>`` / ``self.kernels.<name>`` the model
    calls is listed (so the signature test above covers the whole seam)."""
    import pedestrian.model.gpt as model_module

    tree = ast.parse(Path(model_module.__file__).read_text(encoding="utf-8"))
    called = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            v = node.value
            if (isinstance(v, ast.Name) and v.id == "K") or \
                    (isinstance(v, ast.Attribute) and v.attr == "kernels"):
                if node.attr != "name":                 # the table's own name
                    called.add(node.attr)
    assert called, "the model calls no kernel function? the scan is broken"
    assert called <= set(reference.MODEL_FUNCTIONS), called - set(reference.MODEL_FUNCTIONS)


def _reference_sources():
    files = sorted(LAYERS_DIR.glob("*.py"))
    assert len(files) >= 8, files
    return [(f.name, f.read_text(encoding="utf-8")) for f in files]


@pytest.mark.parametrize("filename,source", _reference_sources(), ids=[f for f, _ in _reference_sources()])
def test_reference_layers_are_the_math_only(filename, source):
    tree = ast.parse(source, filename=filename)
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            problems += [f"line {node.lineno}: out= argument" for kw in node.keywords if kw.arg == "out"]
        if isinstance(node, ast.Name) and node.id == "is_torch_array":
            problems.append(f"line {node.lineno}: is_torch_array (a backend branch)")
        if isinstance(node, ast.Attribute) and node.attr == "is_torch_array":
            problems.append(f"line {node.lineno}: is_torch_array (a backend branch)")
        if isinstance(node, ast.Import):
            problems += [f"line {node.lineno}: import {a.name}" for a in node.names
                         if a.name.split(".")[0] == "torch"]
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[0] == "torch":
                problems.append(f"line {node.lineno}: from {module} import ...")
            fast_path = module.startswith("pedestrian.kernels") or (node.level > 0 and (
                module.split(".")[0] == "kernels" or (not module and any(a.name == "kernels" for a in node.names))))
            if fast_path:
                problems.append(f"line {node.lineno}: the reference imports the fast path")
            problems += [f"line {node.lineno}: imports is_torch_array" for a in node.names
                         if a.name == "is_torch_array"]
    assert not problems, f"layers/{filename}: " + "; ".join(problems)


def test_the_purity_check_can_fail():
    """The scan above finds what it looks for (a check that cannot fail proves nothing)."""
    bad = ("import torch\nfrom ..backend import is_torch_array\nfrom .. import kernels\n\n"
           "def f(x, y):\n    np.add(x, y, out=x)\n")
    with pytest.raises(AssertionError) as err:
        test_reference_layers_are_the_math_only("bad.py", bad)
    for what in ("import torch", "imports is_torch_array", "fast path", "out= argument"):
        assert what in str(err.value), what


def _functions(table) -> dict:
    return {k: v for k, v in vars(table).items() if k != "name"}


def _kernel(function):
    """What a table holds for a function of the package: the NumPy kernel behind the wrapper that
    takes torch tensors in direct calls."""
    return getattr(function, "__wrapped__", function)


def test_the_switch(monkeypatch):
    """``kernels_for`` gives a table of every model function and its name; ``GPT`` keeps the one
    it chose when it was built (``model.kernels``, named by ``model.kernels_name``)."""
    assert KERNELS == ("fast", "reference")
    for name, module in (("fast", fast), ("reference", reference)):
        table = kernels_for(name)
        assert table.name == name
        assert _functions(table) == {f: _kernel(getattr(module, f)) for f in reference.MODEL_FUNCTIONS}
    monkeypatch.setenv("PEDESTRIAN_KERNELS", "reference")
    assert kernels_for().name == "reference" and kernels_for(None).name == "reference"
    monkeypatch.setenv("PEDESTRIAN_KERNELS", "fast")
    assert kernels_for().name == "fast"
    monkeypatch.delenv("PEDESTRIAN_KERNELS")
    assert kernels_for().name == "fast"                     # the default
    cfg = GPTConfig(vocab_size=7, context_length=4, d_model=8, n_heads=2, n_blocks=1)
    for name, module in (("fast", fast), ("reference", reference)):
        model = GPT(cfg, kernels=name)
        assert model.kernels_name == name == model.kernels.name
        assert _functions(model.kernels) == _functions(kernels_for(name))
    with pytest.raises(ValueError, match=r"unknown kernels 'slow'; choose one of \('fast', 'reference'\)"):
        GPT(cfg, kernels="slow")
    monkeypatch.setenv("PEDESTRIAN_KERNELS", "turbo")
    with pytest.raises(ValueError, match="unknown kernels 'turbo'.*PEDESTRIAN_KERNELS"):
        GPT(cfg)


@pytest.mark.parametrize("device,dtype", [("cuda", "float32"), ("cuda:1", None), ("cpu", "float16"),
                                          (None, "bfloat16"), ("meta", "float64")])
def test_a_gpu_or_a_half_dtype_gets_the_reference_and_the_tiled_torch_loop(device, dtype):
    """Off the CPU, or in a dtype the kernels are not compiled for, ``"fast"`` is the reference
    layers with the attention's on-device functions (the tiled kernel's torch loop from
    ``TILED_MIN_T`` tokens on), as a direct call with such tensors runs."""
    from pedestrian.kernels import attention

    table = kernels_for("fast", device, dtype)
    assert table.name == "fast"
    on_device = {"multi_head_attention_forward": attention.on_device_forward,
                 "multi_head_attention_backward": attention.on_device_backward,
                 "attention_weights": attention.on_device_weights}
    assert _functions(table) == {f: on_device.get(f, getattr(reference, f)) for f in reference.MODEL_FUNCTIONS}
    assert _functions(kernels_for("fast", "cpu", "float64")) == _functions(kernels_for("fast"))
    assert _functions(kernels_for("reference", device, dtype)) == _functions(kernels_for("reference"))


def test_the_table_is_read_when_a_model_is_built(monkeypatch):
    """A function replaced in the module before a model is built is the one the model calls
    (tests and the demo's broken-gradient check rely on it)."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    real = fast.layernorm_forward
    monkeypatch.setattr(fast, "layernorm_forward", spy)
    cfg = GPTConfig(vocab_size=7, context_length=4, d_model=8, n_heads=2, n_blocks=1)
    GPT(cfg).forward([[1, 2, 3]])
    assert len(calls) == 2                                   # ln1, ln_final (ln2: with the skip, below)
    real_add = fast.add_layernorm_forward

    def spy_add(*args, **kwargs):
        calls.append(2)
        return real_add(*args, **kwargs)

    monkeypatch.setattr(fast, "add_layernorm_forward", spy_add)
    GPT(cfg).forward([[1, 2, 3]])
    assert calls == [1, 1, 1, 2, 1]                          # ln1, the skip and ln2, ln_final


def test_no_kernels_are_chosen_by_name_comparison():
    """Which kernels a model runs is its table's ``name``: nothing in the package compares
    ``__name__`` of a module to find out (read from the source)."""
    src = Path(fast.__file__).parents[1]
    hits = [f"{p.relative_to(src)}:{n}" for p in sorted(src.rglob("*.py"))
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if "kernels.__name__" in line or "kernels_for(" in line and "__name__" in line]
    assert not hits, hits


def test_functions_without_a_fast_version_are_the_reference_ones():
    """Dropout has no second version (nothing measurable to gain): the fast module re-exports the
    reference functions themselves. LoRA has one since its products must run on numba's threads
    (NumPy's BLAS threads spinning beside them made a LoRA step 1.7x slower on 2 cores)."""
    for name in reference.MODEL_FUNCTIONS:
        if getattr(fast, name).__module__.startswith("pedestrian.layers"):
            assert getattr(fast, name) is getattr(reference, name), name
    assert fast.dropout_forward is reference.dropout_forward
    assert fast.lora_backward is not reference.lora_backward
    assert fast.multi_head_attention_forward is not reference.multi_head_attention_forward


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("rows, f_in, r, f_out, masked", [(1, 7, 2, 5, False), (3, 8, 1, 9, True),
                                                          (700, 33, 8, 96, True), (513, 64, 4, 17, False)])
def test_fast_lora_equals_the_reference(rows, f_in, r, f_out, masked, dtype):
    """The fast adapter's branch, cache and three gradients against the reference's, from a few
    rows (NumPy's own product) to row blocks over the threads. Both sum the same products of at
    most ``max(f_in, rows)`` terms in another order: ``rtol`` = 64 ε of that length's bound
    (Higham's γ_n ≈ n·ε) -- 1e-12 in float64, 1e-4 in float32, relative to the largest entry."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, f_in)).astype(dtype)
    D, U = rng.standard_normal((f_in, r)).astype(dtype), rng.standard_normal((r, f_out)).astype(dtype)
    mask = (rng.random((rows, f_in)) > 0.3).astype(dtype) / dtype_type(dtype)(0.7) if masked else None
    delta = rng.standard_normal((rows, f_out)).astype(dtype)
    tol = 64 * max(f_in, rows, r) * np.finfo(dtype).eps
    base_out = rng.standard_normal((rows, f_out + 5)).astype(dtype)      # the frozen layer's output
    base_in = rng.standard_normal((rows, f_in)).astype(dtype)            # and its Δ Wᵀ
    for into in (False, True):
        got, want = [], []
        for side, out in ((fast, got), (reference, want)):
            wide = base_out.copy()                                       # the adapter's columns 2 … 2+f_out
            y, cache = side.lora_forward(x, D, U, 0.5, mask, add_to=wide[:, 2:2 + f_out] if into else None)
            dD, dU, d_in = np.zeros_like(D), np.zeros_like(U), base_in.copy()
            out += [wide if into else y, dD, dU,
                    side.lora_backward(delta, cache, D, U, 0.5, dD=dD, dU=dU, add_to=d_in if into else None)]
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert np.max(np.abs(a - b)) <= tol * np.max(np.abs(b)), (into, np.max(np.abs(a - b)) / np.max(np.abs(b)))
        if into:                                        # added into the arrays given, the rest untouched
            assert np.array_equal(got[0][:, :2], base_out[:, :2])
            assert np.array_equal(got[0][:, 2 + f_out:], base_out[:, 2 + f_out:])


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("need_input, with_dD, with_dU", [(False, True, True), (True, False, True),
                                                          (True, True, False), (False, False, True)])
def test_fast_lora_backward_into_writes_only_what_is_asked_for(need_input, with_dD, with_dU, dtype):
    """The one-region backward (``add_to`` given) writes the gradients asked for, adds into
    ``add_to`` only when ``need_input``, and equals the reference (tolerance as above)."""
    rng = np.random.default_rng(3)
    x, delta = rng.standard_normal((2, 300, 40)).astype(dtype), rng.standard_normal((2, 300, 24)).astype(dtype)
    D, U = rng.standard_normal((40, 4)).astype(dtype), rng.standard_normal((4, 24)).astype(dtype)
    tol = 64 * 600 * np.finfo(dtype).eps
    results = []
    for side in (fast, reference):
        _, cache = side.lora_forward(x, D, U, 0.5)
        dD = np.full_like(D, 7.0) if with_dD else None
        dU = np.full_like(U, 7.0) if with_dU else None
        d_in = np.ones_like(x)
        back = side.lora_backward(delta, cache, D, U, 0.5, dD=dD, dU=dU, need_input=need_input, add_to=d_in)
        assert (back is d_in) if need_input else (back is None)
        if not need_input:
            assert np.array_equal(d_in, np.ones_like(x))
        results.append([a for a in (dD, dU, d_in) if a is not None])
    for a, b in zip(*results):
        assert np.max(np.abs(a - b)) <= tol * np.max(np.abs(b))


def dtype_type(dtype):
    return np.dtype(dtype).type


def test_a_torch_cpu_model_converts_only_at_its_edge(monkeypatch):
    """A torch-CPU model with the fast kernels calls every kernel with NumPy arrays (views of its
    tensors: no per-call conversion), and hands torch tensors out of forward, activations,
    attention_weights, backward, grads and deltas, and its KV cache; its numbers are the NumPy
    model's, bit for bit (the same kernels on the same values)."""
    import numpy as np
    import torch

    from pedestrian.generation.generate import generate
    from pedestrian.model.kv_cache import KVCache

    seen = []
    for f in reference.MODEL_FUNCTIONS:
        def spy(*args, _real=_kernel(getattr(fast, f)), _name=f, **kwargs):
            seen.append((_name, [type(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]))
            return _real(*args, **kwargs)
        monkeypatch.setattr(fast, f, spy)
    cfg = GPTConfig(vocab_size=11, context_length=8, d_model=8, n_heads=2, n_blocks=2, dropout=0.1)
    ours, numpy_model = GPT(cfg, dtype="float64", backend="torch"), GPT(cfg, dtype="float64")
    assert ours.numpy_chain and not numpy_model.numpy_chain
    x = np.random.default_rng(0).integers(0, 11, (2, 7))
    loss = ours.loss(torch.as_tensor(x[:, :-1]), torch.as_tensor(x[:, 1:]))
    grads = ours.backward(keep_deltas=True)
    assert loss == numpy_model.loss(x[:, :-1], x[:, 1:])
    expected = numpy_model.backward(keep_deltas=True)
    for name, g in grads.items():
        assert isinstance(g, torch.Tensor) and np.array_equal(g.numpy(), expected[name]), name
    for got, want in ((ours.activations(), numpy_model.activations()), (ours.deltas(), numpy_model.deltas())):
        assert got.keys() == want.keys()
        for k in got:
            assert isinstance(got[k], torch.Tensor) and np.array_equal(got[k].numpy(), want[k]), k
    assert all(isinstance(p, torch.Tensor) for p in ours.attention_weights())
    ours.backward(torch.ones(2, 6, 11, dtype=torch.float64))              # a caller's Δ12
    ours.training = numpy_model.training = False
    cache = KVCache(ours, batch_size=1)
    logits = ours.forward(torch.as_tensor(x[:1, :3]), kv_cache=cache)
    assert isinstance(logits, torch.Tensor) and cache.length == 3
    assert np.array_equal(logits.numpy(), numpy_model.forward(x[:1, :3]))
    assert float(cache.keys[0][0, :, :3].abs().sum()) > 0                  # written into the cache's tensors
    greedy = [generate(m, [1, 2, 3], 4, Sampling(temperature=0)) for m in (ours, numpy_model)]
    assert np.array_equal(*greedy)
    called = {name for name, _ in seen}
    assert {"linear_forward", "multi_head_attention_backward", "dropout_forward", "head_loss_forward"} <= called
    assert not [name for name, tensors in seen if tensors], "a kernel got a torch tensor"
