"""A generated token's fused forward (:mod:`pedestrian.model.decode`) computes what the chain does.

``model.forward(tokens, kv_cache=cache, keep_activations=False)`` of a few tokens on a
Llama-style model runs the fused step; ``keep_activations=True`` runs the chain
(:mod:`pedestrian.model.gpt`). The property test draws the shape space of the decoding step:
``B`` 1-3; steps of 1-8 new tokens after a prompt of 1-9 (``DECODE_MAX_T`` = 8; a 9-token
prompt runs the chain), left-padded rows or not; ``d_model`` 1-3 heads' worth (odd and even
widths, ``d_qk``, ``d_head`` 1-9 set apart from ``d_model / n_heads``); ``n_kv_heads`` every
divisor of ``n_heads`` (1: multi-query); RoPE (all or part of ``d_qk``, Llama 3's scaling or
not) or no positions; Qwen2's q, k, v biases or none; tied or untied logits; float64 and
float32; ``PEDESTRIAN_NUM_THREADS`` = 1 and = 2, each in a subprocess of its own; no window, or a sliding
window of 1-5 keys on every block or on the second only (a ring of ``w`` slots that the steps wrap
around: :func:`pedestrian.kernels.attention.ring_frame`).

What is compared, at every step:

- against the chain, the logits and every block's cached keys and values, bit for bit: the fused
  step makes the same product calls on arrays of the same shapes and runs the chain's own
  compiled loops (:mod:`pedestrian.kernels.decode` calls them), adds included, in the same order;
- against the reference layers (``kernels="reference"``), float64: the logits within ``1e-10``
  of the largest ``|logit|`` (the two evaluate the same formulas in another order: a few
  thousand roundings of ``ε = 2.2e-16`` along the chain here; ``test_fast_path_property.py``'s
  argument); float32 (the same float32 weights): within 4 times the float32 reference's own
  error against the float64 reference, plus ``64·ε32`` of the largest ``|logit|``
  (``test_fast_path_property.py``'s bound).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import pedestrian.model.decode as decode
from pedestrian.generation.sampling import Sampling
from pedestrian.config import GPTConfig
from pedestrian.generation.generate import generate
from pedestrian.model import GPT
from pedestrian.model.kv_cache import KVCache

from thread_runs import run_with_threads

settings.register_profile("decode-ci", max_examples=30, derandomize=True, database=None, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}


def llama(vocab_size=29, **kw) -> GPTConfig:
    base = dict(vocab_size=vocab_size, context_length=40, d_model=24, n_heads=4, n_kv_heads=2, n_blocks=2,
                norm="rmsnorm", mlp="swiglu", position_encoding="rope", bias=False, ln_eps=1e-5)
    return GPTConfig(**(base | kw))


def run_steps(model, prompt, steps, padding=None, keep=False) -> tuple[list, KVCache]:
    """The logits of ``prompt`` (one forward) and of each step's tokens after it, with a KV cache."""
    cache = KVCache(model, prompt.shape[0], key_start=padding)
    out = [model.forward(prompt, kv_cache=cache, keep_activations=keep)]
    out += [model.forward(t, kv_cache=cache, keep_activations=keep) for t in steps]
    return out, cache


@st.composite
def cases(draw) -> dict:
    """One decoding setting (module docstring)."""
    H = draw(st.integers(1, 3))
    return dict(B=draw(st.integers(1, 3)), T0=draw(st.integers(1, 9)), Ts=draw(st.lists(st.integers(1, 8), min_size=1, max_size=3)),
                H=H, H_kv=draw(st.sampled_from([h for h in (1, 2, 3) if H % h == 0])),
                d=draw(st.integers(1, 9)) * H + draw(st.integers(0, 1)), d_qk=draw(st.integers(1, 9)),
                d_head=draw(st.integers(1, 9)), rope=draw(st.sampled_from(["full", "part", "llama3", "none"])),
                qkv_bias=draw(st.booleans()), tied=draw(st.booleans()), padded=draw(st.booleans()),
                window=draw(st.sampled_from([None, 1, 2, 3, 5])), window_all=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)))


def config_of(case) -> GPTConfig:
    rope = case["rope"] if case["d_qk"] >= 2 else "none"            # (RoPE turns pairs)
    rope = "full" if rope == "part" and case["d_qk"] < 4 else rope
    return llama(d_model=case["d"], n_heads=case["H"], n_kv_heads=case["H_kv"], d_qk=case["d_qk"],
                 d_head=case["d_head"], d_mlp=2 * case["d"] + 1, qkv_bias=case["qkv_bias"],
                 tie_weights=case["tied"], position_encoding="none" if rope == "none" else "rope",
                 rope_fraction=0.5 if rope == "part" else 1.0, rope_scaling=LLAMA3 if rope == "llama3" else None,
                 sliding_window=case.get("window"),
                 layer_types=None if case.get("window") is None or case.get("window_all", True) else
                 ("full_attention", "sliding_attention"))


