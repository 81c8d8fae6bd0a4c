"""The optimizer, written by hand: AdamW, its learning-rate schedule and gradient clipping.

Everything works on the model's *flat* buffers (:meth:`pedestrian.model.GPT.trainable_buffers`:
the base parameters and their gradient, and the LoRA adapters' when they exist), so one update is a handful of vectorised in-place operations instead of one loop per tensor.
The first ``n_decay`` entries of each buffer are the 2-D weight matrices (embeddings
included) and get weight decay; the rest -- biases and layer-norm weights and biases -- do
not (the usual GPT-2 / nanoGPT choice; see :func:`pedestrian.config.param_specs`).

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

The buffers are processed in chunks of ``chunk_size`` elements with in-place operations
(``out=``), so the whole step uses two chunk-sized temporaries per thread and nothing
parameter-sized; each chunk's parameters, gradients and moments stay in cache across the dozen
passes. Chunks are independent, so with NumPy they are shared out over the elementwise thread
pool (:func:`pedestrian.backend.for_row_blocks`); the result does not depend on the split. The same
code runs on NumPy arrays and on PyTorch tensors (``backend="torch"``): ``np.multiply`` and
``torch.mul`` and friends share the ``f(a, b, out=c)`` signature.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .backend import is_torch_array, to_numpy
from .kernels.threads import for_row_blocks

__all__ = ["AdamW", "ParamGroup", "CosineSchedule", "param_groups", "global_grad_norm",
           "clip_grad_norm"]

#: default chunk length (elements): 2^16 float32 = 256 KiB per array, five arrays in L2/L3
NUMPY_CHUNK = 1 << 16
#: chunk length for buffers under 2^22 elements: fewer, larger calls (per-call overhead and,
#: with several threads, GIL hand-overs matter more than cache misses there). Measured on
#: char-small (810k parameters, 2 threads): 2.9 ms per update with 2^16, 2.2 ms with 2^18
SMALL_NUMPY_CHUNK = 1 << 18
#: torch ops carry more per-call overhead and are multi-threaded inside: use larger chunks
TORCH_CHUNK = 1 << 20

_scratch = threading.local()                        # per-thread chunk temporaries (AdamW)


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
    """``Σ a²`` of a flat buffer, without a temporary (BLAS dot / torch.dot)."""
    if is_torch_array(a):
        import torch

        return float(torch.dot(a, a))
    return float(np.dot(a, a))


def global_grad_norm(grads) -> float:
    """The global L2 norm ``sqrt(Σ_buffers Σ_i g_i²)`` of one or several flat gradient buffers.

    Args:
        grads: a flat array, or a list of them (NumPy or torch).

    Returns:
        Python float. (``torch.nn.utils.clip_grad_norm_`` takes the norm of the per-tensor
        norms, which is the same number up to rounding.)
    """
    if not isinstance(grads, (list, tuple)):
        grads = [grads]
    return math.sqrt(sum(_dot(g) for g in grads))


def clip_grad_norm(grads, max_norm: float) -> float:
    """Scale gradients in place so their global L2 norm is at most ``max_norm``.

    Convention of ``torch.nn.utils.clip_grad_norm_``: with ``N`` the global norm,
    ``coef = max_norm / (N + 1e-6)``; if ``coef < 1`` every gradient is multiplied by it.

    Args:
        grads: a flat gradient array, a list of them, or a list of :class:`ParamGroup`.
        max_norm: ``> 0``; ``math.inf`` only measures.

    Returns:
        The norm *before* clipping (Python float; may be ``inf``/``nan`` if a gradient is).

    Raises:
        ValueError: ``max_norm <= 0``.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm (gradient clipping) must be > 0, got {max_norm}")
    if not isinstance(grads, (list, tuple)):
        grads = [grads]
    grads = [g.grads if isinstance(g, ParamGroup) else g for g in grads]
    norm = global_grad_norm(grads)
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            mul = _ops(g)[0]
            mul(g, coef, out=g)
    return norm


