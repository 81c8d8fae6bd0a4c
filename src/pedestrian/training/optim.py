"""The optimizer, written by hand: AdamW and gradient clipping (its learning-rate schedule:
:mod:`.schedule`, re-exported here).

Everything works on the model's *flat* buffers (:meth:`pedestrian.model.GPT.trainable_buffers`:
the base parameters and their gradient, and the LoRA adapters' when they exist), so one update is a handful of vectorised in-place operations instead of one loop per tensor.
The first ``n_decay`` entries of each buffer are the 2-D weight matrices (embeddings
included) and get weight decay; the rest -- biases and layer-norm weights and biases -- do
not (the usual GPT-2 / nanoGPT choice; see :func:`pedestrian.model.layout.param_specs`).

The update is exactly ``torch.optim.AdamW`` (PyTorch 2.x, single-tensor path), step ``t``
counting from 1, learning rate ``lr`` and weight decay ``λ``::

    θ ← θ · (1 − lr·λ)                      decoupled weight decay, before the Adam step
    m ← m + (1 − β1) · (g − m)              (= β1·m + (1 − β1)·g, written as torch's lerp)
    v ← β2 · v + (1 − β2) · g²
    θ ← θ − lr / (1 − β1ᵗ) · m / (√v / √(1 − β2ᵗ) + ε)      ε added after the square root

computed as ``θ − (lr √(1 − β2ᵗ) / (1 − β1ᵗ)) · m / (√v + ε √(1 − β2ᵗ))``, the same number
(numerator and denominator times ``√(1 − β2ᵗ)``) with one pass less over the buffers.

(Loshchilov & Hutter, "Decoupled weight decay regularization", ICLR 2019, Algorithm 2; Kingma &
Ba, "Adam", ICLR 2015, with the bias corrections folded in as PyTorch does.)

NumPy buffers: one pass of a numba kernel (:func:`_adamw`) reads ``θ, g, m, v`` once and writes
``θ, m, v`` once, its chunks of ``chunk_size`` elements shared over numba's threads
(``prange``; the result does not depend on the split). PyTorch tensors: chunks of in-place
multi-operand operations (``lerp_``, ``addcmul_``, ``addcdiv_``), two chunk-sized temporaries; on a
CUDA device with Triton installed, one kernel pass (:mod:`pedestrian.gpu.adamw`).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .. import gpu
from ..backend import is_torch_array, to_numpy
from ..model.finite import non_finite_counts, non_finite_report
from ..kernels.jit import AVAILABLE as JIT_AVAILABLE
from ..kernels.jit import kernel, prange
from .schedule import CosineSchedule

__all__ = ["AdamW", "ParamGroup", "CosineSchedule", "param_groups", "global_grad_norm",
           "squared_sums", "clip_grad_norm", "clip_scale"]

#: NumPy: elements per chunk of the update kernel (the unit its threads share out)
NUMPY_CHUNK = 1 << 16
#: torch ops carry per-call overhead and are multi-threaded inside: use larger chunks
TORCH_CHUNK = 1 << 20

_scratch = threading.local()                        # per-thread chunk temporaries (AdamW, torch)


@kernel(parallel=True)
def _adamw(p, g, m, v, decay, b1, b2, step, eps, chunk):
    """``θ ← θ·decay``, ``m ← m + (1 − β1)(g − m)``, ``v ← β2 v + (1 − β2) g²``,
    ``θ ← θ − step · m / (√v + eps)`` (``step``, ``eps`` carry the bias corrections)."""
    T = p.dtype.type                                  # float32 buffers: float32 arithmetic, as torch
    f, c1, c2, c3, s, e = T(decay), T(1.0 - b1), T(b2), T(1.0 - b2), T(step), T(eps)
    n = p.shape[0]
    for c in prange((n + chunk - 1) // chunk):
        for i in range(c * chunk, min(n, (c + 1) * chunk)):
            mi = m[i] + c1 * (g[i] - m[i])
            vi = c2 * v[i] + c3 * (g[i] * g[i])
            m[i] = mi
            v[i] = vi
            p[i] = p[i] * f - s * (mi / (np.sqrt(vi) + e))


def _adamw_numpy(p, g, m, v, decay, b1, b2, step, eps, chunk):
    """:func:`_adamw` in NumPy calls, where numba cannot be imported (buffer-sized temporaries)."""
    m += (1.0 - b1) * (g - m)
    v *= b2
    v += (1.0 - b2) * (g * g)
    p *= decay
    p -= step * (m / (np.sqrt(v) + eps))


@dataclass
class ParamGroup:
    """One flat parameter buffer and its gradient buffer.

    Attributes:
        name: ``"base"`` or ``"lora"`` (the key prefix in the optimizer state).
        params: ``(n,)`` float array, updated in place.
        grads: ``(n,)`` array of the same dtype, read by :meth:`AdamW.step` (and scaled in
            place by :func:`clip_grad_norm`).
        n_decay: the first ``n_decay`` entries get weight decay.
    """

    name: str
    params: Any
    grads: Any
    n_decay: int


def param_groups(model) -> list[ParamGroup]:
    """The trainable flat buffers of a :class:`~pedestrian.model.GPT`.

    The base buffer when the base is trained, and the LoRA buffer when adapters exist (a
    frozen base -- ``model.freeze_base`` -- gets no gradients and is not in the list). Call it
    again after :meth:`GPT.add_lora` / :meth:`GPT.remove_lora`: the buffers change.

    Returns:
        list of :class:`ParamGroup` (gradient buffers are created here if they did not exist).
    """
    groups = [ParamGroup(b.name, b.params, b.grads, b.n_decay) for b in model.trainable_buffers()]
    if not groups:
        raise ValueError("the model has nothing to train: its base is frozen and it has no LoRA adapters")
    return groups


def _ops(array):
    """``(mul, sub, add, div, sqrt, empty_like)`` for NumPy arrays or torch tensors."""
    if is_torch_array(array):
        import torch

        return torch.mul, torch.sub, torch.add, torch.div, torch.sqrt, torch.empty_like
    return np.multiply, np.subtract, np.add, np.divide, np.sqrt, np.empty_like


def _dot(a) -> float:
    """``Σ a²`` of a flat buffer in its own dtype, without a temporary (BLAS dot / torch.dot)."""
    if is_torch_array(a):
        import torch

        return float(torch.dot(a, a))
    with np.errstate(over="ignore", invalid="ignore"):     # an overflow is detected by the caller
        return float(np.dot(a, a))


#: elements per float64 chunk of the overflow-safe sum of squares (2 MiB)
_SAFE_CHUNK = 1 << 18


def _scaled_sum_squares(g) -> tuple[float, float]:
    """``(s, a)`` with ``Σ g² = a² · s``, where ``a`` is a power of two near ``max|g|`` and
    ``s <= len(g)``: the squares of ``g / a`` are summed in float64 chunks, so nothing overflows or
    underflows whatever the dtype. ``(nan, 1)`` / ``(inf, 1)`` when ``g`` holds a NaN / an inf."""
    top = max(abs(float(g.max())), abs(float(g.min())))   # NaN propagates through max / min
    if not math.isfinite(top):
        return top, 1.0
    if top == 0.0:
        return 0.0, 1.0
    exponent = math.frexp(top)[1]                       # top = f · 2^exponent, f in [0.5, 1)
    scale = math.ldexp(1.0, -exponent)                  # a power of two: the scaling is exact
    s = 0.0
    for lo in range(0, int(g.shape[0]), _SAFE_CHUNK):
        c = np.asarray(to_numpy(g[lo:lo + _SAFE_CHUNK]), dtype=np.float64) * scale
        s += float(np.dot(c, c))
    return s, math.ldexp(1.0, exponent)


def squared_sums(grads) -> list:
    """``Σ g²`` of each flat buffer as :func:`global_grad_norm` starts from it, in the buffer's
    dtype, unread: 0-d tensors on the device for torch buffers (no host synchronisation),
    floats for NumPy ones. Pass them, read, to ``global_grad_norm(grads, sums=...)``."""
    if not isinstance(grads, (list, tuple)):
        grads = [grads]
    if grads and is_torch_array(grads[0]):
        import torch

        return [torch.dot(g, g) for g in grads]
    return [_dot(g) for g in grads]


def global_grad_norm(grads, sums=None) -> float:
    """The global L2 norm ``sqrt(Σ_buffers Σ_i g_i²)`` of one or several flat gradient buffers.

    Overflow-safe: the fast path is one dot product per buffer in the buffer's dtype; when that
    overflows (float32 gradients near 1e19 and above square past 3.4e38) or lands in the
    subnormal range, the buffer's squares are summed again in float64 after scaling by a power
    of two near ``max|g|``, so the result is finite whenever the true norm is (below 1.8e308).
    ``torch.nn.utils.clip_grad_norm_`` does no such rescaling: in float32 it returns ``inf``
    for gradients near 1e20.

    Args:
        grads: a flat array, or a list of them (NumPy or torch).
        sums: each buffer's ``Σ g²`` in its dtype, already read (floats from :func:`squared_sums`,
            e.g. read from a device with the step's other numbers); ``None``: computed here.

    Returns:
        Python float; ``nan`` if a gradient holds a NaN, ``inf`` if one holds an inf.
        (``torch.nn.utils.clip_grad_norm_`` takes the norm of the per-tensor norms, which is
        the same number up to rounding.)
    """
    if not isinstance(grads, (list, tuple)):
        grads = [grads]
    parts = []                                          # (s, a): the buffer's Σ g² = a² s
    for i, g in enumerate(grads):
        s = _dot(g) if sums is None else float(sums[i])
        tiny = float(np.finfo(np.float64 if "64" in str(g.dtype) else np.float32).tiny)
        if not math.isfinite(s) or 0.0 < s < tiny * 2.0 ** 24:
            parts.append(_scaled_sum_squares(g))        # overflow, NaN, or subnormal rounding
        elif s == 0.0 and (g.max() != 0 or g.min() != 0):
            parts.append(_scaled_sum_squares(g))        # every square underflowed to zero
        else:
            parts.append((s, 1.0))
    if not parts:
        return 0.0
    if any(math.isnan(s) for s, _ in parts):
        return math.nan
    top = max(a for _, a in parts)
    return top * math.sqrt(sum(s * (a / top) ** 2 for s, a in parts))


def clip_grad_norm(grads, max_norm: float, norm: float | None = None) -> float:
    """Scale gradients in place so their global L2 norm is at most ``max_norm``.

    Convention of ``torch.nn.utils.clip_grad_norm_``: with ``N`` the global norm,
    ``coef = max_norm / (N + 1e-6)``; if ``coef < 1`` every gradient is multiplied by it. ``N``
    comes from :func:`global_grad_norm` (overflow-safe), and a ``coef`` below 2⁻⁶⁰ is applied
    in exact power-of-two steps first, so float32 gradients of 1e20 or 1e38 are clipped to a
    norm of ``max_norm`` rather than to inf or to zero. A non-finite ``N`` changes nothing.

    Args:
        grads: a flat gradient array, a list of them, or a list of :class:`ParamGroup`.
        max_norm: ``> 0``; ``math.inf`` only measures.
        norm: the global norm if already known (saves a pass over the gradients).

    Returns:
        The norm *before* clipping (Python float; ``inf``/``nan`` if a gradient is).

    Raises:
        ValueError: ``max_norm <= 0``.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm (gradient clipping) must be > 0, got {max_norm}")
    if not isinstance(grads, (list, tuple)):
        grads = [grads]
    grads = [g.grads if isinstance(g, ParamGroup) else g for g in grads]
    if norm is None:
        norm = global_grad_norm(grads)
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:                                      # False for a NaN norm too
        factors = []
        while coef < 2.0 ** -60:                        # keep each factor a normal float32
            factors.append(2.0 ** -60)
            coef *= 2.0 ** 60
        factors.append(coef)
        for g in grads:
            mul = _ops(g)[0]
            for f in factors:
                mul(g, f, out=g)
    return norm


