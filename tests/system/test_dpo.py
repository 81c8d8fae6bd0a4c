"""DPO (issue 49 item 3): the loss of pedestrian's hand-derived chain and every gradient -- the
LoRA adapters, and with the base trainable every weight -- against PyTorch autograd of the same
formula on transformers' own ``LlamaForCausalLM`` (float64), on both kernel sets, the head fused
or not; finite differences along random directions; the reference (adapters off) against a
separate base model; the loss's stability at extreme margins; accumulation over micro-batches.

The oracle (the formula of docs/EQUATIONS.md, "DPO", as TRL's ``loss_type="sigmoid"`` writes it)::

    ℓ(a) = Σ_{t: y_t ≠ −100} log_softmax(logits_t)[y_t]       (per row of [chosen; rejected])
    m    = β [(ℓ(c) − ℓ_ref(c)) − (ℓ(r) − ℓ_ref(r))]           L = mean_pairs(−logsigmoid(m))

with the policy = transformers' model plus ``α x D U`` on each adapted linear layer (forward
hooks, the adapters as leaf tensors) and the reference = the same model without the hooks.

Tolerances: float64 chains of a few hundred rounded operations on O(1) values (the model's own
test, tests/paper/test_llama_model.py, finds ~1e-14 on logits); ℓ sums ≤ 16 log-probabilities
and the loss and its gradient are smooth functions of them with derivatives ≤ β: errors stay
~1e-13 relative to the largest gradient entry, so 1e-9 of it is far from any rounding.
"""

from __future__ import annotations

import numpy as np
import pytest

from pedestrian.backend import to_numpy
from pedestrian.model.head import sequence_logprobs, weigh_sequences
from pedestrian.training.dpo import dpo_loss, dpo_step, reference_logprobs

torch = pytest.importorskip("torch")
from dpo_oracles import (BETA, TorchPolicy, hf_grads, hf_llama, pairs_batch, pedestrian_llama,  # noqa: E402
                         torch_dpo, torch_logps)


