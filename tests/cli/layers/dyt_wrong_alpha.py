"""docs/examples/dyt.py with one slip: ∂L/∂α forgets the factor x (the chain rule through α x)."""

import numpy as np


def example():
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((2, 3, 4))}, {"w": 1 + 0.1 * rng.standard_normal(4),
                                                   "b": 0.1 * rng.standard_normal(4), "alpha": np.array(0.5)}


def forward(inputs, params):
    t = np.tanh(params["alpha"] * inputs["x"])
    return params["w"] * t + params["b"], (inputs["x"], t, params["w"], params["alpha"])


def backward(delta, cache):
    x, t, w, alpha = cache
    g = delta * w * (1 - t * t)
    return {"x": g * alpha}, {"w": np.sum((delta * t).reshape(-1, 4), axis=0),
                              "b": np.sum(delta.reshape(-1, 4), axis=0), "alpha": np.sum(g)}   # slip: no ∘ x