def clip_scale(sums, max_norm: float):
    """The clipping scale ``min(1, max_norm / (N + 1e-6))``, ``N = √(Σ_buffers Σ g²)``, computed on
    the device from the unread sums of squares of :func:`squared_sums` (0-d tensors): a 0-d
    float64 tensor there, never read on the host, for the AdamW kernel to apply as it reads the
    gradient (:meth:`AdamW.step`'s ``grad_scale``). :func:`clip_grad_norm`'s convention; valid
    where :func:`global_grad_norm` takes its fast path (every sum finite and not subnormal: the
    caller checks the sums it read), where ``N`` is the same sum and root in float64."""
    import torch

    total = torch.stack([torch.as_tensor(s).to(torch.float64) for s in sums]).sum()     # Σ Σ g², float64
    return torch.clamp(float(max_norm) / (torch.sqrt(total) + 1e-6), max=1.0)           # 0-d, unread


class AdamW:
    """AdamW with decoupled weight decay over flat parameter buffers (see the module docstring).

    Args:
        groups: a :class:`~pedestrian.model.GPT` (its :func:`param_groups`) or a list of
            :class:`ParamGroup`.
        lr: default learning rate (``step(lr=...)`` overrides it per update).
        betas: ``(β1, β2)``, each in ``[0, 1)``.
        eps: added to ``√v̂``, ``> 0`` (with 0, an entry whose gradient has always been 0 --
            the embedding of a token no batch held -- would get ``0 / 0 = NaN``).
        weight_decay: ``λ >= 0``, applied as ``θ ← θ(1 − lr·λ)`` to the first ``n_decay``
            entries of each buffer only.
        chunk_size: elements per chunk (default 2^16 for NumPy, 2^20 for torch).

    State: ``step`` (updates done) and, per group, the first and second moments ``m``, ``v``
    (flat, same dtype and backend as the parameters, zero-initialised as in PyTorch).

    Finite in, finite out: :meth:`step` refuses a gradient whose global norm is not finite or
    exceeds :attr:`max_grad_norm` (``√max / 2`` of the dtype: 9.2e18 in float32), changing
    nothing. Below it every ``g_i² <= max/4``, so ``v`` (a convex combination of such squares)
    and ``m`` (of such gradients) stay finite, and the denominator ``√v + ε√(1 − β2ᵗ)`` is
    ``> 0`` since ``ε > 0``: the step is finite. For ``β1² < β2`` (the defaults) it is also small:
    ``|m| <= (1 − β1) / (√(1 − β2) (1 − β1/√β2)) · √v`` (about 10.5 √v for 0.9 / 0.99), so a
    parameter moves by at most about ``10 · lr`` per update, whatever the gradient.

    The hyper-parameters are taken as given (as :class:`CosineSchedule`'s): a run's are its
    settings, declared and validated once in :mod:`pedestrian.training.specs` (``--lr``, ``--beta1``,
    ``--beta2``, ``--eps``, ``--weight-decay``).

    Raises:
        ValueError: ``chunk_size < 1``.
    """

    def __init__(self, groups, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, chunk_size: int | None = None):
        if not isinstance(groups, (list, tuple)):
            groups = param_groups(groups)
        b1, b2 = (float(b) for b in betas)
        self.groups: list[ParamGroup] = list(groups)
        self.lr = float(lr)
        self.betas = (b1, b2)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        torch_backend = is_torch_array(self.groups[0].params)
        n_max = max(int(g.params.shape[0]) for g in self.groups)
        self.chunk_size = int(chunk_size or (TORCH_CHUNK if torch_backend else NUMPY_CHUNK))
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.step_count = 0
        self.m = []
        self.v = []
        for g in self.groups:
            zeros_like = g.params.new_zeros if torch_backend else None
            self.m.append(zeros_like(g.params.shape) if torch_backend else np.zeros_like(g.params))
            self.v.append(zeros_like(g.params.shape) if torch_backend else np.zeros_like(g.params))
        self._tmp_len = min(self.chunk_size, n_max)
        dtype = str(self.groups[0].params.dtype).replace("torch.", "")
        #: the largest gradient norm :meth:`step` accepts: √(largest float of the dtype) / 2
        self.max_grad_norm = math.sqrt(float(np.finfo(dtype).max)) / 2

    def _temporaries(self):
        """Two chunk-sized scratch arrays private to the calling thread (kept between steps)."""
        store = getattr(_scratch, "arrays", None)
        if store is None:
            store = _scratch.arrays = {}
        like = self.groups[0].params
        key = (type(like), str(like.dtype), str(getattr(like, "device", "cpu")), self._tmp_len)
        pair = store.get(key)
        if pair is None:
            if len(store) >= 4:                         # other sizes / dtypes: keep only a few
                store.pop(next(iter(store)))
            empty_like = _ops(like)[5]
            pair = store[key] = (empty_like(like[:self._tmp_len]), empty_like(like[:self._tmp_len]))
        return pair

    # ------------------------------------------------------------------ update
    def kernel_pass(self) -> bool:
        """Whether :meth:`update` runs the GPU's one Triton pass (:mod:`pedestrian.gpu.adamw`):
        CUDA buffers with Triton installed. Only then does :meth:`step` take a ``grad_scale``."""
        p = self.groups[0].params
        return is_torch_array(p) and p.device.type == "cuda" and gpu.available()

    def step(self, lr: float | None = None, *, grad_norm: float | None = None, grad_scale=None) -> None:
        """One AdamW update of every group from its current gradient buffer.

        Args:
            lr: learning rate for this update (default :attr:`lr`), e.g. from a
                :class:`CosineSchedule`.
            grad_norm: the global norm of the gradients as the update sees them (after clipping),
                if the caller knows it; else it is computed (one pass, :func:`global_grad_norm`).
            grad_scale: the clipping scale the kernel applies as it reads the gradient (a 0-d
                tensor on the device, :func:`clip_scale`, or a float), instead of a pass of
                :func:`clip_grad_norm` over it; only where :meth:`kernel_pass` (``ValueError``
                elsewhere). ``None``: 1.

        Raises:
            FloatingPointError: the gradient norm is NaN, inf or above :attr:`max_grad_norm`
                (clip it first, see :func:`clip_grad_norm`). Nothing was changed: parameters,
                moments and the step count are as before.
        """
        lr = self.lr if lr is None else float(lr)
        if grad_norm is None:
            grad_norm = global_grad_norm([g.grads for g in self.groups])
        if not grad_norm <= self.max_grad_norm:
            raise FloatingPointError(
                f"AdamW: the gradient norm is {grad_norm:g}, not a finite number <= {self.max_grad_norm:.3g} "
                "(the largest whose square the dtype holds); the update was not applied and the "
                "parameters and moments are unchanged. Clip the gradient (clip_grad_norm) first")
        if grad_scale is not None and not self.kernel_pass():
            raise ValueError("AdamW.step(grad_scale=...) needs the GPU's AdamW kernel (CUDA buffers, triton "
                             "installed); elsewhere clip the gradient with clip_grad_norm first")
        coefficients = self.advance(lr)
        for gi, group in enumerate(self.groups):
            self.update(gi, 0, int(group.params.shape[0]), group.grads, coefficients,
                        grad_scale=1.0 if grad_scale is None else grad_scale)

    def advance(self, lr: float) -> tuple[float, float, float]:
        """Count one update (:attr:`step_count` + 1) and return its coefficients for
        :meth:`update`: ``(lr / (1 − β1ᵗ), √(1 − β2ᵗ), 1 − lr·λ)``. :meth:`step` calls it; so does an
        update applied in parts (:mod:`pedestrian.training.blockwise`), once per update."""
        self.step_count += 1
        t = self.step_count
        b1, b2 = self.betas
        return lr / (1.0 - b1 ** t), (1.0 - b2 ** t) ** 0.5, 1.0 - lr * self.weight_decay

    def update(self, gi: int, lo: int, hi: int, grads, coefficients, *, grad_scale=1.0) -> None:
        """The AdamW update of entries ``lo:hi`` of group ``gi`` (parameters and moments) from
        ``grads``, their gradient (``hi − lo`` entries), with :meth:`advance`'s ``coefficients``.
        Every entry is updated on its own, so updating a buffer in parts gives the bits of one
        :meth:`step`. No checks: the caller checks the gradient first (as :meth:`step` does).
        ``grad_scale``: the GPU kernel's clipping scale (:meth:`step`); 1 on every other path."""
        step_size, bc2_sqrt, decay = coefficients
        group, (b1, b2) = self.groups[gi], self.betas
        for a, b, f in ((lo, min(hi, group.n_decay), decay), (max(lo, group.n_decay), hi, 1.0)):
            if b <= a:
                continue
            p, g, m, v = group.params[a:b], grads[a - lo:b - lo], self.m[gi][a:b], self.v[gi][a:b]
            if self.kernel_pass():                                                   # one Triton pass
                from ..gpu.adamw import adamw_update

                adamw_update(p, g, m, v, f, b1, b2, step_size * bc2_sqrt, self.eps * bc2_sqrt, grad_scale=grad_scale)
            elif is_torch_array(p):
                for s in range(0, b - a, self.chunk_size):
                    e = s + self.chunk_size
                    self._torch_chunk(p[s:e], g[s:e], m[s:e], v[s:e], step_size, bc2_sqrt, f)
            else:                                     # √(1 − β2ᵗ) · denom = √v + ε √(1 − β2ᵗ)
                update = _adamw if JIT_AVAILABLE else _adamw_numpy
                update(p, g, m, v, f, b1, b2, step_size * bc2_sqrt, self.eps * bc2_sqrt, self.chunk_size)

    def _torch_chunk(self, p, g, m, v, step_size, bc2_sqrt, decay):
        # torch's multi-operand in-place operations (5 passes; torch.optim.AdamW's
        # single-tensor path uses these very calls)
        import torch

        b1, b2 = self.betas
        t2 = self._temporaries()[1][:p.shape[0]]
        if decay != 1.0:
            p.mul_(decay)                             # θ ← θ (1 − lr λ)
        m.lerp_(g, 1.0 - b1)
        v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        torch.sqrt(v, out=t2)                         # denominator rescaled by √(1 − β2ᵗ): one op less
        t2.add_(self.eps * bc2_sqrt)
        p.addcdiv_(m, t2, value=-step_size * bc2_sqrt)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """``{"step": int, "base.m": ndarray, "base.v": ndarray, ["lora.m", "lora.v"]}``
        (NumPy copies). The hyper-parameters are not in it: a run records them once, in its
        settings (an older state's ``"hyper"`` is ignored by :meth:`load_state_dict`)."""
        out: dict = {"step": self.step_count}
        for group, m, v in zip(self.groups, self.m, self.v):
            out[f"{group.name}.m"] = np.ascontiguousarray(to_numpy(m)).copy()
            out[f"{group.name}.v"] = np.ascontiguousarray(to_numpy(v)).copy()
        return out

    def tensors(self) -> dict:
        """Only the arrays of :meth:`state_dict` (for safetensors)."""
        return {k: v for k, v in self.state_dict().items() if k != "step"}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``step`` and the moments (an older state's ``"hyper"`` is ignored).

        Raises:
            ValueError: a missing or unexpected moment, a length that does not match the
                parameter buffer (the optimizer state belongs to another model), or a moment
                holding NaN or ±inf; nothing is changed then.
        """
        names = {f"{g.name}.{k}" for g in self.groups for k in "mv"}
        given = {k for k in state if k not in ("step", "hyper")}
        problems, moments = [], {}
        if names - given:
            problems.append(f"missing {sorted(names - given)}")
        if given - names:
            problems.append(f"unexpected {sorted(given - names)}")
        for group in self.groups:
            for k in "mv":
                key = f"{group.name}.{k}"
                if key in state and tuple(np.shape(state[key])) != tuple(group.params.shape):
                    problems.append(f"{key} has shape {tuple(np.shape(state[key]))}, the parameters "
                                    f"{tuple(group.params.shape)}")
                elif key in state:                  # a NaN moment makes every later update NaN
                    moments[key] = state[key]
        if "step" not in state:
            problems.append("missing step")
        if problems:
            raise ValueError("optimizer state does not match this model: " + "; ".join(problems))
        non_finite = non_finite_counts(moments)
        if non_finite:
            raise ValueError("optimizer state holds non-finite values: "
                             + non_finite_report(non_finite, moments, limit=None) + "; nothing was loaded")
        for group, m, v in zip(self.groups, self.m, self.v):
            for dst, key in ((m, f"{group.name}.m"), (v, f"{group.name}.v")):
                src = to_numpy(state[key])
                if is_torch_array(dst):
                    import torch

                    dst.copy_(torch.as_tensor(np.asarray(src)))
                else:
                    dst[...] = src
        self.step_count = int(state["step"])
