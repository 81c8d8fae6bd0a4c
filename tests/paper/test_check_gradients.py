"""``pedestrian.check_gradients`` (issue 34): it passes every built-in layer (reference and fast)
wrapped in the public contract, fails each deliberately broken backward on the right tensor and
only there, does not pass a 1e-4 relative error, does not fail correct layers over a range of
shapes, and names each kind of bad input in one line."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pedestrian
from tests.oracles.gradcheck import kernels_param

RNG = np.random.default_rng(34)


def check(layer, **kw):
    forward, backward, inputs, params = layer
    return pedestrian.check_gradients(forward, backward, inputs, params, quiet=True, **kw)


# --------------------------------------------------------------------------- the built-in layers
def linear_layer(K, B=2, T=3, f_in=4, f_out=5, rng=RNG):
    def forward(i, p):
        y, x = K.linear_forward(i["x"], p["weight"], p["bias"])
        return y, (x, p["weight"])

    def backward(delta, cache):
        x, w = cache
        dw, db = np.zeros(w.shape), np.zeros(w.shape[1])
        dx = K.linear_backward(delta, x, w, dweight=dw, dbias=db)
        return {"x": dx}, {"weight": dw, "bias": db}

    return forward, backward, {"x": rng.standard_normal((B, T, f_in))}, \
        {"weight": rng.standard_normal((f_in, f_out)), "bias": rng.standard_normal(f_out)}


def layernorm_layer(K, B=2, T=3, d=5, rng=RNG):
    def forward(i, p):
        return K.layernorm_forward(i["x"], p["weight"], p["bias"], 1e-5)

    def backward(delta, cache):
        d = delta.shape[-1]
        dw, db = np.zeros(d), np.zeros(d)
        dx = K.layernorm_backward(delta, cache, dweight=dw, dbias=db)
        return {"x": dx}, {"weight": dw, "bias": db}

    return forward, backward, {"x": rng.standard_normal((B, T, d))}, \
        {"weight": 1 + 0.1 * rng.standard_normal(d), "bias": rng.standard_normal(d)}


def activation_layer(K, name, shape=(2, 3, 6), rng=RNG):
    x = rng.standard_normal(shape)
    x = np.where(np.abs(x) < 0.1, 0.5, x)           # ReLU's kink stays far from every step
    return (lambda i, p: K.activation_forward(i["x"], name),
            lambda delta, cache: ({"x": K.activation_backward(delta, cache, name)}, {}), {"x": x}, {})


def attention_layer(K, B=2, T=4, n_heads=2, d_qk=3, d_head=2, rng=RNG):
    def forward(i, p):
        return K.multi_head_attention_forward(i["qkv"], n_heads, d_qk, d_head, causal=True)

    def backward(delta, cache):
        return {"qkv": K.multi_head_attention_backward(delta, cache)[0]}, {}

    return forward, backward, {"qkv": rng.standard_normal((B, T, n_heads * (2 * d_qk + d_head)))}, {}


def embedding_layer(K, B=2, T=4, V=5, d=3, rng=RNG):
    tokens = rng.integers(0, V, size=(B, T))
    tokens[0, :2] = 1                                 # a repeated id: its rows must add up

    def forward(i, p):
        return K.embedding_forward(i["tokens"], p["tok"], p["pos"])

    def backward(delta, cache):
        dtok, dpos = np.zeros((V, d)), np.zeros((T + 1, d))
        K.embedding_backward(delta, cache, dtok=dtok, dpos=dpos)
        return {}, {"tok": dtok, "pos": dpos}

    return forward, backward, {"tokens": tokens}, \
        {"tok": rng.standard_normal((V, d)), "pos": rng.standard_normal((T + 1, d))}


def loss_layer(K, B=2, T=3, V=5, rng=RNG):
    targets = rng.integers(0, V, size=(B, T))
    targets[1, 2] = -100                              # one ignored target

    def forward(i, p):
        return K.cross_entropy_forward(i["logits"], i["targets"])

    def backward(delta, cache):
        return {"logits": delta * K.cross_entropy_backward(cache)}, {}

    return forward, backward, {"logits": 2 * rng.standard_normal((B, T, V)), "targets": targets}, {}


def rmsnorm_layer(K, B=2, T=3, d=5, rng=RNG):
    def forward(i, p):
        return K.rmsnorm_forward(i["x"], p["weight"], 1e-5)

    def backward(delta, cache):
        dw = np.zeros(delta.shape[-1])
        return {"x": K.rmsnorm_backward(delta, cache, dweight=dw)}, {"weight": dw}

    return forward, backward, {"x": rng.standard_normal((B, T, d))}, {"weight": 1 + 0.1 * rng.standard_normal(d)}


def swiglu_mlp_layer(K, B=2, T=3, d=4, m=5, rng=RNG):
    names = ("w_gate", "w_up", "w_down")

    def forward(i, p):
        return K.swiglu_mlp_forward(i["x"], *(p[n] for n in names))

    def backward(delta, cache):
        grads = {n: np.zeros(shape) for n, shape in zip(names, ((d, m), (d, m), (m, d)))}
        dx = K.swiglu_mlp_backward(delta, cache, *(params[n] for n in names),
                                   dw_gate=grads["w_gate"], dw_up=grads["w_up"], dw_down=grads["w_down"])
        return {"x": dx}, grads

    params = {n: rng.standard_normal(shape) for n, shape in zip(names, ((d, m), (d, m), (m, d)))}
    return forward, backward, {"x": rng.standard_normal((B, T, d))}, params


def gqa_layer(K, B=2, T=4, n_heads=4, n_kv_heads=2, d_qk=3, d_head=2, rng=RNG):
    def forward(i, p):
        return K.multi_head_attention_forward(i["qkv"], n_heads, d_qk, d_head, causal=True, n_kv_heads=n_kv_heads)

    def backward(delta, cache):
        return {"qkv": K.multi_head_attention_backward(delta, cache)[0]}, {}

    width = n_heads * d_qk + n_kv_heads * (d_qk + d_head)
    return forward, backward, {"qkv": rng.standard_normal((B, T, width))}, {}


def rope_layer(K, B=2, T=4, n_heads=2, n_kv_heads=1, d_qk=4, d_head=3, rng=RNG):
    def forward(i, p):
        return K.rope_forward(i["qkv"], n_heads, d_qk, base=100.0, n_kv_heads=n_kv_heads)

    def backward(delta, cache):
        return {"qkv": K.rope_backward(delta, cache)}, {}

    width = n_heads * d_qk + n_kv_heads * (d_qk + d_head)
    return forward, backward, {"qkv": rng.standard_normal((B, T, width))}, {}


def lora_layer(K, B=2, T=3, f_in=4, r=2, f_out=5, rng=RNG):
    def forward(i, p):
        return K.lora_forward(i["x"], p["D"], p["U"], 0.5)

    def backward(delta, cache):
        dD, dU = np.zeros((f_in, r)), np.zeros((r, f_out))
        dx = K.lora_backward(delta, cache, params["D"], params["U"], 0.5, dD=dD, dU=dU)
        return {"x": dx}, {"D": dD, "U": dU}

    params = {"D": rng.standard_normal((f_in, r)), "U": rng.standard_normal((r, f_out))}
    return forward, backward, {"x": rng.standard_normal((B, T, f_in))}, params


LAYERS = {
    "linear": linear_layer, "layernorm": layernorm_layer, "attention": attention_layer,
    "embedding": embedding_layer, "loss": loss_layer,
    **{f"activation_{n}": (lambda K, n=n: activation_layer(K, n)) for n in ("relu", "gelu", "gelu_tanh", "silu")},
    # the Llama family's layers (issue 33), RoPE and LoRA
    "rmsnorm": rmsnorm_layer, "swiglu_mlp": swiglu_mlp_layer, "gqa_attention": gqa_layer, "rope": rope_layer,
    "lora": lora_layer,
}


@kernels_param()
@pytest.mark.parametrize("name", list(LAYERS))
def test_built_in_layers_pass(K, name):
    layer = LAYERS[name](K)
    report = check(layer)
    assert report.passed, str(report)
    floats = [n for d in layer[2:] for n, a in d.items() if np.asarray(a).dtype.kind == "f"]
    assert sorted(t.name for t in report.tensors) == sorted(floats)
    for t in report.tensors:                          # a check that compared nothing proves nothing
        assert t.max_diff is not None and 0 < t.bound
        assert t.bound < 1e-6 * (1 + np.max(np.abs(check_reference(layer, t))))


def check_reference(layer, t):
    """The tensor's gradient from the layer's own backward (for the scale of the bound)."""
    forward, backward, inputs, params = layer
    out, cache = forward(inputs, params)
    grads = backward(np.ones(np.shape(out)), cache)
    return grads[0 if t.kind == "input" else 1][t.name]


def test_sharper_references_are_used_where_they_apply():
    import pedestrian.kernels as fast
    import pedestrian.layers as ref

    assert {t.method for t in check(linear_layer(ref)).tensors} == {"autograd"}
    # (pedestrian's layers refuse complex data by name: complex step is for a plain NumPy forward)
    x, w = RNG.standard_normal((3, 4)), RNG.standard_normal((4, 2))
    plain = (lambda i, p: (i["x"] @ p["w"], (i["x"], p["w"])),
             lambda d, c: ({"x": d @ c[1].T}, {"w": c[0].T @ d}), {"x": x}, {"w": w})
    assert {t.method for t in check(plain, autograd=False).tensors} == {"complex step"}
    report = check(layernorm_layer(fast))             # numba: neither complex nor torch input
    assert {t.method for t in report.tensors} == {"central"} and report.passed
    assert any("complex step not used" in n for n in report.notes)
    assert any("autograd not used" in n for n in report.notes)


def test_complex_step_is_dropped_where_the_forward_is_not_analytic():
    """``x ∘ conj(x)`` takes complex input but is not analytic: complex step gives 0, central
    differences 2x; the checker drops complex step (a note) and still passes the right backward."""
    x = RNG.standard_normal(5)
    report = pedestrian.check_gradients(lambda i, p: (np.real(i["x"] * np.conj(i["x"])) + 0 * i["x"], i["x"]),
                                        lambda d, x: ({"x": 2 * d * x}, {}), {"x": x}, {}, quiet=True,
                                        autograd=False)
    assert report.passed, str(report)
    assert report.tensors[0].method == "central"
    assert any("complex step disagrees" in n for n in report.notes), report.notes


# --------------------------------------------------------------------------- broken backwards
def linear_broken(how):
    forward, good, inputs, params = linear_layer(pedestrian.layers, f_in=4, f_out=4)

    def backward(delta, cache):
        x, w = cache
        dx, grads = good(delta, cache)[0]["x"], good(delta, cache)[1]
        if how == "sign":
            grads["bias"] = -grads["bias"]
        if how == "transpose":
            dx = delta @ w                            # Δ W instead of Δ Wᵀ (W is square)
        return {"x": dx}, grads

    return forward, backward, inputs, params


def layernorm_wrong_axis():
    forward, _, inputs, params = layernorm_layer(pedestrian.layers)

    def backward(delta, cache):                       # layers/layernorm.py with one axis wrong
        xhat, rstd, weight = cache
        d = delta.shape[-1]
        g = delta * weight
        mean_g = np.mean(g, axis=-2, keepdims=True)   # over tokens instead of features
        mean_gx = np.mean(g * xhat, axis=-1, keepdims=True)
        return {"x": rstd * (g - mean_g - xhat * mean_gx)}, \
            {"weight": np.sum((xhat * delta).reshape(-1, d), axis=0), "bias": np.sum(delta.reshape(-1, d), axis=0)}

    return forward, backward, inputs, params


def attention_without_sqrt_d():
    """One head's q, k, v as inputs; the backward of layers/attention.py without ``/√d_qk``."""
    L = pedestrian.layers
    B, T, d_qk, d_head = 2, 4, 4, 3
    allowed = L.attention_mask(T, T, causal=True, like=np.zeros(1))

    def forward(i, p):
        return L.scaled_dot_product_attention_forward(i["q"], i["k"], i["v"], allowed)

    def backward(delta, c):
        dv = np.swapaxes(c["p"], -1, -2) @ delta
        delta_raw = L.softmax_backward(delta @ np.swapaxes(c["v"], -1, -2), c["p"])   # no / √d_qk
        return {"q": delta_raw @ c["k"], "k": np.swapaxes(delta_raw, -1, -2) @ c["q"], "v": dv}, {}

    inputs = {"q": RNG.standard_normal((B, T, d_qk)), "k": RNG.standard_normal((B, T, d_qk)),
              "v": RNG.standard_normal((B, T, d_head))}
    return forward, backward, inputs, {}


