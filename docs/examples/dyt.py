"""Dynamic tanh, a layer pedestrian does not have: ``y = w ∘ tanh(α x) + b`` (Zhu et al. 2025,
"Transformers without normalization"), written to the contract of ``pedestrian check`` and of the
GPT's slots (``init`` too: it can replace the model's norms).

    pedestrian check docs/examples/dyt.py
    pedestrian train --layer norm=docs/examples/dyt.py

Derivation, in the paper's notation (``Δ = ∂L/∂y``, same shape as ``x``; ``t = tanh(α x)``):

    ∂L/∂b = Σ_tokens Δ                          (the bias is added to every token)
    ∂L/∂w = Σ_tokens Δ ∘ t
    ∂L/∂x = Δ ∘ w ∘ (1 − t²) α                  (tanh' = 1 − tanh²)
    ∂L/∂α = Σ_all Δ ∘ w ∘ (1 − t²) ∘ x          (α is one number: sum over every entry)
"""

import numpy as np

SLOT = "norm"


def init(d_model, d_mlp):
    """One instance's parameters: ``w = 1``, ``b = 0`` (d_model,) and ``α = 0.5`` (the paper's α₀)."""
    return {"w": np.ones(d_model), "b": np.zeros(d_model), "alpha": np.array(0.5)}


def example():
    """``(inputs, params)``: a batch ``x`` (B, T, d) = (2, 3, 4) and the layer's w, b (d,), α ()."""
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal((2, 3, 4))}
    params = {"w": 1 + 0.1 * rng.standard_normal(4), "b": 0.1 * rng.standard_normal(4), "alpha": np.array(0.5)}
    return inputs, params


def forward(inputs, params):
    x, alpha = inputs["x"], params["alpha"]
    t = np.tanh(alpha * x)                                      # (B, T, d)
    y = params["w"] * t + params["b"]                          # (B, T, d)
    return y, (x, t, params["w"], alpha)


def backward(delta, cache):
    x, t, w, alpha = cache
    d = x.shape[-1]
    g = delta * w * (1 - t * t)                                 # Δ ∘ w ∘ tanh'(αx), (B, T, d)
    param_grads = {
        "w": np.sum((delta * t).reshape(-1, d), axis=0),       # (d,)
        "b": np.sum(delta.reshape(-1, d), axis=0),             # (d,)
        "alpha": np.sum(g * x),                                 # ()
    }
    return {"x": g * alpha}, param_grads