@dataclass(frozen=True)
class CosineSchedule:
    """Linear warm-up, then cosine decay to ``min_lr`` (GPT-2 / nanoGPT style).

    For update index ``it = 0, 1, …`` (the ``it``-th call of :meth:`AdamW.step`)::

        it < warmup_steps:         lr = max_lr · (it + 1) / warmup_steps    (never 0)
        warmup_steps <= it < max:  p = (it − warmup_steps) / (max_steps − warmup_steps)
                                   lr = min_lr + ½ (max_lr − min_lr) (1 + cos(π p))
        it >= max_steps:           lr = min_lr

    So the first update already uses ``max_lr / warmup_steps`` and the last warm-up update
    ``max_lr`` itself.

    Raises:
        ValueError: ``max_lr <= 0``, ``min_lr`` outside ``[0, max_lr]``, ``warmup_steps < 0``,
            ``max_steps < 1``.
    """

    max_lr: float
    warmup_steps: int
    max_steps: int
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        if not self.max_lr > 0:
            raise ValueError(f"learning rate must be > 0, got {self.max_lr}")
        if not 0 <= self.min_lr <= self.max_lr:
            raise ValueError(f"min_lr must be in [0, lr={self.max_lr}], got {self.min_lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")

    def __call__(self, it: int) -> float:
        if it < self.warmup_steps:
            return self.max_lr * (it + 1) / self.warmup_steps
        if it >= self.max_steps:
            return self.min_lr
        span = max(self.max_steps - self.warmup_steps, 1)
        progress = (it - self.warmup_steps) / span
        return self.min_lr + 0.5 * (self.max_lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))


