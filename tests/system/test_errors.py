"""Bad input raises ValueError / TypeError whose message names the problem (and the fix), never a
silent clamp, a NaN or a numpy IndexError from deep inside. Plus the documented edge case: a
batch in which every target is the ignore index has loss 0 and zero gradients, not NaN.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pedestrian.config import GPTConfig
from pedestrian.layers import layernorm_forward
from pedestrian.model import GPT

CFG = GPTConfig(vocab_size=11, context_length=8, d_model=12, n_heads=3, n_blocks=1)


@pytest.fixture(params=["numpy", "torch"])
def model(request):
    return GPT(CFG, dtype="float64", backend=request.param)


def ok_tokens(B=2, T=5):
    return np.random.default_rng(0).integers(0, CFG.vocab_size, size=(B, T))


# --------------------------------------------------------------------------- token ids
@pytest.mark.parametrize("bad", [-1, 11, 1000])
def test_token_id_outside_vocabulary(model, bad):
    tokens = ok_tokens()
    tokens[1, 3] = bad
    with pytest.raises(ValueError, match=rf"token ids contain {bad}, outside \[0, vocab_size=11\)"):
        model.forward(tokens)


@pytest.mark.parametrize("bad", [-1, -99, -101, 11])
def test_target_outside_vocabulary_that_is_not_the_ignore_index(model, bad):
    tokens = ok_tokens()
    targets = ok_tokens()
    targets[0, 0] = -100          # allowed
    targets[1, 2] = bad
    with pytest.raises(ValueError, match=rf"target id {bad} is outside \[0, vocab_size=11\) "
                                         r"and is not the ignore index -100"):
        model.loss(tokens, targets)


def test_sequence_longer_than_context_length(model):
    with pytest.raises(ValueError, match=r"T=9 exceeds the model's context_length=8"):
        model.forward(ok_tokens(T=9))
    model.forward(ok_tokens(T=8))  # exactly the context length is fine


@pytest.mark.parametrize("tokens", [np.zeros((2, 5), dtype=np.float64), np.full((2, 5), 1.0, dtype=np.float32),
                                    np.zeros((2, 5), dtype=bool)], ids=["float64", "float32", "bool"])
def test_non_integer_tokens(model, tokens):
    with pytest.raises(TypeError, match=r"token ids must be an integer array, got dtype"):
        model.forward(tokens)


def test_non_integer_torch_tokens_on_the_torch_backend():
    m = GPT(CFG, dtype="float64", backend="torch")
    with pytest.raises(TypeError, match=r"token ids must be an integer array, got dtype torch.float32"):
        m.forward(torch.zeros((2, 5)))


def test_non_integer_targets(model):
    with pytest.raises(TypeError, match=r"targets must be an integer array"):
        model.loss(ok_tokens(), ok_tokens().astype(np.float64))


def test_targets_shape_mismatch(model):
    with pytest.raises(ValueError, match=r"targets shape \(2, 4\) must equal tokens shape \(2, 5\)"):
        model.loss(ok_tokens(), ok_tokens(T=4))


@pytest.mark.parametrize("shape", [(5,), (1, 2, 5)])
def test_tokens_must_be_two_dimensional(model, shape):
    with pytest.raises(ValueError, match=r"token ids must have shape \(B, T\)"):
        model.forward(np.zeros(shape, dtype=np.int64))


# --------------------------------------------------------------------------- config
def test_d_model_not_divisible_by_n_heads():
    with pytest.raises(ValueError, match=r"d_model=10 is not divisible by n_heads=3.*give d_head explicitly"):
        GPTConfig(vocab_size=11, context_length=8, d_model=10, n_heads=3, n_blocks=1)
    # the stated fix works: an explicit d_head
    assert GPTConfig(vocab_size=11, context_length=8, d_model=10, n_heads=3, n_blocks=1, d_head=4).d_head == 4


def test_negative_layer_norm_eps():
    with pytest.raises(ValueError, match=r"ln_eps must be >= 0.*got -1"):
        GPTConfig(vocab_size=11, context_length=8, d_model=12, n_heads=3, n_blocks=1, ln_eps=-1)
    x = np.ones((2, 4))
    with pytest.raises(ValueError, match=r"layer norm eps must be >= 0, got -1"):
        layernorm_forward(x, np.ones(4), np.zeros(4), eps=-1)


def test_nan_eps_is_rejected_by_the_config():
    with pytest.raises(ValueError, match=r"ln_eps must be >= 0"):
        GPTConfig(vocab_size=11, context_length=8, d_model=12, n_heads=3, n_blocks=1, ln_eps=float("nan"))


# --------------------------------------------------------------------------- call order
BACKWARD_FIRST = r"backward\(\) called before a forward with targets"


def test_backward_before_any_forward(model):
    with pytest.raises(ValueError, match=BACKWARD_FIRST):
        model.backward()


def test_backward_after_a_forward_without_targets(model):
    model.forward(ok_tokens())
    with pytest.raises(ValueError, match=BACKWARD_FIRST):
        model.backward()


def test_backward_after_a_later_forward_without_targets(model):
    """A forward without targets replaces the cache: the earlier loss can no longer be backpropagated."""
    model.loss(ok_tokens(), ok_tokens())
    model.backward()                      # fine
    model.forward(ok_tokens())
    with pytest.raises(ValueError, match=BACKWARD_FIRST):
        model.backward()


def test_deltas_before_backward_with_keep_deltas(model):
    model.loss(ok_tokens(), ok_tokens())
    model.backward()
    with pytest.raises(ValueError, match=r"call backward\(keep_deltas=True\)"):
        model.deltas()


# --------------------------------------------------------------------------- every target ignored
@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
def test_all_targets_ignored_gives_zero_loss_and_zero_gradients(model, lora):
    if lora:
        model.add_lora("all", rank=2, alpha=1.0, freeze_base=False)
    tokens = ok_tokens()
    targets = np.full_like(tokens, -100)
    loss = model.loss(tokens, targets)
    assert loss == 0.0
    grads = model.backward(keep_deltas=True)
    assert len(grads) > 0
    for name, g in grads.items():
        g = np.asarray(g.cpu() if isinstance(g, torch.Tensor) else g)
        assert np.all(g == 0.0), name          # exactly zero, in particular not NaN
    for name, d in model.deltas().items():
        d = np.asarray(d.cpu() if isinstance(d, torch.Tensor) else d)
        assert np.all(d == 0.0), name


def test_state_dict_returns_copies_not_views():
    """The docstring promises copies: changing one must not change the model."""
    from pedestrian import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=7, context_length=4, d_model=8, n_heads=2, n_blocks=1))
    state = model.state_dict()
    before = model.params["pos_emb.weight"].copy()
    for v in state.values():
        v[...] = 123.0
    assert (model.params["pos_emb.weight"] == before).all()
