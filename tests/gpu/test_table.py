"""The GPU table itself (:mod:`pedestrian.gpu`): every kernel it names is a contract function
with the reference's exact signature (names, kinds, defaults, annotations: tuning knobs such as
the attention's tiles live beside it, :data:`pedestrian.gpu.attention.TILES`); the rest of the table is the fallback's; ``import pedestrian``
imports no Triton; a table on CPU tensors needs the interpreter."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from gpu_helpers import DEVICE, table

import pedestrian.gpu as gpu
from pedestrian import layers
from pedestrian.kernels import kernels_for


def test_every_gpu_kernel_is_a_contract_function_with_the_reference_signature():
    t = table("float32")
    fallback = kernels_for("fast", "cuda", "float32")
    assert set(gpu.GPU_KERNELS) <= set(layers.MODEL_FUNCTIONS)
    for name in layers.MODEL_FUNCTIONS:
        f = getattr(t, name)
        if name in gpu.GPU_KERNELS:
            assert f.__module__.startswith("pedestrian.gpu."), name
            assert inspect.signature(f) == inspect.signature(getattr(layers, name)), \
                (name, inspect.signature(f), inspect.signature(getattr(layers, name)))
        else:
            assert f is getattr(fallback, name), name
    assert t.name == "fast"


def test_importing_pedestrian_imports_no_triton():
    code = ("import sys, pedestrian, pedestrian.gpu; from pedestrian import GPT; "
            "from pedestrian.gpu import kernels_for; kernels_for('fast', 'cuda'); "
            "print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"})
    assert out.stdout.strip() == ("True" if DEVICE == "cuda" else "False")


@pytest.mark.skipif(DEVICE == "cuda", reason="a CUDA device builds the table without the interpreter")
def test_a_table_for_cpu_tensors_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        gpu.table(kernels_for("fast", "cuda"), interpret_ok=True)
    with pytest.raises(RuntimeError, match="need a CUDA device"):
        gpu.table(kernels_for("fast", "cuda"))
    assert gpu.kernels_for("fast", "cuda").add_layernorm_forward is layers.add_layernorm_forward   # no device: fallback
