"""Rotary position embeddings (RoPE) and the position-encoding choice (issue 14).

- The RoPE layer alone: its pairing is GPT-NeoX's ``rotate_half`` (checked against Hugging Face's
  ``apply_rotary_pos_emb``), its backward against central finite differences, its backward is the
  inverse rotation, and its scores depend only on the query-key offset.
- The whole model with ``position_encoding="rope"`` (and ``"none"``) against the independent
  PyTorch-autograd model of ``tests/torch_reference.py``, whose RoPE is complex multiplication:
  loss, logits, every activation, every parameter gradient and every error signal Δ1 … Δ12 in
  float64 to a relative 1e-9 (as the learned-position grid of test_gradients_autograd.py), over a
  covering grid of heads, d_qk, causal / non-causal, rotated fraction and T up to the context.
- Config validation, parameter counts, checkpoints and the Hugging Face refusal.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradcheck import model_key_bias_bounds

from pedestrian.checkpoint import load_checkpoint, save_checkpoint
from pedestrian.cli import main as cli_main
from pedestrian.config import GPTConfig, preset
from pedestrian.model.layout import count_params, param_specs
from pedestrian.interop.hf import config_to_hf, export_problems, save_pretrained
from pedestrian.layers import MODEL_FUNCTIONS
from pedestrian.layers.rope import rope_backward, rope_forward
from pedestrian.model import GPT
from torch_reference import default_cfg, delta_names, random_params, reference_forward, reference_loss_and_grads

CTX = default_cfg()["context_length"]  # 8


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-300))


def random_qkv(rng, B, T, n_heads, d_qk, d_head):
    return rng.standard_normal((B, T, n_heads * (2 * d_qk + d_head)))


# =========================================================================== the layer alone
@pytest.mark.parametrize("d_qk,rotated", [(8, 8), (8, 4), (6, 2), (5, 4)])
def test_pairing_is_gpt_neox_rotate_half(d_qk, rotated):
    """Our rotation equals Hugging Face GPT-NeoX's ``apply_rotary_pos_emb`` (``rotate_half``:
    dimension j pairs with j + r/2; partial rotary = the first r dimensions), with the cos/sin
    tables built as GPT-NeoX builds them (``cat(freqs, freqs)``) but in float64."""
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

    rng = np.random.default_rng(d_qk + rotated)
    B, T, H, d_head, base = 2, 7, 3, 4, 500.0
    qkv = random_qkv(rng, B, T, H, d_qk, d_head)
    positions = np.array([0, 1, 2, 5, 9, 40, 1000])
    y, _ = rope_forward(qkv, H, d_qk, positions, base=base, rotated=rotated)

    inv_freq = 1.0 / (base ** (torch.arange(0, rotated, 2, dtype=torch.float64) / rotated))
    freqs = torch.as_tensor(positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[None]                                  # (1, T, r)
    t = torch.as_tensor(qkv)
    q = t[..., :H * d_qk].reshape(B, T, H, d_qk).transpose(1, 2)                    # (B, H, T, d_qk)
    k = t[..., H * d_qk:2 * H * d_qk].reshape(B, T, H, d_qk).transpose(1, 2)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin(), unsqueeze_dim=1)
    expected = torch.cat([q_hf.transpose(1, 2).reshape(B, T, -1), k_hf.transpose(1, 2).reshape(B, T, -1),
                          t[..., 2 * H * d_qk:]], dim=-1).numpy()
    # same products and sums in another order; angles up to 1000 rad carry ~1000·eps of rounding
    assert rel_err(y, expected) <= 1e-12
    np.testing.assert_array_equal(y[..., 2 * H * d_qk:], qkv[..., 2 * H * d_qk:])   # values untouched
    if rotated < d_qk:
        qk = y[..., :2 * H * d_qk].reshape(B, T, 2 * H, d_qk)
        np.testing.assert_array_equal(qk[..., rotated:],
                                      qkv[..., :2 * H * d_qk].reshape(B, T, 2 * H, d_qk)[..., rotated:])


H_STEP = 1e-6


@pytest.mark.parametrize("rotated,batch_positions", [(6, False), (4, True), (2, False)])
def test_rope_backward_matches_finite_differences(rotated, batch_positions):
    """``f = Σ rope(x) ∘ R``: every entry of ``x`` perturbed by ±h. The layer is linear, so the
    central difference has no truncation error; rounding is ~1e-16·|f|/h ≈ 1e-9 relative."""
    rng = np.random.default_rng(rotated)
    B, T, H, d_qk, d_head = 2, 5, 2, 6, 3
    x = random_qkv(rng, B, T, H, d_qk, d_head)
    positions = rng.integers(0, 50, size=(B, T)) if batch_positions else np.arange(3, 3 + T)
    R = rng.standard_normal(x.shape)

    def f():
        return float(np.sum(rope_forward(x, H, d_qk, positions, base=100.0, rotated=rotated)[0] * R))

    _, cache = rope_forward(x, H, d_qk, positions, base=100.0, rotated=rotated)
    analytic = rope_backward(R, cache)
    numeric = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + H_STEP
        up = f()
        x[idx] = old - H_STEP
        down = f()
        x[idx] = old
        numeric[idx] = (up - down) / (2 * H_STEP)
    assert rel_err(analytic, numeric) <= 1e-7


def test_backward_is_the_inverse_rotation_and_norms_are_kept():
    """Rotations are orthogonal: ``backward(forward(x)) = x`` and every head's q and k row keeps
    its norm. A few rounded products and sums per entry: ~4 eps relative, bound 1e-14."""
    rng = np.random.default_rng(0)
    B, T, H, d_qk, d_head = 3, 9, 2, 8, 5
    x = random_qkv(rng, B, T, H, d_qk, d_head)
    y, cache = rope_forward(x, H, d_qk, np.arange(100, 100 + T), base=10_000.0, rotated=6)
    assert rel_err(rope_backward(y, cache), x) <= 1e-14     # ~10 roundings of ε each, any IEEE-754 CPU
    rows = lambda a: np.linalg.norm(a[..., :2 * H * d_qk].reshape(B, T, 2 * H, d_qk), axis=-1)  # noqa: E731
    assert rel_err(rows(y), rows(x)) <= 1e-14               # the same, and a norm of d_qk = 8 terms
    assert rel_err(y, x) > 1e-2                                    # and it did rotate


def test_scores_depend_only_on_the_offset():
    """``(R(mθ) q) · (R(nθ) k)`` is the same for (m, n) and (m + s, n + s): relative position.
    Angles up to ~2·10³ rad are rounded to ~2e3·eps ≈ 5e-13 absolute: bound 1e-11 relative."""
    rng = np.random.default_rng(1)
    H, d_qk = 1, 8
    q, k = rng.standard_normal(d_qk), rng.standard_normal(d_qk)
    qkv = np.concatenate([q, k, np.zeros(1)])[None, None, :]
    qkv = np.concatenate([qkv, qkv], axis=1)                       # token 0 and token 1, same q, k

    def score(m, n):
        y, _ = rope_forward(qkv, H, d_qk, np.array([m, n]), base=10_000.0)
        return float(y[0, 0, :d_qk] @ y[0, 1, d_qk:2 * d_qk])     # query at m, key at n

    for m, n in [(0, 0), (5, 2), (2, 5), (30, 1)]:
        reference = score(m, n)
        for s in (1, 17, 1000):
            assert abs(score(m + s, n + s) - reference) <= 1e-11 * np.linalg.norm(q) * np.linalg.norm(k)
    assert abs(score(5, 2) - score(5, 3)) > 1e-3                   # but it does see the offset


def test_rope_is_a_model_function_with_the_same_signature_in_both_kernel_sets():
    import inspect

    from pedestrian import kernels, layers

    assert {"rope_forward", "rope_backward"} <= set(MODEL_FUNCTIONS)
    for name in ("rope_forward", "rope_backward"):
        assert inspect.signature(getattr(kernels, name)) == inspect.signature(getattr(layers, name))


def test_bad_rotated_counts_are_errors():
    x = np.zeros((1, 2, 2 * (2 * 4 + 4)))
    for r in (0, 3, 6):
        with pytest.raises(ValueError, match="even number"):
            rope_forward(x, 2, 4, rotated=r)


# =========================================================================== the fast kernel
def _fast_and_reference(qkv, H, d_qk, positions, **kw):
    from pedestrian import kernels, layers

    y_fast, c_fast = kernels.rope_forward(qkv, H, d_qk, positions, **kw)
    y_ref, c_ref = layers.rope_forward(qkv, H, d_qk, positions, **kw)
    delta = np.random.default_rng(7).standard_normal(qkv.shape).astype(qkv.dtype)
    return (y_fast, kernels.rope_backward(delta, c_fast)), (y_ref, layers.rope_backward(delta, c_ref))


def _same_rotation(fast, ref, dtype) -> None:
    """The fast kernel does the reference's float operations on the same float64 angles; NumPy's
    cos/sin of a lone position and of a table row may differ by an ulp (another SIMD path), which
    moves an output by ~2 ulps of its inputs: bound 4 eps of the largest entry (tighter than 1e-13
    in float64 because nothing else differs)."""
    for a, b in zip(fast, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.max(np.abs(a - b)) <= 4 * np.finfo(dtype).eps * np.max(np.abs(b))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("positions", ["none", "offset", "padded", "far", "negative"])
@pytest.mark.parametrize("d_qk,rotated,n_kv,scaled", [(8, 8, 2, False), (6, 4, 1, True), (5, 2, 4, False)])
def test_fast_rope_equals_the_reference(dtype, positions, d_qk, rotated, n_kv, scaled):
    """The fast kernel (angles from a table, the turn in place) against the reference layer:
    positions from 0, a decoding offset, left-padded rows, positions past the first table (it
    grows), negative positions (no table row: computed directly); partial rotation, grouped
    key heads, Llama 3's scaling."""
    from pedestrian.config import RopeScaling

    rng = np.random.default_rng(d_qk)
    B, T, H, d_head = 2, 3, 4, 3
    qkv = rng.standard_normal((B, T, (H + n_kv) * d_qk + n_kv * d_head)).astype(dtype)
    pos = {"none": None, "offset": np.arange(40, 40 + T), "padded": np.array([[0, 0, 1], [5, 6, 7]]),
           "far": np.arange(70_000, 70_000 + T), "negative": np.arange(-2, T - 2)}[positions]
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=16) if scaled else None
    fast, ref = _fast_and_reference(qkv, H, d_qk, pos, base=500.0, rotated=rotated, n_kv_heads=n_kv, scaling=scaling)
    _same_rotation(fast, ref, dtype)