def check_case(case, dtype) -> None:
    config = config_of(case)
    rng = np.random.default_rng(case["seed"])
    B = case["B"]
    prompt = rng.integers(0, config.vocab_size, (B, case["T0"]))
    steps = [rng.integers(0, config.vocab_size, (B, T)) for T in case["Ts"]]
    padding = rng.integers(0, case["T0"], B) if case["padded"] and B > 1 else None
    model = GPT(config, seed=case["seed"], dtype=dtype)
    calls, original = [], decode.forward
    decode.forward = lambda *a: calls.append(1) or original(*a)
    try:
        fused, fused_cache = run_steps(model, prompt, steps, padding)
    finally:
        decode.forward = original
    assert len(calls) == sum(T <= 8 for T in [case["T0"], *case["Ts"]])   # (schedule.DECODE_MAX_T)
    chain, chain_cache = run_steps(model, prompt, steps, padding, keep=True)
    for a, b in zip(fused, chain):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(fused_cache.keys + fused_cache.values, chain_cache.keys + chain_cache.values):
        np.testing.assert_array_equal(a, b)
    state = model.state_dict()
    ref64 = GPT(config, dtype="float64", kernels="reference")
    ref64.load_state_dict({k: v.astype(np.float64) for k, v in state.items()})
    exact = run_steps(ref64, prompt, steps, padding)[0]
    if dtype == "float64":
        for a, e in zip(fused, exact):
            np.testing.assert_allclose(a, e, rtol=0, atol=1e-10 * np.max(np.abs(e)))
        return
    ref32 = GPT(config, dtype="float32", kernels="reference")
    ref32.load_state_dict(state)
    for a, r, e in zip(fused, run_steps(ref32, prompt, steps, padding)[0], exact):
        bound = 4 * np.max(np.abs(r - e)) + 64 * np.finfo(np.float32).eps * np.max(np.abs(e))
        assert np.max(np.abs(a - e)) <= bound


@pytest.mark.skipif(os.environ.get("PEDESTRIAN_DECODE_PROPERTY") != "1",
                    reason="runs in its own subprocess per thread count (test_property_with_threads)")
@settings(settings.get_profile("decode-ci"))
@given(case=cases(), dtype=st.sampled_from(["float64", "float32"]))
@example(case=dict(B=3, T0=9, Ts=[8, 1], H=3, H_kv=1, d=28, d_qk=7, d_head=5, rope="llama3", qkv_bias=True,
                   tied=False, padded=True, seed=1), dtype="float32")
@example(case=dict(B=2, T0=3, Ts=[1, 1, 2], H=2, H_kv=2, d=16, d_qk=8, d_head=8, rope="part", qkv_bias=False,
                   tied=True, padded=False, seed=2), dtype="float64")
@example(case=dict(B=2, T0=3, Ts=[1, 4, 2], H=2, H_kv=1, d=16, d_qk=8, d_head=8, rope="full", qkv_bias=False,
                   tied=True, padded=True, window=3, window_all=False, seed=3), dtype="float64")
def test_property_in_process(case, dtype):
    check_case(case, dtype)


@pytest.mark.parametrize("threads", [1, 2])
def test_property_with_threads(threads):
    """The property test in a fresh interpreter with ``PEDESTRIAN_NUM_THREADS = threads``."""
    run_with_threads(__file__, "test_property_in_process", threads, {"PEDESTRIAN_DECODE_PROPERTY": "1"})


@pytest.fixture
def fused_calls(monkeypatch) -> list:
    """Counts the fused steps run."""
    calls, original = [], decode.forward
    monkeypatch.setattr(decode, "forward", lambda *a: calls.append(a[1].shape) or original(*a))
    return calls


def test_generate_runs_the_fused_step_and_gets_the_chains_tokens(fused_calls):
    model = GPT(llama(), seed=3)
    prompt = np.random.default_rng(0).integers(0, 29, (2, 5))
    out, logits = generate(model, prompt, 6, Sampling(temperature=0.0), return_logits=True)
    assert fused_calls == [(2, 5)] + [(2, 1)] * 5                 # the prompt too: 5 <= DECODE_MAX_T
    with pytest.raises(ValueError, match="keep_activations=False"):
        model.activations()
    fused_calls.clear()
    chain = run_steps(model, prompt, [out[:, t:t + 1] for t in range(5, 10)], keep=True)[0]
    assert not fused_calls
    np.testing.assert_array_equal(logits, np.stack([c[:, -1] for c in chain]).astype(np.float64))


@pytest.mark.parametrize("what", ["layernorm", "standard-mlp", "learned", "lora", "dropout", "long", "spy", "reference"])
def test_the_chain_runs_what_the_fused_step_does_not_cover(what, fused_calls, monkeypatch):
    config = {"layernorm": llama(norm="layernorm"), "standard-mlp": llama(mlp="standard", activation="gelu"),
              "learned": llama(position_encoding="learned"), "dropout": llama(dropout=0.5)}.get(what, llama())
    model = GPT(config, seed=0, kernels="reference" if what == "reference" else "fast")
    if what == "lora":
        model.add_lora(["o_proj"], rank=2)
    if what == "spy":                                               # a kernel replaced in the table
        norm = model.kernels.rmsnorm_forward
        monkeypatch.setattr(model.kernels, "rmsnorm_forward", lambda *a: norm(*a))
    cache = KVCache(model, 1)
    tokens = np.zeros((1, 9 if what == "long" else 2), dtype=np.int64)
    model.training = what == "dropout"
    model.forward(tokens, kv_cache=cache, keep_activations=False)
    assert not fused_calls