def linear_accumulating():
    forward0, _, inputs, params = linear_layer(pedestrian.layers)

    def forward(i, p):
        y, cache = forward0(i, p)
        return y, cache + (np.zeros(p["weight"].shape),)

    def backward(delta, cache):
        x, w, dw = cache
        dw += np.swapaxes(x.reshape(-1, w.shape[0]), 0, 1) @ delta.reshape(-1, w.shape[1])   # += : a bug
        return {"x": delta @ w.T}, {"weight": dw, "bias": delta.reshape(-1, w.shape[1]).sum(0)}

    return forward, backward, inputs, params


BROKEN = {
    "wrong sign": (lambda: linear_broken("sign"), ["bias"]),
    "missing transpose": (lambda: linear_broken("transpose"), ["x"]),
    "sum over the wrong axis": (layernorm_wrong_axis, ["x"]),
    "dropped 1/sqrt(d)": (attention_without_sqrt_d, ["q", "k"]),
    "accumulation for a write": (linear_accumulating, ["weight"]),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_backward_fails_on_the_right_tensor_only(case):
    make, wrong = BROKEN[case]
    report = check(make())
    assert not report.passed
    assert report.failed == wrong, str(report)
    assert not report.problems, report.problems
    for t in report.tensors:
        assert (t.problem is None) == t.passed, t
    if case == "accumulation for a write":
        assert "accumulation (+=) where a write (=) belongs" in report.tensors[1].problem


@pytest.mark.parametrize("name", ["linear", "layernorm", "attention", "embedding", "loss", "activation_gelu",
                                  "rmsnorm", "swiglu_mlp", "gqa_attention", "rope", "lora"])
def test_a_relative_error_of_1e_4_fails(name):
    """The bound (~1e-9 of the gradient) is far below a 1e-4 relative error in any one tensor."""
    forward, backward, inputs, params = LAYERS[name](pedestrian.layers)
    names = [(0, n) for n, a in inputs.items() if a.dtype.kind == "f"] + [(1, n) for n in params]
    for which, target in names:
        def off(delta, cache, which=which, target=target):
            grads = backward(delta, cache)
            grads[which][target] = grads[which][target] * (1 + 1e-4)
            return grads

        report = check((forward, off, inputs, params), autograd=False, complex_step=False)
        assert report.failed == [target], str(report)


@settings(max_examples=12, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 4), d=st.integers(1, 7), f_out=st.integers(1, 6),
       seed=st.integers(0, 2 ** 16), kind=st.sampled_from(["reference", "fast"]))