@pytest.mark.parametrize("kernels", ["reference", "fast"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-head", "logits-kept"])
@pytest.mark.parametrize("tied,freeze_base", [(True, True), (False, False), (True, False)],
                         ids=["tied-lora", "untied-base-trainable", "tied-base-trainable"])
def test_dpo_loss_and_every_gradient_equal_autograd(kernels, fused, tied, freeze_base):
    hf, config = hf_llama(tied)
    model = pedestrian_llama(hf, config, kernels, freeze_base=freeze_base)
    model.fused_head = fused
    tokens, targets = pairs_batch(config)

    ref = reference_logprobs(model, tokens, targets)
    out = dpo_loss(sequence_logprobs(model, tokens, targets), ref, BETA)
    weigh_sequences(model, out.dlogp)
    grads = model.backward()

    with torch.no_grad():
        ref_t = torch_logps(hf, tokens, targets)                               # the base alone
    policy = TorchPolicy(hf, model)
    hf.requires_grad_(not freeze_base)
    loss_t, m_t = torch_dpo(torch_logps(hf, tokens, targets), ref_t)
    loss_t.backward()
    policy.remove()

    np.testing.assert_allclose(ref, ref_t.numpy(), rtol=0, atol=1e-11)
    np.testing.assert_allclose(out.margins, m_t.detach().numpy(), rtol=0, atol=1e-11)
    assert abs(float(out.loss) - loss_t.item()) < 1e-12
    expected = {k: t.grad.numpy() for k, t in policy.leaves.items()}
    if not freeze_base:
        expected.update(hf_grads(hf, config))
    assert set(grads) == set(expected)
    for name, g in grads.items():
        scale = max(1e-3, float(np.max(np.abs(expected[name]))))
        np.testing.assert_allclose(g, expected[name], rtol=0, atol=1e-9 * scale, err_msg=name)
    assert max(float(np.max(np.abs(g))) for g in grads.values()) > 1e-4          # (not all zero)


def test_reference_is_the_base_model_without_adapters():
    """Adapters off = a separate model holding the base weights only: the same bits (the same
    calls without the adapters' additions); and the adapters do change the policy's ℓ."""
    hf, config = hf_llama(tied=True)
    model = pedestrian_llama(hf, config, "fast")
    base = pedestrian_llama(hf, config, "fast", lora=False)
    tokens, targets = pairs_batch(config)
    ref = reference_logprobs(model, tokens, targets)
    np.testing.assert_array_equal(ref, sequence_logprobs(base, tokens, targets, keep_activations=False))
    np.testing.assert_array_equal(ref, reference_logprobs(model, tokens, targets, reference=base))
    assert np.max(np.abs(sequence_logprobs(model, tokens, targets) - ref)) > 1e-3
    assert not model.parameters.adapters_off                                   # switched back on


def test_a_forward_without_adapters_has_no_backward():
    hf, config = hf_llama(tied=True)
    model = pedestrian_llama(hf, config, "reference")
    tokens, targets = pairs_batch(config)
    with model.without_adapters():
        model.loss(tokens, targets)
    with pytest.raises(ValueError, match="without the LoRA adapters"):
        model.backward()
    sequence_logprobs(model, tokens, targets)
    with pytest.raises(ValueError, match="weigh_sequences"):
        model.backward()
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        weigh_sequences(model, np.ones(3))


@pytest.mark.parametrize("freeze_base", [True, False])
def test_finite_differences_along_random_directions(freeze_base):
    """``(L(θ + εv) − L(θ − εv)) / 2ε`` against ``⟨∇L, v⟩`` for random unit directions ``v``
    of the whole trainable buffer, the reference held fixed (it is frozen: no gradient flows
    into it). Central differences: error ~ ε² L''' + ε_mach L / ε ~ 1e-10 + 1e-11 at ε = 1e-5."""
    hf, config = hf_llama(tied=False)
    model = pedestrian_llama(hf, config, "fast", freeze_base=freeze_base)
    tokens, targets = pairs_batch(config, seed=4)
    ref = reference_logprobs(model, tokens, targets)
    out = dpo_loss(sequence_logprobs(model, tokens, targets), ref, BETA)
    weigh_sequences(model, out.dlogp)
    model.backward()
    buffers = model.trainable_buffers()
    grad = np.concatenate([np.array(b.grads) for b in buffers])
    rng = np.random.default_rng(0)

    def loss_at(step):
        at = 0
        for b in buffers:
            n = b.params.shape[0]
            b.params[...] += step[at:at + n]
            at += n
        value = float(dpo_loss(sequence_logprobs(model, tokens, targets, keep_activations=False), ref, BETA).loss)
        at = 0
        for b in buffers:
            n = b.params.shape[0]
            b.params[...] -= step[at:at + n]
            at += n
        return value

    eps = 1e-5
    for _ in range(3):
        v = rng.normal(size=grad.shape)
        v /= np.linalg.norm(v)
        fd = (loss_at(eps * v) - loss_at(-eps * v)) / (2 * eps)
        assert abs(fd - grad @ v) < 1e-8 * max(1.0, np.linalg.norm(grad)), (fd, grad @ v)


def test_loss_is_stable_at_extreme_margins():
    """``−log σ(m)`` and ``σ(−m)`` through ``logaddexp``: finite at ``|m| = 1e4`` where the naive
    ``log(1 / (1 + e^{−m}))`` overflows; the limits are ``−m`` (loss, gradient ``−β/n``) and 0."""
    logp = np.array([1e5, 0.0, 0.0, 1e5])             # [c0, c1, r0, r1]: pair 0 m = β·1e5 = 1e4, pair 1 −1e4
    ref = np.zeros(4)
    out = dpo_loss(logp, ref, BETA)
    np.testing.assert_array_equal(out.margins, [1e4, -1e4])
    # at |m| = 1e4, logaddexp(0, ∓m) is exactly 0 or |m| in float64 (e^−1e4 underflows), so σ(−m)
    # is exactly 0 or 1 and ∓β σ / 2 pairs is one exact halving: a few roundings at most
    assert out.loss == pytest.approx(1e4 / 2, rel=1e-13)                     # (0 + 1e4) / 2 pairs
    np.testing.assert_allclose(out.dlogp, [0.0, -BETA / 2, 0.0, BETA / 2], rtol=1e-13, atol=0)
    with pytest.raises(ValueError, match="beta must be positive"):
        dpo_loss(logp, ref, 0.0)
    with pytest.raises(ValueError, match=r"\(2P,\)"):
        dpo_loss(logp[:3], ref[:3], BETA)


def test_the_loss_against_its_definition():
    """``dpo_loss`` against the formula written directly (``−log σ(m)`` with NumPy, moderate
    margins, float64): the same to rounding; the gradient is ``∓β σ(−m) / n``."""
    rng = np.random.default_rng(5)
    logp, ref = rng.normal(-20, 5, 8), rng.normal(-20, 5, 8)
    out = dpo_loss(logp, ref, 0.3)
    m = 0.3 * ((logp[:4] - ref[:4]) - (logp[4:] - ref[4:]))
    sig = 1 / (1 + np.exp(-m))
    # logaddexp against 1/(1+e^−m), |m| of a few units: each a handful of float64 roundings of
    # quantities ~1, well-conditioned (d log σ / dm ≤ 1): ~1e-15 relative; 1e-13 holds on any CPU
    assert float(out.loss) == pytest.approx(np.mean(-np.log(sig)), rel=1e-13)
    np.testing.assert_allclose(out.dlogp, np.concatenate([-0.3 * (1 - sig) / 4, 0.3 * (1 - sig) / 4]), rtol=1e-13)
    # the margins are differences of log-probabilities ~40 in another order: absolute rounding
    # ~ 0.3 · 40 · 4u ≈ 5e-15 (relative to a margin near 0 it could be anything): 1e-12 absolute
    np.testing.assert_allclose(out.chosen_rewards - out.rejected_rewards, m, rtol=0, atol=1e-12)


def test_micro_batches_add_up_to_one_batch():
    """Two micro-batches of pairs (each divided by the step's pairs) give one batch's loss and
    gradient: dpo_step's accumulation against the pairs run together (SGD-free: lr = 0)."""
    from pedestrian.training.optim import AdamW

    hf, config = hf_llama(tied=True)
    model = pedestrian_llama(hf, config, "fast")
    x, y = pairs_batch(config, P=2)
    first = (np.concatenate([x[:1], x[2:3]]), np.concatenate([y[:1], y[2:3]]))      # pair 0
    second = (np.concatenate([x[1:2], x[3:4]]), np.concatenate([y[1:2], y[3:4]]))   # pair 1
    opt = AdamW(model, lr=0.0)
    loss_one, norm_one, metrics_one = dpo_step(model, opt, [(x, y)], 0.0, beta=BETA)
    g_one = np.concatenate([np.array(b.grads) for b in model.trainable_buffers()])
    loss_two, norm_two, metrics_two = dpo_step(model, opt, [first, second], 0.0, beta=BETA)
    g_two = np.concatenate([np.array(b.grads) for b in model.trainable_buffers()])
    assert loss_two == pytest.approx(loss_one, rel=1e-13)
    np.testing.assert_allclose(g_two, g_one, rtol=0, atol=1e-13 * np.max(np.abs(g_one)))
    assert metrics_one == pytest.approx(metrics_two, rel=1e-12)
    assert set(metrics_one) == {"margin", "accuracy"}


@pytest.mark.parametrize("kernels", ["reference", "fast"])
def test_torch_tensors_give_the_numpy_models_numbers(kernels):
    """The torch backend (the reference layers on torch tensors: the code path of a GPU; the fast
    kernels on NumPy views at the model's edge) gives the NumPy model's ℓ, loss and gradients,
    tensors in and out."""
    hf, config = hf_llama(tied=True)
    tokens, targets = pairs_batch(config)
    results = []
    for backend in ("numpy", "torch"):
        model = pedestrian_llama(hf, config, kernels, backend=backend)
        x, y = (torch.as_tensor(a) for a in (tokens, targets)) if backend == "torch" else (tokens, targets)
        ref = reference_logprobs(model, x, y)
        logp = sequence_logprobs(model, x, y)
        out = dpo_loss(logp, ref, BETA)
        weigh_sequences(model, out.dlogp)
        grads = model.backward()
        assert isinstance(logp, torch.Tensor) == (backend == "torch")
        results.append((to_numpy(ref), to_numpy(logp), float(out.loss),
                        {k: to_numpy(v).copy() for k, v in grads.items()}))
    (ref_a, lp_a, loss_a, g_a), (ref_b, lp_b, loss_b, g_b) = results
    np.testing.assert_allclose(ref_b, ref_a, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lp_b, lp_a, rtol=0, atol=1e-12)
    assert abs(loss_a - loss_b) < 1e-13
    for k in g_a:
        np.testing.assert_allclose(g_b[k], g_a[k], rtol=0, atol=1e-11 * np.max(np.abs(g_a[k])), err_msg=k)


def test_recompute_gives_the_same_gradients_and_refuses_a_second_backward():
    """``model.recompute`` (``--recompute``): the blocks run again in the backward, the same bits;
    the forward's record is spent by its backward (a second one is refused)."""
    hf, config = hf_llama(tied=False)
    tokens, targets = pairs_batch(config)
    grads = []
    for recompute in (False, True):
        model = pedestrian_llama(hf, config, "fast")
        model.recompute = recompute
        ref = reference_logprobs(model, tokens, targets)                     # (first: a forward replaces
        out = dpo_loss(sequence_logprobs(model, tokens, targets), ref, BETA)  # the last one's record)
        weigh_sequences(model, out.dlogp)
        grads.append({k: v.copy() for k, v in model.backward().items()})
    for k in grads[0]:
        np.testing.assert_array_equal(grads[1][k], grads[0][k], err_msg=k)
    with pytest.raises(ValueError, match="run model.loss"):
        model.backward()
    sequence_logprobs(model, tokens, targets)
    reference_logprobs(model, tokens, targets)
    with pytest.raises(ValueError, match="such as the reference's, replaces it"):
        weigh_sequences(model, np.zeros(4))


def test_a_non_finite_dpo_step_is_skipped():
    """The non-finite rule of every step: a NaN in an adapter makes the loss NaN, and the update
    is skipped (the adapters and AdamW's step count as before)."""
    from pedestrian.training.optim import AdamW

    hf, config = hf_llama(tied=True)
    model = pedestrian_llama(hf, config, "fast")
    opt = AdamW(model, lr=1e-2)
    x, y = pairs_batch(config)
    loss, norm, _ = dpo_step(model, opt, [(x, y)], 1e-2, beta=BETA)
    assert np.isfinite(loss) and np.isfinite(norm) and opt.step_count == 1
    model.params["blocks.0.attn.q.lora_U"][0, 0] = np.nan
    before = {k: v.copy() for k, v in model.params.items() if ".lora_" in k}
    loss, norm, _ = dpo_step(model, opt, [(x, y)], 1e-2, beta=BETA)
    assert np.isnan(loss) and opt.step_count == 1
    for k, v in before.items():
        np.testing.assert_array_equal(model.params[k], v, err_msg=k)
