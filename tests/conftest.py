"""Shared fixtures: build a `pedestrian` GPT holding the same weights as the torch reference.

`tests/torch_reference.py` (the autograd oracle) describes a model by a plain ``cfg`` dict and a
``name -> np.ndarray`` parameter dict; the fixtures here turn those into a :class:`pedestrian.GPT`
with identical parameters (LoRA adapters included) and make token / target batches with the
features every gradient test should see: repeated token ids and ignored targets (-100).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

# the oracles (tests/oracles/: torch_reference, hf_fixtures, gradcheck) are imported by their
# plain names from every test folder
sys.path.insert(0, str(Path(__file__).resolve().parent / "oracles"))

from pedestrian.config import GPTConfig
from pedestrian.model import GPT

IGNORE_INDEX = -100


def _max_rel_err(a, b, floor: float = 1e-15) -> float:
    """``max|a - b| / max(max|b|, floor)`` -- one number per tensor (``b`` is the reference).

    The tiny ``floor`` only matters when the reference is (all but) zero; then the bound
    asks for ``a`` to be zero as well, to within ``tolerance · floor``.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    if b.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), floor))


def _build_model(cfg: dict, params: dict, *, dtype: str = "float64", backend: str = "numpy",
                 lora: dict | None = None, lora_alpha: float = 1.0, freeze_base: bool = False,
                 dropout: float = 0.0) -> GPT:
    """A GPT from a torch_reference ``cfg`` dict and parameters from ``random_params``.

    ``lora`` is the reference's ``{"targets": [...full FC names...], "rank": r}``.
    """
    model = GPT(GPTConfig(**cfg, dropout=dropout), dtype=dtype, backend=backend)
    if lora is not None:
        model.add_lora(lora["targets"], rank=lora["rank"], alpha=lora_alpha, freeze_base=freeze_base)
    model.load_state_dict(params, strict=True)
    return model


def _token_batch(cfg: dict, B: int, T: int, *, seed: int = 0, n_ignored: int = 0,
                 repeats: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, targets)`` of shape ``(B, T)``, int64.

    ``repeats``: the first row repeats one id at several positions (the embedding backward
    must accumulate them). ``n_ignored`` targets are set to the ignore index -100.
    """
    rng = np.random.default_rng(10_000 + seed)
    V = cfg["vocab_size"]
    tokens = rng.integers(0, V, size=(B, T))
    if repeats and T > 1:
        tokens[0, ::2] = tokens[0, 0]
        tokens[-1, -1] = tokens[0, 0]
    targets = rng.integers(0, V, size=(B, T))
    if n_ignored:
        flat = targets.reshape(-1)
        flat[rng.choice(flat.size, size=min(n_ignored, flat.size), replace=False)] = IGNORE_INDEX
    return tokens.astype(np.int64), targets.astype(np.int64)


@pytest.fixture
def max_rel_err():
    """The per-tensor relative error used throughout: ``max|a-b| / max(max|b|, floor)``."""
    return _max_rel_err


@pytest.fixture
def build_model():
    """Factory: ``build_model(cfg, params, dtype=..., backend=..., lora=..., lora_alpha=...,
    freeze_base=...)`` -> a :class:`pedestrian.GPT` holding exactly ``params``."""
    return _build_model


@pytest.fixture
def token_batch():
    """Factory: ``token_batch(cfg, B, T, seed=..., n_ignored=..., repeats=...)`` -> (tokens, targets)."""
    return _token_batch


@pytest.fixture
def one_torch_thread():
    """Run a test with one torch intra-op thread: its tensors are tiny, and torch's threads only add
    overhead (a lot of it on a busy machine). The previous setting is restored."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