def test_correct_layers_pass_over_shapes(B, T, d, f_out, seed, kind):
    K = pedestrian.layers if kind == "reference" else pedestrian.kernels
    rng = np.random.default_rng(seed)
    for layer in (linear_layer(K, B, T, d, f_out, rng), layernorm_layer(K, B, T, max(d, 2), rng),
                  attention_layer(K, B, T, 1 + d % 2, 1 + f_out % 3, 1 + d % 3, rng),
                  rmsnorm_layer(K, B, T, d, rng), swiglu_mlp_layer(K, B, T, d, f_out, rng),
                  gqa_layer(K, B, T, 2 * (1 + d % 2), 1 + f_out % 2, 1 + f_out % 3, 1 + d % 3, rng)):
        report = check(layer, seed=seed, autograd=False)
        assert report.passed, str(report)


# --------------------------------------------------------------------------- bad input, one line each
def test_bad_backwards_are_named_in_one_line():
    forward, good, inputs, params = linear_layer(pedestrian.layers)

    def variant(change):
        def backward(delta, cache):
            d_in, grads = good(delta, cache)
            change(d_in, grads)
            return d_in, grads
        return check((forward, backward, inputs, params))

    r = variant(lambda d, g: g.update(weight=g["weight"].T))
    assert r.failed == ["weight"]
    assert r.tensors[1].problem == "backward returned shape (5, 4), expected (4, 5) -- a missing transpose?"
    r = variant(lambda d, g: g.pop("bias"))
    assert r.failed == ["bias"] and "no param_grads['bias'] (expected an array of shape (5,))" in r.tensors[2].problem
    r = variant(lambda d, g: g.update(gamma=np.ones(3)))
    assert r.failed == [] and not r.passed and len(r.problems) == 1 and "'gamma'" in r.problems[0]
    r = variant(lambda d, g: d["x"].__setitem__((0, 0, 0), np.nan))
    assert r.failed == ["x"] and r.tensors[0].problem == "backward returned 1 NaN, 0 inf of 24 values"
    for report in (r,):
        assert all("\n" not in line for line in report.lines())


