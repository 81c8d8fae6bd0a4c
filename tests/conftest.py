"""Shared fixtures, and the import path of the oracles.

`tests/oracles/torch_reference.py` (the autograd oracle) describes a model by a plain ``cfg`` dict
and a ``name -> np.ndarray`` parameter dict; ``build_model`` turns those into a
:class:`pedestrian.GPT` with identical parameters (LoRA adapters included) and ``token_batch``
makes token / target batches with the features every gradient test should see: repeated token
ids and ignored targets (-100). Both live in `tests/oracles/gradcheck.py`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# the oracles (tests/oracles/: torch_reference, hf_fixtures, gradcheck) and the shared test
# helpers (tests/helpers/: sample_helpers, lora_masks) are imported by their plain names from
# every test folder
sys.path.insert(0, str(Path(__file__).resolve().parent / "oracles"))
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

from pedestrian.kernels import jit as _jit  # noqa: E402

# the compile notice (kernels/jit.py) is printed by a timer a second after the first compiles end:
# in one test process it would land in the captured stderr of whichever test runs then (a CLI
# test expecting one `error:` line, say); here it waits for the process's exit
# (tests/system/test_compile.py checks the notice in processes of their own)
_jit.NOTICE_AFTER_S = 1e6

from gradcheck import build_model as _build_model  # noqa: E402
from gradcheck import max_rel_err as _max_rel_err  # noqa: E402
from gradcheck import token_batch as _token_batch  # noqa: E402


@pytest.fixture
def max_rel_err():
    """The per-tensor relative error used throughout: ``max|a-b| / max(max|b|, floor)``."""
    return _max_rel_err


@pytest.fixture
def build_model():
    """Factory: ``build_model(cfg, params, dtype=..., backend=..., lora=..., lora_alpha=...,
    freeze_base=..., dropout=..., kernels=...)`` -> a :class:`pedestrian.GPT` holding exactly ``params``."""
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


#: where PyTorch is an oracle (autograd, transformers, peft) on tiny tensors: one torch thread. Its
#: intra-op threads only spin there (the 2-thread suite ran these modules 1.5-3x slower), and
#: the oracle's thread count is not what is tested. The torch *backend* of pedestrian
#: (test_backends, test_generate*, test_parallel, test_workspace, ...) keeps the environment's
#: threads, so the suite's 1- and 2-thread runs both cover it.
ONE_TORCH_THREAD = ("paper/", "oracles/", "system/test_interop_hf.py", "system/test_peft.py",
                    "system/test_sampling_hf.py", "cli/test_finetune_cli.py", "cli/test_lora_dropout_cli.py",
                    "system/test_nonfinite_loading.py", "cli/test_demo_head.py", "cli/test_demo_autograd.py")


@pytest.fixture(autouse=True)
def _one_torch_thread_where_torch_is_an_oracle(request):
    """:func:`one_torch_thread` for every test under :data:`ONE_TORCH_THREAD` (when torch is installed)."""
    try:
        where = Path(str(request.node.fspath)).resolve().relative_to(Path(__file__).resolve().parent).as_posix()
    except ValueError:
        where = ""
    if where.startswith(ONE_TORCH_THREAD) and importlib.util.find_spec("torch") is not None:
        request.getfixturevalue("one_torch_thread")
    yield