def test_fast_rope_refuses_positions_of_another_length():
    from pedestrian import kernels

    with pytest.raises(ValueError, match=r"positions must be \(T,\) or \(B, T\)"):
        kernels.rope_forward(np.zeros((2, 3, 3 * 8)), 1, 8, np.arange(4))


def test_fast_rope_tables_serve_several_threads():
    """Threads decoding at different positions at once (each growing or reading the shared
    tables) get what one thread alone gets."""
    from concurrent.futures import ThreadPoolExecutor

    from pedestrian import kernels
    from pedestrian.kernels import rope

    rng = np.random.default_rng(3)
    qkv = rng.standard_normal((1, 1, 3 * 8 * 2)).astype(np.float32)
    starts = [int(s) for s in rng.integers(0, 100_000, 16)]
    key = (8, 123.0, None, np.dtype(np.float32))

    def run(start):
        return [kernels.rope_forward(qkv, 2, 8, np.array([t]), base=123.0, n_kv_heads=2)[0] for t in
                range(start, start + 50)]

    rope._TABLES.pop(key, None)
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(run, starts))
    rope._TABLES.pop(key, None)
    for start, got in zip(starts, together):
        for a, b in zip(got, run(start)):
            assert np.array_equal(a, b)
    assert not rope._TABLES[key][0].flags.writeable