def test_random_forward_and_raising_backward_are_named():
    forward, backward, inputs, params = linear_layer(pedestrian.layers)
    rng = np.random.default_rng(1)

    def dropout_on(i, p):
        y, cache = forward(i, p)
        return y * (rng.random(y.shape) > 0.1) / 0.9, cache

    r = check((dropout_on, backward, inputs, params))
    assert not r.passed and "forward is not deterministic" in r.problems[0] and "dropout" in r.problems[0]

    def raising(delta, cache):
        raise KeyError("w")

    r = check((forward, raising, inputs, params))
    assert r.problems == ["backward raised KeyError: 'w'"]
    r = check((lambda i, p: i["x"], backward, inputs, params))
    assert r.problems == ["forward must return (output, cache), got ndarray"]
    with np.errstate(invalid="ignore"):             # √x one step left of x = 1e-12: NaN
        r = check((lambda i, p: (np.sqrt(i["x"]), i["x"]), lambda d, x: ({"x": 0.5 * d / np.sqrt(x)}, {}),
                   {"x": np.array([1e-12, 1.0])}, {}), complex_step=False, autograd=False)
    assert r.failed == ["x"] and r.tensors[0].problem.startswith("the forward is not finite within a step of")


def test_usage_errors_raise():
    forward, backward, inputs, params = linear_layer(pedestrian.layers)
    with pytest.raises(TypeError, match="forward"):
        pedestrian.check_gradients(None, backward, inputs, params)
    with pytest.raises(TypeError, match="inputs must be a dict"):
        pedestrian.check_gradients(forward, backward, [inputs["x"]], params)
    with pytest.raises(ValueError, match="nothing to check"):
        pedestrian.check_gradients(forward, backward, {"tokens": np.arange(3)}, {})
    with pytest.raises(TypeError, match=r"inputs\['x'\] is the tuple \(2, 3, 4\); .* example arrays"):
        pedestrian.check_gradients(forward, backward, {"x": (2, 3, 4)}, params)   # a shape where an array belongs


