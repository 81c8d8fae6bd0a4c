"""A training step on a device waits for it once: no host synchronisation inside the forwards,
the backwards, the gradient's sums of squares, the clipping and the AdamW update; one read of
one small tensor (loss, sums of squares, the checks' flag) where the step decides and the loop
logs (:func:`pedestrian.training.step.train_step`, module docstring). Bad ids and targets still end
with the one-line error they give at once elsewhere; a NaN is still caught and the step skipped.

How a read is seen without a GPU: every way a torch tensor's value reaches the host --
``item``, ``bool``, ``int``, ``float``, ``index``, ``tolist``, ``numpy``, ``__array__``, and the
operations whose output shape depends on the values (``nonzero``: the host must wait to size
it) -- is wrapped to record where it was called (:func:`host_reads`). On a GPU each of these is
a synchronisation (torch's ``set_sync_debug_mode`` flags them); the CUDA test at the end checks
the same path with that mode set to ``"error"``.

The step runs on the path a GPU runs: torch tensors through the reference layers, the attention
from the device's table (``"cpu-as-gpu"``, as tests/system/test_on_device.py).
"""

from __future__ import annotations

import contextlib
import math
import traceback

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pedestrian import GPT  # noqa: E402
from pedestrian.config import GPTConfig  # noqa: E402
from pedestrian.kernels import kernels_for  # noqa: E402
from pedestrian.layers.checks import check_ids  # noqa: E402
from pedestrian.model.device_checks import deferred_checks  # noqa: E402
from pedestrian.training import TrainingError, train_step  # noqa: E402
from pedestrian.training.optim import AdamW, clip_grad_norm, clip_scale, global_grad_norm, squared_sums  # noqa: E402
from pedestrian.training.step import skip_reason  # noqa: E402

V = 11
LLAMA = dict(norm="rmsnorm", mlp="swiglu", activation="silu", position_encoding="rope", bias=False, n_kv_heads=2)
CONFIGS = {"gpt2": dict(), "llama-gqa": LLAMA}

_READERS = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "numpy", "__array__", "nonzero")


@contextlib.contextmanager
def host_reads():
    """``with host_reads() as reads:`` every read of a torch tensor's values on the host inside
    the block is appended to ``reads`` as ``(how, file:line)`` of the calling line."""
    reads, saved = [], {name: getattr(torch.Tensor, name) for name in _READERS}
    saved_nonzero = torch.nonzero

    def wrap(how, f):
        def read(*args, **kwargs):
            caller = traceback.extract_stack(limit=3)[-2]
            reads.append((how, f"{caller.filename.rsplit('/', 1)[-1]}:{caller.lineno}"))
            return f(*args, **kwargs)
        return read

    for name, f in saved.items():
        setattr(torch.Tensor, name, wrap(name, f))
    torch.nonzero = wrap("torch.nonzero", saved_nonzero)
    try:
        yield reads
    finally:
        for name, f in saved.items():
            setattr(torch.Tensor, name, f)
        torch.nonzero = saved_nonzero


def _model(case: str, dtype: str = "float32", T: int = 8) -> GPT:
    """A model on the path a GPU runs: torch tensors, reference layers, the device's attention."""
    config = GPTConfig(vocab_size=V, context_length=T, d_model=12, n_heads=4, n_blocks=2, d_mlp=20,
                       **CONFIGS[case])
    model = GPT(config, seed=1, dtype=dtype, backend="torch", kernels="reference")
    table = kernels_for("fast", "cuda", dtype)
    model.kernels.multi_head_attention_forward = table.multi_head_attention_forward
    model.kernels.multi_head_attention_backward = table.multi_head_attention_backward
    return model