# =========================================================================== the whole model
# id -> (B, T, cfg overrides, ignored targets): every value of every axis appears at least once:
# heads {1, 3}; d_qk {2, 4, 5, 6, 8}; causal and not; fraction {1, 0.5, 1/3, 0.25}; T {1, 5, C};
# tied / untied; bias / no bias; base 10,000 and a small base (fast-turning pairs); "none".
ROPE_CASES = {
    "rope-B2-Tctx-3heads-causal": (2, CTX, dict(), 2),
    "rope-B3-Tctx-3heads-noncausal": (3, CTX, dict(causal=False), 1),
    "rope-B1-T1-1head-dqk2": (1, 1, dict(n_heads=1, d_qk=2), 0),
    "rope-B3-T5-dqk6-third-base100": (3, 5, dict(d_qk=6, rope_fraction=1 / 3, rope_base=100.0), 2),
    "rope-B2-Tctx-dqk8-half-noncausal-tied": (2, CTX, dict(d_qk=8, rope_fraction=0.5, causal=False,
                                                           tie_weights=True), 1),
    "rope-B2-Tctx-1head-dqk8-quarter-relu": (2, CTX, dict(n_heads=1, d_qk=8, rope_fraction=0.25,
                                                          activation="relu"), 3),
    "rope-B3-Tctx-dqk5-odd-nobias-1blk": (3, CTX, dict(d_qk=5, d_head=3, bias=False, n_blocks=1), 2),
    "rope-B2-T5-dqk4-noncausal-gelu-eps0": (2, 5, dict(d_qk=4, causal=False, activation="gelu",
                                                       ln_eps=0.0), 0),
    "none-B3-Tctx-causal": (3, CTX, dict(), 2),
    "none-B2-Tctx-noncausal-tied": (2, CTX, dict(causal=False, tie_weights=True), 1),
}


