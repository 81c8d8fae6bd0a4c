"""A layer module that forgot its backward (a usage error for `pedestrian check`)."""

import numpy as np


def example():
    return {"x": np.ones(3)}, {}


def forward(inputs, params):
    return 2 * inputs["x"], None
