"""A square layer whose backward divides by zero where x is 0: 1 NaN in the input delta."""

import numpy as np


def example():
    return {"x": np.array([0.0, 1.0, 2.0])}, {}


def forward(inputs, params):
    return inputs["x"] ** 2, inputs["x"]


def backward(delta, x):
    with np.errstate(invalid="ignore", divide="ignore"):
        return {"x": delta * 2 * x * (x / x)}, {}
