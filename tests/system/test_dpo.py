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

from pedestrian import GPT
from pedestrian.model.head import sequence_logprobs, weigh_sequences
from pedestrian.training.dpo import dpo_loss, dpo_step, reference_logprobs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from pedestrian.interop.hf_llama_config import config_from_hf  # noqa: E402
from pedestrian.interop.hf_llama_tensors import llama_state_from_hf  # noqa: E402

BETA = 0.1
TINY = dict(vocab_size=37, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5)
#: pedestrian layer kind -> the Llama module it adapts
MODULES = {"attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj",
           "attn_proj": "self_attn.o_proj", "mlp_gate": "mlp.gate_proj", "mlp_expand": "mlp.up_proj",
           "mlp_contract": "mlp.down_proj"}


def _rms_forward(self, x):
    """``LlamaRMSNorm.forward`` without its float32 casts (the same formula, float64 throughout)."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def hf_llama(tied: bool, seed: int = 0):
    """A random float64 ``LlamaForCausalLM`` (float64 throughout: SDPA attention, the norm's
    formula and the rotary angles formed in float64, as tests/paper/test_llama_model.py does)
    and its pedestrian config."""
    cfg = transformers.LlamaConfig(**TINY, tie_word_embeddings=tied, attn_implementation="sdpa")
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0.0, 0.3)
    config = config_from_hf(cfg.to_dict())
    j = np.arange(config.d_qk // 2, dtype=np.float64)
    inv_freq = torch.as_tensor(config.rope_base ** (-2.0 * j / config.d_qk))

    def rotary_forward(x, position_ids):
        angle = position_ids[..., None].double() * inv_freq
        emb = torch.cat((angle, angle), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    hf.model.rotary_emb.forward = rotary_forward
    for module in hf.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = _rms_forward.__get__(module)
    return hf, config


def pedestrian_llama(hf, config, kernels, *, lora: bool = True, freeze_base: bool = True, seed: int = 3):
    """pedestrian's model with transformers' weights and (``lora``) adapters on every layer kind
    but the head, ``U`` drawn non-zero (a zero ``U`` would hide a wrong ``D`` gradient)."""
    model = GPT(config, dtype="float64", kernels=kernels)
    model.load_state_dict(llama_state_from_hf({k: v.detach().numpy() for k, v in hf.state_dict().items()}, config))
    if lora:
        model.add_lora(["q", "k", "v", "attn_proj", "mlp_gate", "mlp_expand", "mlp_contract"], 2, 0.7, seed=seed,
                       freeze_base=freeze_base)
        rng = np.random.default_rng(seed)
        for name, p in model.params.items():
            if name.endswith("lora_U"):
                p[...] = rng.normal(0.0, 0.3, p.shape)
    return model


def pairs_batch(config, P=2, T=11, seed=1):
    """``2P`` rows (chosen, then rejected): random ids, the first 2-4 targets of a row ignored
    (its prompt) and some rows padded at the end with ignored targets."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, config.vocab_size, size=(2 * P, T))
    targets = rng.integers(0, config.vocab_size, size=(2 * P, T))
    for b in range(2 * P):
        targets[b, :rng.integers(2, 5)] = -100
    targets[1, T - 3:] = -100
    targets[2 * P - 1, T - 1:] = -100
    return tokens, targets


class TorchPolicy:
    """transformers' model with ``α x D U`` added to each adapted linear's output (forward hooks)."""

    def __init__(self, hf, model):
        self.hf, self.leaves, self.hooks = hf, {}, []
        for name in model.lora_targets:
            i, kind = name.split(".", 2)[1], name.split(".", 2)[2]
            module = hf.model.layers[int(i)].get_submodule(MODULES[kind])
            D = torch.tensor(model.params[f"{name}.lora_D"], requires_grad=True)
            U = torch.tensor(model.params[f"{name}.lora_U"], requires_grad=True)
            self.leaves[f"{name}.lora_D"], self.leaves[f"{name}.lora_U"] = D, U
            alpha = model.lora_alphas[name]
            self.hooks.append(module.register_forward_hook(
                lambda mod, args, out, D=D, U=U, alpha=alpha: out + alpha * (args[0] @ D) @ U))

    def remove(self):
        for h in self.hooks:
            h.remove()


def torch_logps(hf, tokens, targets):
    """``ℓ`` per row, autograd-tracked."""
    logits = hf(input_ids=torch.as_tensor(tokens)).logits                      # (2P, T, V)
    y = torch.as_tensor(targets)
    counted = y != -100
    lp = torch.log_softmax(logits, dim=-1).gather(-1, y.clamp(min=0)[..., None])[..., 0]
    return (lp * counted).sum(dim=1)


def torch_dpo(logp, ref, beta=BETA):
    P = logp.shape[0] // 2
    m = beta * ((logp[:P] - ref[:P]) - (logp[P:] - ref[P:]))
    return -torch.nn.functional.logsigmoid(m).mean(), m


def hf_grads(hf, config):
    grads = {k: p.grad.numpy() for k, p in hf.named_parameters()}
    if config.tie_weights:
        grads.pop("lm_head.weight", None)
    return llama_state_from_hf(grads, config)


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
    assert out.loss == pytest.approx(1e4 / 2, rel=1e-15)                     # (0 + 1e4) / 2 pairs
    np.testing.assert_allclose(out.dlogp, [0.0, -BETA / 2, 0.0, BETA / 2], rtol=1e-15, atol=0)
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
    assert float(out.loss) == pytest.approx(np.mean(-np.log(sig)), rel=1e-14)
    np.testing.assert_allclose(out.dlogp, np.concatenate([-0.3 * (1 - sig) / 4, 0.3 * (1 - sig) / 4]), rtol=1e-13)
    np.testing.assert_allclose(out.chosen_rewards - out.rejected_rewards, m, rtol=1e-14)


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