class AdamW:
    """AdamW with decoupled weight decay over flat parameter buffers (see the module docstring).

    Args:
        groups: a :class:`~pedestrian.model.GPT` (its :func:`param_groups`) or a list of
            :class:`ParamGroup`.
        lr: default learning rate (``step(lr=...)`` overrides it per update).
        betas: ``(β1, β2)``, each in ``[0, 1)``.
        eps: added to ``√v̂`` (``> 0``... ``>= 0`` accepted).
        weight_decay: ``λ >= 0``, applied as ``θ ← θ(1 − lr·λ)`` to the first ``n_decay``
            entries of each buffer only.
        chunk_size: elements per chunk (default 2^16 for NumPy, 2^20 for torch).

    State: ``step`` (updates done) and, per group, the first and second moments ``m``, ``v``
    (flat, same dtype and backend as the parameters, zero-initialised as in PyTorch).

    Raises:
        ValueError: out-of-range hyper-parameters.
    """

    def __init__(self, groups, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, chunk_size: int | None = None):
        if not isinstance(groups, (list, tuple)):
            groups = param_groups(groups)
        if not lr > 0:
            raise ValueError(f"learning rate must be > 0, got {lr}")
        b1, b2 = (float(b) for b in betas)
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must each be in [0, 1), got {betas}")
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        self.groups: list[ParamGroup] = list(groups)
        self.lr = float(lr)
        self.betas = (b1, b2)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        torch_backend = is_torch_array(self.groups[0].params)
        n_max = max(int(g.params.shape[0]) for g in self.groups)
        numpy_chunk = SMALL_NUMPY_CHUNK if n_max < 1 << 22 else NUMPY_CHUNK
        self.chunk_size = int(chunk_size or (TORCH_CHUNK if torch_backend else numpy_chunk))
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
    def step(self, lr: float | None = None) -> None:
        """One AdamW update of every group from its current gradient buffer.

        Args:
            lr: learning rate for this update (default :attr:`lr`), e.g. from a
                :class:`CosineSchedule`.
        """
        lr = self.lr if lr is None else float(lr)
        self.step_count += 1
        t = self.step_count
        b1, b2 = self.betas
        step_size = lr / (1.0 - b1 ** t)
        bc2_sqrt = (1.0 - b2 ** t) ** 0.5
        decay = 1.0 - lr * self.weight_decay
        chunks = []                                   # (group, start, end, decayed)
        for gi, group in enumerate(self.groups):
            n = int(group.params.shape[0])
            for lo, hi, decayed in ((0, group.n_decay, True), (group.n_decay, n, False)):
                chunks += [(gi, s, min(s + self.chunk_size, hi), decayed)
                           for s in range(lo, hi, self.chunk_size)]

        def kernel(lo: int, hi: int) -> None:
            for gi, s, e, decayed in chunks[lo:hi]:
                group, m, v = self.groups[gi], self.m[gi], self.v[gi]
                self._update_chunk(group.params[s:e], group.grads[s:e], m[s:e], v[s:e],
                                   step_size, bc2_sqrt, decay if decayed else None)

        # chunks are independent: NumPy runs them on the elementwise thread pool (each
        # thread with its own temporaries); torch threads each operation itself
        for_row_blocks(self.groups[0].params, kernel, len(chunks), self.chunk_size)

    def _update_chunk(self, p, g, m, v, step_size, bc2_sqrt, decay):
        b1, b2 = self.betas
        k = p.shape[0]
        t1, t2 = self._temporaries()
        t1, t2 = t1[:k], t2[:k]
        if is_torch_array(p):
            # the same update with torch's multi-operand in-place operations (5 passes
            # instead of 14; torch.optim.AdamW's single-tensor path uses these very calls)
            if decay is not None and decay != 1.0:
                p.mul_(decay)
            m.lerp_(g, 1.0 - b1)
            v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
            import torch

            torch.sqrt(v, out=t2)                     # denominator rescaled by √(1 − β2ᵗ): one op less
            t2.add_(self.eps * bc2_sqrt)
            p.addcdiv_(m, t2, value=-step_size * bc2_sqrt)
            return
        mul, sub, add, div, sqrt, _ = _ops(p)
        if decay is not None and decay != 1.0:
            mul(p, decay, out=p)                      # θ ← θ (1 − lr λ)
        sub(g, m, out=t1)                             # m ← m + (1 − β1)(g − m)
        mul(t1, 1.0 - b1, out=t1)
        add(m, t1, out=m)
        mul(v, b2, out=v)                             # v ← β2 v + (1 − β2) g²
        mul(g, g, out=t1)
        mul(t1, 1.0 - b2, out=t1)
        add(v, t1, out=v)
        sqrt(v, out=t2)                               # √(1 − β2ᵗ) · denom = √v + ε √(1 − β2ᵗ)
        add(t2, self.eps * bc2_sqrt, out=t2)
        div(m, t2, out=t1)                            # θ ← θ − lr/(1 − β1ᵗ) · m / denom
        mul(t1, -step_size * bc2_sqrt, out=t1)
        add(p, t1, out=p)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """``{"step": int, "base.m": ndarray, "base.v": ndarray, ["lora.m", "lora.v"]}``
        (NumPy copies) plus the hyper-parameters under ``"hyper"`` (a dict)."""
        out: dict = {"step": self.step_count,
                     "hyper": {"lr": self.lr, "betas": list(self.betas), "eps": self.eps,
                               "weight_decay": self.weight_decay}}
        for group, m, v in zip(self.groups, self.m, self.v):
            out[f"{group.name}.m"] = np.ascontiguousarray(to_numpy(m)).copy()
            out[f"{group.name}.v"] = np.ascontiguousarray(to_numpy(v)).copy()
        return out

    def tensors(self) -> dict:
        """Only the arrays of :meth:`state_dict` (for safetensors)."""
        return {k: v for k, v in self.state_dict().items() if k not in ("step", "hyper")}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``step`` and the moments (hyper-parameters are not changed).

        Raises:
            ValueError: a missing or unexpected moment, or a length that does not match the
                parameter buffer (the optimizer state belongs to another model); nothing is
                changed then.
        """
        names = {f"{g.name}.{k}" for g in self.groups for k in "mv"}
        given = {k for k in state if k not in ("step", "hyper")}
        problems = []
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
        if "step" not in state:
            problems.append("missing step")
        if problems:
            raise ValueError("optimizer state does not match this model: " + "; ".join(problems))
        for group, m, v in zip(self.groups, self.m, self.v):
            for dst, key in ((m, f"{group.name}.m"), (v, f"{group.name}.v")):
                src = to_numpy(state[key])
                if is_torch_array(dst):
                    import torch

                    dst.copy_(torch.as_tensor(np.asarray(src)))
                else:
                    dst[...] = src
        self.step_count = int(state["step"])