def _batches(k: int, T: int = 8, tensors: bool = True, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(k):
        x, y = rng.integers(0, V, (2, T)), rng.integers(0, V, (2, T))
        y[i % 2, :3] = -100                                    # ignored targets, a different mix each
        out.append((torch.from_numpy(x), torch.from_numpy(y)) if tensors else (x, y))
    return out


def _state(model, opt):
    return ([g.params.clone() for g in opt.groups] + [m.clone() for m in opt.m] + [v.clone() for v in opt.v],
            opt.step_count)


def _same_state(a, b) -> None:
    assert a[1] == b[1]
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y) or (torch.isnan(x) == torch.isnan(y)).all() and torch.equal(
            torch.nan_to_num(x), torch.nan_to_num(y))


def test_the_counter_sees_a_read():
    """The counter can fail: a loss read at once (``model.loss`` with ``read=True``) is a read --
    exactly one, the loss and every id check's flag together (model/device_checks.read_checked)."""
    model = _model("gpt2")
    x, y = _batches(1)[0]
    with host_reads() as reads:
        model.loss(x, y)
    assert [how for how, _ in reads] == ["tolist"]


@pytest.mark.parametrize("case", list(CONFIGS))
def test_loss_backward_norm_clipping_and_adamw_read_nothing(case):
    """The step's parts, called as train_step calls them on a device: nothing is read."""
    model = _model(case)
    opt = AdamW(model, lr=1e-2, weight_decay=0.1)
    (x, y), = _batches(1)
    n_total = (y != -100).sum()                                # a count left on the device
    with host_reads() as reads, deferred_checks() as flags:
        loss = model.loss(x, y, n_total=n_total, read=False)
        model.backward()
        sums = squared_sums([g.grads for g in opt.groups])
        bad = flags.any()
    assert reads == [], reads
    assert loss.shape == () and all(s.shape == () for s in sums) and bad.shape == ()
    norm = global_grad_norm([g.grads for g in opt.groups], sums=[float(s) for s in sums])
    with host_reads() as reads:
        clip_grad_norm(opt.groups, 0.5, norm=norm)
        opt.step(1e-2, grad_norm=0.5)                          # (the norm after clipping, known)
    assert reads == [], reads