def case_cfg(case_id: str, overrides: dict) -> dict:
    return default_cfg(position_encoding=case_id.split("-")[0], **overrides)


@pytest.mark.parametrize("kernels", ["fast", "reference"])
@pytest.mark.parametrize("case_id", list(ROPE_CASES))
def test_float64_gradients_match_autograd(case_id, kernels, build_model, token_batch, max_rel_err):
    B, T, overrides, n_ignored = ROPE_CASES[case_id]
    cfg = case_cfg(case_id, overrides)
    params = random_params(cfg, seed=len(case_id))
    assert ("pos_emb.weight" in params) is False
    tokens, targets = token_batch(cfg, B, T, seed=len(case_id), n_ignored=n_ignored)
    model = build_model(cfg, params, dtype="float64")
    model.kernels = __import__("pedestrian.kernels", fromlist=["kernels_for"]).kernels_for(kernels)
    model.fused_head = False                              # a12, Δ12 kept (the fused head: test_model.py)
    loss = model.loss(tokens, targets)
    grads = model.backward(keep_deltas=True)
    deltas = model.deltas()
    acts = model.activations()

    ref_loss, ref_logits, ref_grads, ref_deltas = reference_loss_and_grads(params, cfg, tokens, targets)
    with torch.no_grad():
        _, ref_acts = reference_forward({k: torch.tensor(v) for k, v in params.items()}, cfg, tokens,
                                        return_activations=True)
    assert abs(loss - ref_loss) <= 1e-9 * max(abs(ref_loss), 1.0)
    assert max_rel_err(acts["a12"], ref_logits) <= 1e-9
    for name, ref in ref_acts.items():
        assert max_rel_err(acts[name], ref.numpy()) <= 1e-9, name
    assert set(grads) == set(params)
    for name, g in grads.items():
        if name.endswith(".attn.k.bias"):
            # RoPE rotates b_k by the key's position, so b_k no longer cancels in the softmax
            # (paper section 3's argument needs the same b_k on every key): a real gradient
            if cfg["position_encoding"] == "rope" and T > 1:
                assert np.max(np.abs(ref_grads[name])) > 1e-6, name
            else:                   # ≡ 0 (section 3): rounding noise, within its bound
                i = int(name.split(".")[1])
                assert np.all(np.abs(np.asarray(g)) <= model_key_bias_bounds(model)[i]), name
                continue
        assert max_rel_err(g, ref_grads[name]) <= 1e-9, name
    for name in delta_names(cfg):
        assert max_rel_err(deltas[name], ref_deltas[name]) <= 1e-9, name
    assert np.max(np.abs(ref_deltas["Δ1"])) > 1e-4                # a real signal was compared


def test_float32_rope_model_matches_float64_autograd(build_model, token_batch, max_rel_err):
    """float32 against the float64 reference to the paper's 1e-5."""
    cfg = default_cfg(position_encoding="rope", d_qk=6, rope_fraction=0.5)
    params = random_params(cfg, seed=3)
    tokens, targets = token_batch(cfg, 3, CTX, seed=3, n_ignored=1)
    model = build_model(cfg, params, dtype="float32")
    loss = model.loss(tokens, targets)
    grads = model.backward(keep_deltas=True)
    ref_loss, _, ref_grads, ref_deltas = reference_loss_and_grads(params, cfg, tokens, targets)
    assert abs(loss - ref_loss) <= 1e-5 * max(abs(ref_loss), 1.0)
    for name, g in grads.items():
        assert max_rel_err(g, ref_grads[name]) <= 1e-5, name
    assert max_rel_err(model.deltas()["Δ1"], ref_deltas["Δ1"]) <= 1e-5


def test_torch_backend_rope_equals_numpy(build_model, token_batch, max_rel_err):
    cfg = default_cfg(position_encoding="rope", rope_fraction=0.5, d_qk=4)
    params = random_params(cfg, seed=5)
    tokens, targets = token_batch(cfg, 2, CTX, seed=5)
    grads = {}
    for backend in ("numpy", "torch"):
        model = build_model(cfg, params, dtype="float64", backend=backend)
        model.loss(tokens, targets)
        grads[backend] = {k: np.asarray(v.numpy() if hasattr(v, "numpy") else v) for k, v in model.backward().items()}
    for name, g in grads["numpy"].items():
        # the same formulas on two array libraries: BLAS summation orders differ, ~1e-15 relative
        assert max_rel_err(grads["torch"][name], g) <= 1e-12, name


