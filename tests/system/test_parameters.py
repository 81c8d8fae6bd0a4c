"""The GPT by composition (issue 32): a model holds one :class:`Parameters` (flat buffers, views,
gradients, layer table) owning a :class:`LoRA`, and hands its parameter names on to it."""

import inspect

import numpy as np
import pytest

from pedestrian import GPTConfig
from pedestrian.model import GPT
from pedestrian.model.adapters import LoRA
from pedestrian.model.params import Parameters

CFG = GPTConfig(vocab_size=13, context_length=6, d_model=8, n_heads=2, n_blocks=2)


def test_the_model_hands_its_parameter_names_on():
    model = GPT(CFG, dtype="float64")
    p = model.parameters
    assert model.params is p.params and model.flat is p.base.flat
    assert inspect.signature(GPT.add_lora) == inspect.signature(Parameters.add_lora)
    assert GPT.load_state_dict.__doc__ == Parameters.load_state_dict.__doc__
    model.freeze_base = True                              # settable, and it is the parameters' flag
    assert p.freeze_base and model.num_params(trainable_only=True) == 0
    with pytest.raises(AttributeError, match="cannot be set"):
        model.lora_rank = 4


def test_the_parameters_own_the_adapters():
    model = GPT(CFG, dtype="float64")
    model.add_lora(["q", "mlp_expand"], rank=2, alpha=0.5)
    lora = model.parameters.lora
    assert isinstance(lora, LoRA) and lora.targets == model.lora_targets
    for name in model.lora_state_dict():                  # the model's LoRA views are the LoRA's buffer
        assert np.shares_memory(model.params[name], lora.weights.flat), name
    model.loss(np.zeros((1, 6), dtype=np.int64), np.ones((1, 6), dtype=np.int64))
    grads = model.backward()
    assert sorted(grads) == sorted(lora.weights.views)
    assert all(np.shares_memory(grads[k], lora.grads.flat) for k in grads)
    model.remove_lora()                                   # no adapters: nothing of the removed ones left
    assert (model.lora_targets, model.lora_ranks, model.lora_rank, model.lora_alpha, model.lora_dropout) == \
        ([], {}, None, 1.0, 0.0)
    assert model.parameters.lora is None and not model.freeze_base