def test_report_prints_one_line_per_tensor(capsys):
    report = pedestrian.check_gradients(*linear_layer(pedestrian.layers))
    lines = capsys.readouterr().out.splitlines()
    assert lines == report.lines()
    assert [line.split()[0] for line in lines[1:4]] == ["x", "weight", "bias"]
    assert all(line.rstrip().endswith("pass") for line in lines[1:4]) and lines[-1] == "all gradients agree"


def test_step_and_bound_follow_the_derivation():
    """Central differences alone (the layer norm's backward is exact up to rounding): the step lies
    in its clipping range, the derived bound holds the central difference's error and is far
    below the gradient (~1 here) -- so it cannot pass a 1e-4 relative error."""
    forward, backward, inputs, params = layernorm_layer(pedestrian.layers)
    report = check((forward, backward, inputs, params), autograd=False, complex_step=False)
    base = pedestrian.paper.check.BASE_STEP
    assert math.isclose(base, 2.0 ** (-52 / 3))
    for t in report.tensors:
        s = max(1.0, float(np.max(np.abs((inputs | params)[t.name]))))
        assert 0.1 * base * s * (1 - 1e-12) <= t.step <= 10 * base * s * (1 + 1e-12)
        assert t.method == "central" and t.max_diff <= t.bound < 1e-6


def test_a_float32_backward_is_named_when_it_fails():
    # float32 rounds a gradient of size ~10 by ~1e-6, far over the bound (~1e-9 of the gradient):
    # the failure says the dtype, which "differs by 1e-6" alone does not
    forward, good, inputs, params = linear_layer(pedestrian.layers)
    params = {k: 10 * v for k, v in params.items()}

    def backward(delta, cache):
        d_in, grads = good(delta, cache)
        return {"x": d_in["x"].astype(np.float32)}, grads

    r = check((forward, backward, inputs, params))
    assert r.failed == ["x"]
    assert "backward returned float32 where the check runs in float64" in r.tensors[0].problem
    assert "\n" not in r.tensors[0].problem
    assert "float32" not in (check((forward, good, inputs, params)).tensors[0].problem or "")