# =========================================================================== config and files
def test_config_validation_names_the_problem():
    base = dict(vocab_size=11, context_length=8, d_model=12, n_heads=3, n_blocks=1)
    with pytest.raises(ValueError, match="unknown position_encoding 'alibi'"):
        GPTConfig(**base, position_encoding="alibi")
    with pytest.raises(ValueError, match="rope_fraction must be in"):
        GPTConfig(**base, position_encoding="rope", rope_fraction=0.0)
    with pytest.raises(ValueError, match="rope_fraction must be in"):
        GPTConfig(**base, position_encoding="rope", rope_fraction=1.5)
    with pytest.raises(ValueError, match="rope_base must be > 1"):
        GPTConfig(**base, position_encoding="rope", rope_base=0.5)
    with pytest.raises(ValueError, match="rope_base must be a finite number"):
        GPTConfig(**base, rope_base=math.inf)
    with pytest.raises(ValueError, match="rotates no pair"):
        GPTConfig(**base, position_encoding="rope", rope_fraction=0.25)      # d_qk = 4: r = 0
    assert GPTConfig(**base, position_encoding="rope", rope_fraction=0.5).rope_dims == 2
    assert GPTConfig(**base, position_encoding="rope", d_qk=5).rope_dims == 4     # odd: one passes
    assert GPTConfig(**base, d_qk=10, rope_fraction=0.3).rope_dims == 2          # 0.3·10 = 3.0000000000000004


@pytest.mark.parametrize("encoding", ["rope", "none"])
def test_no_position_table_and_counts_follow(encoding):
    for name in ("gpt2", "char-small"):
        learned, other = preset(name), preset(name, position_encoding=encoding)
        assert "pos_emb.weight" not in {s.name for s in param_specs(other)}
        assert count_params(learned) - count_params(other) == learned.context_length * learned.d_model
    assert count_params(preset("gpt2", position_encoding=encoding)) == 124_439_808 - 1024 * 768
    model = GPT(preset("char-small", position_encoding=encoding))
    assert "pos_emb.weight" not in model.params
    assert model.num_params() == count_params(preset("char-small", position_encoding=encoding))


def test_params_command_prints_the_smaller_table(capsys):
    assert cli_main(["params", "--preset", "gpt2", "--position-encoding", "rope"]) == 0
    out = capsys.readouterr().out
    assert "pos_emb" not in out and "123,653,376" in out
    assert cli_main(["params", "--preset", "gpt2", "--position-encoding", "rope", "--rope-fraction", "0"]) == 2
    assert "rope_fraction must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("encoding", ["learned", "rope", "none"])
def test_checkpoint_records_the_encoding(encoding, tmp_path):
    config = GPTConfig(vocab_size=11, context_length=8, d_model=12, n_heads=3, n_blocks=2,
                       position_encoding=encoding, rope_base=500.0, rope_fraction=0.5)
    model = GPT(config, seed=3, dtype="float64")
    tokens = np.random.default_rng(0).integers(0, 11, size=(2, 8))
    save_checkpoint(tmp_path / "ckpt", model)
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded.config == config
    assert loaded.config.to_dict()["position_encoding"] == encoding
    np.testing.assert_array_equal(loaded.model.forward(tokens), model.forward(tokens))


def test_old_config_dicts_mean_learned_positions():
    data = GPTConfig(vocab_size=11, context_length=8, d_model=12, n_heads=3, n_blocks=1).to_dict()
    for key in ("position_encoding", "rope_base", "rope_fraction"):
        del data[key]                                   # a checkpoint written before issue 14
    assert GPTConfig.from_dict(data).position_encoding == "learned"


@pytest.mark.parametrize("encoding", ["rope", "none"])
def test_hugging_face_export_refuses_other_encodings(encoding, tmp_path, capsys):
    config = GPTConfig(vocab_size=11, context_length=8, d_model=12, n_heads=3, n_blocks=1,
                       position_encoding=encoding)
    assert export_problems(config) == [f"position_encoding={encoding!r} (GPT-2 has learned positions only)"]
    with pytest.raises(ValueError, match="GPT-2 has learned positions only"):
        config_to_hf(config)
    with pytest.raises(ValueError, match="GPT-2 has learned positions only"):
        save_pretrained(GPT(config), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    save_checkpoint(tmp_path / "ckpt", GPT(config))
    assert cli_main(["export-hf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GPT-2 has learned positions only" in err[0]