@pytest.mark.parametrize("tensors", [True, False], ids=["tensor-batches", "numpy-batches"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("case", list(CONFIGS))
def test_a_train_step_reads_the_device_once(case, k, tensors):
    """A whole step (k micro-batches, accumulation, clipping, AdamW): one read, the step's
    ``tolist`` of loss, sums of squares and flag; and the numbers are the bits of the same step
    made with reads at once (model.loss read, the norm from ``global_grad_norm``)."""
    model, twin = _model(case), _model(case)
    opt, twin_opt = AdamW(model, lr=1e-2, weight_decay=0.1), AdamW(twin, lr=1e-2, weight_decay=0.1)
    for step in range(2):
        batches = _batches(k, tensors=tensors, seed=step)
        with host_reads() as reads:
            loss, norm = train_step(model, opt, batches, 1e-2, grad_clip=0.5)
        assert [how for how, _ in reads] == ["tolist"] and reads[0][1].startswith("step.py"), reads
        # the twin: the step with every number read at once (as train_step did before)
        n = sum(int((y != -100).sum()) for _, y in batches)
        total, acc = 0.0, None
        for x, y in batches:
            total += twin.loss(x, y, n_total=n)
            twin.backward()
            g = twin_opt.groups[0].grads                   # ((g0 + g1) + …) + g_last: train_step's
            acc = g.clone() if acc is None else acc.add_(g)      # g_last + (g0 + g1 + …), the same bits
        twin_opt.groups[0].grads.copy_(acc)
        want_norm = global_grad_norm([twin_opt.groups[0].grads])
        assert loss == total and norm == want_norm
        clip_grad_norm(twin_opt.groups, 0.5, norm=want_norm)
        twin_opt.step(1e-2, grad_norm=want_norm * min(1.0, 0.5 / (want_norm + 1e-6)))
        assert torch.equal(opt.groups[0].params, twin_opt.groups[0].params)


# --------------------------------------------------------------------------- bad input, on the device path
@pytest.mark.parametrize("tensors", [True, False], ids=["tensor-batches", "numpy-batches"])
@pytest.mark.parametrize("bad", [-1, 11, 1000])
def test_a_bad_token_id_gives_the_one_line_error_and_changes_nothing(bad, tensors):
    """The error of tests/system/test_errors.py (model.forward at once), raised by the step's
    read, in the second of two micro-batches; weights, moments and step count untouched."""
    model = _model("gpt2")
    opt = AdamW(model, lr=1e-2)
    train_step(model, opt, _batches(1), 1e-2)
    batches = _batches(2, tensors=tensors)
    batches[1][0][1, 3] = bad
    before = _state(model, opt)
    with pytest.raises(ValueError) as err:
        train_step(model, opt, batches, 1e-2, grad_clip=1.0)
    assert str(err.value) == (f"token ids contain {bad}, outside [0, vocab_size={V}); "
                              "the tokenizer and the model config do not match")
    _same_state(_state(model, opt), before)


@pytest.mark.parametrize("tensors", [True, False], ids=["tensor-batches", "numpy-batches"])
@pytest.mark.parametrize("bad", [-1, -99, -101, 11])
def test_a_bad_target_gives_the_one_line_error_and_changes_nothing(bad, tensors):
    model = _model("llama-gqa")
    opt = AdamW(model, lr=1e-2)
    batches = _batches(2, tensors=tensors)
    batches[0][1][1, 2] = bad
    before = _state(model, opt)
    with pytest.raises(ValueError) as err:
        train_step(model, opt, batches, 1e-2)
    assert str(err.value) == (f"target id {bad} is outside [0, vocab_size={V}) "
                              "and is not the ignore index -100")
    _same_state(_state(model, opt), before)


def test_the_first_bad_input_is_named_as_before():
    """Two bad micro-batches: the first one's error, as a step that checks at once names it
    (the bad target of micro-batch 0 before the bad token of micro-batch 1)."""
    model = _model("gpt2")
    opt = AdamW(model, lr=1e-2)
    batches = _batches(2)
    batches[0][1][0, 5] = 12
    batches[1][0][0, 0] = -7
    with pytest.raises(ValueError, match=r"^target id 12 is outside"):
        train_step(model, opt, batches, 1e-2)


def test_every_target_ignored_gives_the_training_error():
    model = _model("gpt2")
    opt = AdamW(model, lr=1e-2)
    batches = [(x, torch.full_like(y, -100)) for x, y in _batches(2)]
    before = _state(model, opt)
    with pytest.raises(TrainingError, match=r"every target of the step's 2 micro-batch\(es\) is the ignore index -100"):
        train_step(model, opt, batches, 1e-2)
    _same_state(_state(model, opt), before)


@pytest.mark.parametrize("ignore_index", [None, -100])
def test_a_flagged_layer_check_raises_its_own_message(ignore_index):
    """check_ids inside deferred_checks records a flag (no read) and, read, raises the message
    (value and position) it raises at once (tests/system/test_layer_inputs.py)."""
    ids = torch.tensor([[1, 2, 1], [0, 7, 4]])
    with pytest.raises(ValueError) as now:
        check_ids(ids, 5, "token id", ignore_index=ignore_index)
    with host_reads() as reads, deferred_checks() as flags:
        check_ids(ids, 5, "token id", ignore_index=ignore_index)
        check_ids(torch.tensor([0, 1]), 5, "position")
    assert reads == [] and len(flags.flags) == 2
    assert bool(flags.any())
    with pytest.raises(ValueError) as later:
        flags.raise_first()
    assert str(later.value) == str(now.value) == (
        "token id 7 at position (1, 1) is outside [0, 5)" + ("" if ignore_index is None else " or the ignore index -100"))


# --------------------------------------------------------------------------- non-finite numbers
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
def test_a_nan_loss_is_caught_and_the_step_skipped():
    """As tests/system/test_nonfinite_training.py on the NumPy path: token embeddings of ±3e38
    (tied to the logits) overflow the forward, the loss read once is NaN, nothing is updated."""
    model = _model("gpt2")
    opt = AdamW(model, lr=1e-2, weight_decay=0.1)
    train_step(model, opt, _batches(1), 1e-2, grad_clip=1.0)
    w = model.params["tok_emb.weight"]
    w.copy_(torch.sign(w) * 3e38)
    before = _state(model, opt)
    with host_reads() as reads:
        loss, norm = train_step(model, opt, _batches(1, seed=1), 1e-2, grad_clip=1.0)
    assert not math.isfinite(loss) and skip_reason(loss, norm, 1.0, opt) is not None
    # the step's read, then -- its sums of squares not finite -- the overflow-safe norm's own
    # reads (optim.global_grad_norm; a path taken only when the numbers are already wrong)
    assert reads[0][0] == "tolist" and all(where.startswith("optim.py") for _, where in reads[1:]), reads
    _same_state(_state(model, opt), before)


# --------------------------------------------------------------------------- on a GPU
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU tests above count the reads)")
@pytest.mark.parametrize("case", list(CONFIGS))
def test_on_a_gpu_the_step_synchronises_nowhere_but_its_read(case):
    """torch's sync debug mode set to ``"error"`` around a step's parts on a CUDA device (the
    model's GPU kernel table): any synchronisation raises."""
    config = GPTConfig(vocab_size=V, context_length=8, d_model=64, n_heads=4, n_blocks=2, d_mlp=128,
                       **CONFIGS[case])
    model = GPT(config, seed=1, backend="torch", device="cuda")
    opt = AdamW(model, lr=1e-2)
    (x, y), = [(a.cuda(), b.cuda()) for a, b in _batches(1)]
    train_step(model, opt, [(x, y)], 1e-2, grad_clip=1.0)     # warm: first calls compile
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with deferred_checks() as flags:
            n_total = (y != -100).sum()
            model.loss(x, y, n_total=n_total, read=False)
            model.backward()
            sums = squared_sums([g.grads for g in opt.groups])
            flags.any()
        clip_grad_norm(opt.groups, 1.0, norm=2.0)               # the fallback's pass over g
        opt.step(1e-2, grad_norm=1.0)
        opt.step(1e-2, grad_norm=1.0, grad_scale=clip_scale(sums, 1.0))   # the kernel clipping: train_step's
    finally:
        torch.cuda.set_sync_debug_mode(previous)


# --------------------------------------------------------------------------- clipping inside the AdamW kernel
def test_a_step_clips_inside_the_adamw_kernel_as_clip_then_step_does(monkeypatch):
    """Where the update is the GPU's Triton pass (here under the interpreter: ``kernel_pass``
    made true for CPU tensors), train_step computes the clipping scale on the device from the
    unread sums of squares and the kernel applies it as it reads the gradient: the gradient
    buffer is left unscaled, no read is added before the update, and the parameters and moments
    equal those of the reference order (clip_grad_norm's pass over g, then the kernel with
    scale 1).

    Bound: the two scales come from the same float64 sums (one buffer: the same sum, root and
    quotient), so they differ at most by the rounding of a float64 scale to the dtype, one ulp
    of the dtype: ``δ ≤ eps`` relative. The kernel then reads ``s·g`` rounded once on both sides;
    ``m = (1 − β1)·sg`` moves by ``δ`` relative plus two roundings on each side, ``v = (1 − β2)(sg)²``
    by ``2δ`` plus three, the update ``step·m/(√v + ε)`` by ``δ + δ`` (numerator and √ of the
    denominator) plus four, and ``θ·decay − update`` rounds twice more:
    ``|Δθ| ≤ (2 + 2·4)·eps·|update| + 2·eps·|θ|``, ``|Δm| ≤ (1 + 2·2)·eps·|m|``, ``|Δv| ≤ (2 + 2·3)·eps·|v|``."""
    from pedestrian.gpu import adamw as gpu_adamw

    monkeypatch.setattr(AdamW, "kernel_pass", lambda self: True)
    scales = []
    real = gpu_adamw.adamw_update
    monkeypatch.setattr(gpu_adamw, "adamw_update",
                        lambda *a, grad_scale=1.0: scales.append(grad_scale) or real(*a, grad_scale=grad_scale))
    model, twin = _model("gpt2"), _model("gpt2")
    opt, twin_opt = AdamW(model, lr=1e-2, weight_decay=0.1), AdamW(twin, lr=1e-2, weight_decay=0.1)
    batches = _batches(1)
    theta = opt.groups[0].params.clone()
    loss, norm = train_step(model, opt, batches, 1e-2, grad_clip=0.05)
    assert norm > 0.05 * 2                                           # the clipping is active
    assert len(scales) == 2 and all(torch.is_tensor(s) and s.shape == () for s in scales)   # decayed, not
    assert float(scales[0]) == pytest.approx(0.05 / (norm + 1e-6), rel=1e-12)
    assert global_grad_norm([opt.groups[0].grads]) == norm           # g read scaled, never written

    (x, y), = batches
    twin.loss(x, y, n_total=int((y != -100).sum()))
    twin.backward()
    want_norm = global_grad_norm([twin_opt.groups[0].grads])
    assert want_norm == norm
    clip_grad_norm(twin_opt.groups, 0.05, norm=want_norm)
    twin_opt.step(1e-2, grad_norm=want_norm * min(1.0, 0.05 / (want_norm + 1e-6)))
    assert all(s == 1.0 for s in scales[2:])                         # (the reference order: scale 1)

    e = float(torch.finfo(theta.dtype).eps)
    got_p, want_p = opt.groups[0].params.double(), twin_opt.groups[0].params.double()
    update = (theta.double() * (1 - 1e-2 * 0.1) - want_p).abs()       # |update| (decay aside: no decay
    for got, want, tol in ((got_p, want_p, 10 * e * update + 2 * e * theta.double().abs() + 1e-30),
                           (opt.m[0].double(), twin_opt.m[0].double(), 5 * e * twin_opt.m[0].double().abs()),
                           (opt.v[0].double(), twin_opt.v[0].double(), 8 * e * twin_opt.v[0].double().abs())):
        assert bool(((got - want).abs() <= tol).all()), float(((got - want).abs() - tol).max())


def test_the_clipping_scale_is_computed_on_the_device_unread():
    """clip_scale: ``min(1, c / (√Σ s + 1e-6))`` from 0-d tensors, no read; 1 when no clipping is due."""
    sums = [torch.tensor(9.0, dtype=torch.float32), torch.tensor(16.0, dtype=torch.float64)]
    with host_reads() as reads:
        small, large = clip_scale(sums, 1.0), clip_scale(sums, 100.0)
    assert reads == [] and small.shape == () and small.dtype == torch.float64
    assert float(small) == 1.0 / (5.0 + 1e-6) and float(large) == 1.0


def test_a_grad_scale_without_the_kernel_is_refused():
    model = _model("gpt2")
    opt = AdamW(model, lr=1e-2)
    with pytest.raises(ValueError, match="needs the GPU's AdamW kernel"):
        opt.step(1e-2, grad_norm=1.0, grad_scale=0.5)
    assert opt.step_count == 0


def test_a_bare_forward_reads_its_checks_once_after_it_is_queued():
    """``model.forward(tokens, targets)`` outside a step (no KV cache): the id checks of the tokens,
    the targets and the layers record flags, read in one ``bool`` at the end
    (model/device_checks.checked_after) -- not one read per check before the first kernel; a bad id
    still raises the error the NumPy model raises at once."""
    model = _model("llama-gqa")
    x, y = _batches(1)[0]
    with host_reads() as reads:
        model.forward(x, y)
    assert [how for how, _ in reads] == ["__bool__"], reads
    bad = x.clone()
    bad[1, 3] = V + 2
    numpy_model = GPT(model.config, seed=1)
    with pytest.raises(ValueError) as want:
        numpy_model.forward(bad.numpy(), y.numpy())
    with pytest.raises(ValueError) as got:
        model.forward(bad, y)
    assert str(got.value) == str(want.value)
