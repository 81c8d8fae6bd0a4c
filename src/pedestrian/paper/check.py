"""Check a hand-written backward against numbers: :func:`check_gradients`.

The paper's habit -- derive a layer's backward by hand, then check it before trusting it -- for
any layer written to this contract (plain NumPy; the guide's "Check your own layer")::

    forward(inputs, params)  -> (output, cache)        # inputs, params: dicts name -> ndarray
    backward(delta, cache)   -> (input_deltas, param_grads)   # dicts keyed like inputs, params

Every floating-point input and parameter is checked in float64, entry by entry, against central
differences of ``L = Σ δ ∘ output`` (``δ`` a random error signal), with a step and a bound
derived per tensor from the arithmetic (docs/EQUATIONS.md, "Checking a backward by numbers").
Complex step and PyTorch's ``torch.func.vjp`` join as sharper references where the forward
accepts complex or torch input. Integer inputs (token ids, targets) are held fixed.

This module imports only NumPy at the top; PyTorch is imported only for the autograd reference.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import numpy as np

__all__ = ["GradientReport", "LAYER_FUNCTIONS", "TensorCheck", "check_gradients", "load_layer"]

EPS = float(np.finfo(np.float64).eps)
#: two calls of one deterministic computation must agree to this many ε of its largest value (a
#: library may split a sum over threads differently from call to call; dropout errs by O(1))
REPEAT_ULPS = 64
#: central-difference base step, in units of the tensor's scale max(1, max|x|): ε^(1/3) balances
#: an O(h²) truncation against an O(ε/h) rounding when |f'''| ~ |f| (Nocedal & Wright, sec. 8.1)
BASE_STEP = EPS ** (1 / 3)
#: complex step (Squire & Trapp 1998): Im f(x + i·h)/h has no subtraction, so h can be tiny
COMPLEX_STEP = 1e-20
PILOT_ENTRIES = 8
#: what a layer module defines (``pedestrian check my_layer.py``; docs/guide.md)
LAYER_FUNCTIONS = ("example", "forward", "backward")


@dataclass
class TensorCheck:
    """One tensor's result.

    Attributes:
        name, kind: the key in ``inputs`` (kind ``"input"``: its delta) or ``params`` (``"param"``).
        shape: the tensor's shape.
        max_diff: largest ``|backward − reference|`` over the entries checked (``None``: not compared).
        bound: the largest difference a correct backward can show (docs/EQUATIONS.md).
        method: the reference ``max_diff`` is measured against: ``"autograd"``, ``"complex step"``
            or ``"central"`` (central differences always run and must pass too).
        step: the central-difference step ``h`` chosen for this tensor.
        passed: no problem and ``max_diff <= bound`` against every reference used.
        problem: a one-line diagnosis (wrong shape, missing, NaN, another answer on a second
            call, a difference over the bound), or ``None``.
    """

    name: str
    kind: str
    shape: tuple
    max_diff: float | None = None
    bound: float | None = None
    method: str = ""
    step: float | None = None
    passed: bool = False
    problem: str | None = None

    def line(self, width: int = 12) -> str:
        """``name kind shape largest-difference bound method pass|FAIL [: problem]``."""
        nums = (f"{self.max_diff:>12.2e} {self.bound:>10.2e}  {self.method:<12}"
                if self.max_diff is not None else f"{'-':>12} {'-':>10}  {'':<12}")
        verdict = "pass" if self.passed else "FAIL"
        tail = f": {self.problem}" if self.problem else ""
        return f"{self.name:<{width}} {self.kind:<6} {str(self.shape):<14}{nums}  {verdict}{tail}"


@dataclass
class GradientReport:
    """What :func:`check_gradients` found: one :class:`TensorCheck` per floating-point input and
    parameter, layer-level ``problems`` (one line each: the forward or backward raised, the forward
    is not deterministic, the backward returned a name that is neither), and ``notes`` (why a
    reference was not used). ``passed`` is true when no problem was found and every tensor passed."""

    tensors: list = field(default_factory=list)
    problems: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems and all(t.passed for t in self.tensors)

    @property
    def failed(self) -> list:
        """Names of the tensors that failed."""
        return [t.name for t in self.tensors if not t.passed]

    def lines(self) -> list:
        """The printed report: a header, one line per tensor, the problems and notes, a verdict."""
        width = max([len(t.name) for t in self.tensors] + [6])
        out = [f"{'tensor':<{width}} {'kind':<6} {'shape':<14}{'largest diff':>12} {'bound':>10}  "
               f"{'reference':<12}  result"]
        out += [t.line(width) for t in self.tensors]
        out += [f"problem: {p}" for p in self.problems]
        out += [f"note: {n}" for n in self.notes]
        n_bad = len(self.failed)
        out.append("all gradients agree" if self.passed else
                   f"FAILED: {n_bad} of {len(self.tensors)} tensor(s)"
                   + (f", {len(self.problems)} problem(s)" if self.problems else ""))
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def check_gradients(forward, backward, inputs: dict, params: dict | None = None, *, seed: int = 0,
                    max_entries: int | None = None, complex_step: bool = True,
                    autograd: bool | None = None, file=None, quiet: bool = False) -> GradientReport:
    """Check a layer's hand-written backward, tensor by tensor, in float64; raises nothing on a
    failed check (the report says which tensor, and why).

    The scalar checked is ``L = Σ δ ∘ forward(inputs, params)[0]`` with ``δ`` drawn once (normal,
    ``seed``); the backward's ``backward(δ, cache)`` must equal ``∂L/∂x`` for every floating-point
    input and parameter ``x``. Per tensor (docs/EQUATIONS.md, "Checking a backward by numbers"):

    - *rounding of the forward* ``ρ``: the larger of ``(log₂ n + 2)·ε·Σ|δ||out|`` (the checked sum
      itself, ``n`` output entries) and 4σ, σ the noise of ``L`` measured along a random direction
      of the tensor from 6th-order differences of 7 evaluations (Moré & Wild's ECnoise);
    - *step* ``h``: ``(3ρ/M)^(1/3)``, which balances the truncation ``h²M/6`` against the rounding
      ``ρ/h``, ``M`` = ``|L‴|`` estimated by Richardson from ``D_h`` and ``D_2h`` on a few entries
      at a pilot step ``100·h₀``; clipped to ``[0.1, 10]·h₀``, ``h₀ = ε^(1/3)·max(1, max|x|)``;
    - *bound* ``max_i |D_2h,i − D_h,i| + 3ρ/h``: ``D_2h − D_h ≈ 3·(truncation of D_h)``, so the
      first term is ≥ 3× the truncation left in ``D_h`` (plus its rounding), the second 3× the
      rounding ``ρ/h`` of ``D_h``; the backward's own rounding (``~ ε|∂L/∂x|``) is far below both.

    A correct backward then differs from ``D_h`` by less than the bound; a wrong one by O(1) of the
    gradient (a sign, a transpose, an axis) -- or by 1e-4 relative, which the bound (~1e-9 of the
    gradient for smooth layers) still catches. Kinks (ReLU at 0) within ``2h`` of an example
    value make the differences meaningless: keep example values away from them.

    Sharper references, each used only where it agrees with central differences within the
    bound (else a note says why it was dropped): *complex step* ``Im L(x + i·h·e)/h`` when the
    forward accepts complex input (``complex_step``), and *autograd* -- ``torch.func.vjp`` of the
    forward called with float64 torch tensors -- when PyTorch is installed and the forward is
    array-API (``autograd``: ``None`` = when installed). The printed difference is against the
    sharpest reference used; the bound stays the derived one.

    Before any number the call checks the contract, each failure one line naming the tensor and
    what was expected: the forward raises or returns no ``(output, cache)``; two forwards on the
    same inputs differ (dropout left on); the backward raises, returns a wrong shape, misses or
    adds a name, returns NaN/inf, or returns another answer when called again on the same cache
    (an accumulation where a write belongs).

    Args:
        forward: ``(inputs, params) -> (output, cache)``; ``output`` a float array of any shape.
        backward: ``(delta, cache) -> (input_deltas, param_grads)``: dicts keyed like the
            floating-point ``inputs`` and ``params`` (integer inputs get none), arrays of their shapes.
        inputs, params: dicts ``name -> ndarray`` (the example; float32 is checked as float64 copies).
        seed: draws ``δ``, the noise direction and the entries sampled.
        max_entries: check at most this many entries per tensor (sampled); ``None``: all of them.
        complex_step, autograd: use those references (see above).
        file: where the report is printed (default stdout); quiet: print nothing.

    Returns:
        :class:`GradientReport` (``.passed``, ``.failed``, ``.tensors``, ``.problems``; ``str()``:
        the printed lines).

    Raises:
        TypeError: ``forward``/``backward`` not callable, ``inputs``/``params`` not dicts of arrays.
        ValueError: no floating-point input or parameter to check.
    """
    if not callable(forward) or not callable(backward):
        raise TypeError("check_gradients needs forward(inputs, params) and backward(delta, cache) functions")
    arrays = {"input": _as_arrays(inputs, "inputs"), "param": _as_arrays(params or {}, "params")}
    checked = [(kind, name) for kind in arrays for name, a in arrays[kind].items() if a.dtype.kind == "f"]
    if not checked:
        raise ValueError("nothing to check: inputs and params hold no floating-point array")
    rng = np.random.default_rng(seed)
    report = _check(forward, backward, arrays, checked, rng, max_entries, complex_step, autograd)
    if not quiet:
        print(report, file=file or sys.stdout)
    return report


def load_layer(path) -> tuple:
    """``(inputs, params, forward, backward)`` of a layer module: a Python file defining
    ``example() -> (inputs, params)`` (dicts of name -> ndarray), ``forward(inputs, params) ->
    (output, cache)`` and ``backward(delta, cache) -> (input_deltas, param_grads)``. The file runs
    as a module of its own (``import``-ed by path, not installed); ``example()`` is called once.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a ``.py`` file, the module raised on import or in ``example()``, it lacks
            one of :data:`LAYER_FUNCTIONS` (the message names which), or ``example()`` returned
            something else than two dicts.
    """
    from ..model.slots import import_file

    module = import_file(path)
    missing = [f"{n}()" for n in LAYER_FUNCTIONS if not callable(getattr(module, n, None))]
    if missing:
        raise ValueError(f"{path} defines no {', '.join(missing)}: a layer module defines example() -> (inputs, "
                         "params), forward(inputs, params) -> (output, cache) and backward(delta, cache) -> "
                         "(input_deltas, param_grads) (docs/guide.md, \"Check your own layer\")")
    try:
        example = module.example()
    except Exception as exc:
        raise ValueError(f"{path}: example() raised {_one_line(exc)}") from exc
    if not (isinstance(example, tuple) and len(example) == 2 and all(isinstance(d, dict) for d in example)):
        raise ValueError(f"{path}: example() must return (inputs, params), two dicts of name -> ndarray; "
                         f"got {type(example).__name__}")
    return example[0], example[1], module.forward, module.backward


def _as_arrays(values, what: str) -> dict:
    if not isinstance(values, dict):
        raise TypeError(f"{what} must be a dict of name -> ndarray, got {type(values).__name__}")
    out = {}
    for name, a in values.items():
        if isinstance(a, tuple) and all(isinstance(n, int) for n in a):     # a shape, not an example
            raise TypeError(f"{what}[{name!r}] is the tuple {a}; check_gradients takes example arrays, e.g. "
                            f"np.random.default_rng(0).standard_normal({a})")
        a = np.array(a)
        if a.dtype.kind not in "fiub":
            raise TypeError(f"{what}[{name!r}] must be a float or integer array, got dtype {a.dtype}")
        out[name] = a.astype(np.float64) if a.dtype.kind == "f" else a
    return out


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _check(forward, backward, arrays, checked, rng, max_entries, complex_step, autograd) -> GradientReport:
    report = GradientReport(tensors=[TensorCheck(name, kind, arrays[kind][name].shape) for kind, name in checked])
    by_key = {(t.kind, t.name): t for t in report.tensors}

    def run(ins, prm):
        result = forward(ins, prm)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise _ContractError(f"forward must return (output, cache), got {type(result).__name__}")
        return result

    try:                                       # the second call's cache is the one differentiated
        out_a = np.array(run(dict(arrays["input"]), dict(arrays["param"]))[0], dtype=np.float64)
        out, cache = run(dict(arrays["input"]), dict(arrays["param"]))
        out = np.array(out, dtype=np.float64)
    except Exception as exc:
        report.problems.append(f"forward raised {_one_line(exc)}" if not isinstance(exc, _ContractError)
                               else str(exc))
        return report
    if not np.isfinite(out).all():
        report.problems.append(f"forward returned {_bad_count(out)} on the example: no gradient to check")
        return report
    scale = float(np.max(np.abs(out))) if out.size else 0.0
    change = float(np.max(np.abs(out - out_a))) if out.size else 0.0
    if not change <= REPEAT_ULPS * EPS * scale:
        report.problems.append(f"forward is not deterministic: two calls on the same inputs differ by up "
                               f"to {change:.1e} (expected the same output): dropout or a random draw left on?")
        return report

    delta = rng.standard_normal(out.shape)
    try:
        first = _call_backward(backward, delta, cache, copy=True)
        second = _call_backward(backward, delta, cache, copy=False)
    except Exception as exc:
        report.problems.append(f"backward raised {_one_line(exc)}" if not isinstance(exc, _ContractError)
                               else str(exc))
        return report

    analytic = {}
    for kind, returned in zip(("input", "param"), first):
        expected = {n for k, n in checked if k == kind}
        others = set(arrays[kind]) - expected                   # integer inputs: no delta expected
        for name in sorted(set(returned) - expected - others, key=str):
            report.problems.append(f"backward returned a {kind} gradient {name!r}, but {kind}s has no floating-"
                                   f"point {name!r} (it has: {', '.join(sorted(map(str, expected))) or 'none'})")
        for name in expected:
            t, g = by_key[kind, name], returned.get(name)
            g2 = second[0 if kind == "input" else 1].get(name)
            t.problem = _contract_problem(t, g, g2)
            if t.problem is None:
                analytic[kind, name] = g

    def loss(kind, name, x):
        ins, prm = dict(arrays["input"]), dict(arrays["param"])
        (ins if kind == "input" else prm)[name] = x
        return float(np.sum(delta * np.asarray(forward(ins, prm)[0], dtype=np.float64)))

    as_complex = _complex_forward(forward, arrays, report.notes) if complex_step else None
    torch_grads = _autograd_grads(forward, arrays, checked, delta, autograd, report.notes)
    rounding_of_sum = (math.log2(max(out.size, 1)) + 2) * EPS * float(np.sum(np.abs(delta * out)))
    for (kind, name), g in analytic.items():
        t = by_key[kind, name]
        x = arrays[kind][name].copy()
        entries = list(np.ndindex(x.shape))
        if max_entries is not None and len(entries) > max_entries:
            entries = [entries[i] for i in np.sort(rng.choice(len(entries), max_entries, replace=False))]
        if not entries:                                      # an empty tensor: nothing can be wrong
            t.passed, t.max_diff, t.bound, t.method = True, 0.0, 0.0, "-"
            continue
        f = lambda z, kind=kind, name=name: loss(kind, name, z)          # noqa: E731
        s = max(1.0, float(np.max(np.abs(x))))
        try:
            rho = max(rounding_of_sum, 4 * _noise(f, x, 1e-9 * s, rng))
            h = _choose_step(f, x, entries, rho, s, rng)
            d_h, d_2h = _central(f, x, entries, h), _central(f, x, entries, 2 * h)
        except Exception as exc:
            t.problem = f"forward raised {_one_line(exc)} near the example (a step of ~1e-5 in {name})"
            continue
        t.step, t.bound = h, float(np.max(np.abs(d_2h - d_h))) + 3 * rho / h
        if not math.isfinite(t.bound):
            t.problem = f"the forward is not finite within a step of {h:.1e} in {name} around the example"
            continue
        idx = tuple(np.array(entries).T) if x.ndim else ()
        refs = {"central": d_h}                              # sharper references, if they agree with it
        if as_complex is not None:
            try:
                refs["complex step"] = _complex_grad(forward, as_complex, kind, name, entries, delta, s)
            except Exception as exc:
                report.notes.append(f"{name}: complex step not used ({_one_line(exc)})")
        if torch_grads is not None:
            refs["autograd"] = torch_grads[kind, name][idx]
        for method, ref in list(refs.items())[1:]:
            off = float(np.max(np.abs(ref - d_h)))
            if not off <= t.bound:
                del refs[method]
                report.notes.append(f"{name}: {method} disagrees with central differences by {off:.1e} > "
                                    f"{t.bound:.1e} (not analytic / not array-API there); not used")
        ga = np.asarray(g, dtype=np.float64)[idx]
        diffs = {m: float(np.max(np.abs(ga - r))) for m, r in refs.items()}
        t.method = list(refs)[-1]
        t.max_diff = diffs[t.method]
        bad = [m for m, d in diffs.items() if not d <= t.bound]
        t.passed = not bad
        if bad:
            worst = t.method if t.method in bad else bad[0]
            t.problem = (f"differs from {worst} by {diffs[worst]:.2e} > bound {t.bound:.2e} "
                         f"(the gradient by {worst} is up to {float(np.max(np.abs(refs[worst]))):.2e})")
            if np.asarray(g).dtype.kind == "f" and np.asarray(g).dtype.itemsize < 8:
                t.problem += (f"; backward returned {np.asarray(g).dtype} where the check runs in float64: "
                              "return float64 arrays (a float32 constant or buffer rounds to 1e-7)")
    return report


class _ContractError(Exception):
    """A forward or backward that returns the wrong kind of thing (its message is the diagnosis)."""


def _call_backward(backward, delta, cache, copy: bool):
    result = backward(delta.copy(), cache)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise _ContractError(f"backward must return (input_deltas, param_grads), got {type(result).__name__}")
    out = []
    for what, d in zip(("input_deltas", "param_grads"), result):
        d = {} if d is None else d
        if not isinstance(d, dict):
            raise _ContractError(f"backward must return {what} as a dict of name -> ndarray, got {type(d).__name__}")
        out.append({k: (None if v is None else np.array(v) if copy else np.asarray(v)) for k, v in d.items()})
    return out


def _bad_count(a: np.ndarray) -> str:
    n_nan = int(np.count_nonzero(np.isnan(a)))
    n_inf = int(np.count_nonzero(np.isinf(a)))
    return f"{n_nan} NaN, {n_inf} inf of {a.size} values"


def _contract_problem(t: TensorCheck, g, g2) -> str | None:
    """One line when the backward's array for tensor ``t`` breaks the contract, else ``None``."""
    where = "input_deltas" if t.kind == "input" else "param_grads"
    if g is None:
        return f"backward returned no {where}[{t.name!r}] (expected an array of shape {t.shape})"
    if g.dtype.kind not in "fiu":
        return f"backward returned dtype {g.dtype} (expected a real float array of shape {t.shape})"
    if g.shape != t.shape:
        hint = " -- a missing transpose?" if g.shape == t.shape[::-1] and len(t.shape) > 1 else ""
        return f"backward returned shape {g.shape}, expected {t.shape}{hint}"
    g = g.astype(np.float64)
    if not np.isfinite(g).all():
        return f"backward returned {_bad_count(g)}"
    g2 = None if g2 is None else np.asarray(g2, dtype=np.float64)
    if g2 is None or g2.shape != g.shape:
        return "a second backward on the same cache returned another shape or nothing"
    change = float(np.max(np.abs(g2 - g))) if g.size else 0.0
    if not change <= REPEAT_ULPS * EPS * float(np.max(np.abs(g)) if g.size else 0.0):
        return (f"a second backward on the same cache returned another answer (differs by up to {change:.1e}; "
                f"expected the same): an accumulation (+=) where a write (=) belongs?")
    return None


def _central(f, x: np.ndarray, entries, h: float) -> np.ndarray:
    """``(f(x + h e_i) − f(x − h e_i)) / (x_i⁺ − x_i⁻)`` for each entry (``x`` restored); the
    divisor is the step actually taken after ``x_i ± h`` is rounded."""
    out = np.empty(len(entries))
    for j, i in enumerate(entries):
        old = x[i]
        up, down = old + h, old - h
        x[i] = up
        f_up = f(x)
        x[i] = down
        f_down = f(x)
        x[i] = old
        out[j] = (f_up - f_down) / (up - down)
    return out


def _noise(f, x: np.ndarray, size: float, rng) -> float:
    """σ, the rounding noise of ``f`` near ``x`` (Moré & Wild 2011, ECnoise): ``f`` at 7 points
    ``x + k·u`` (``u`` random, entries ~ ``size``), whose 3rd…6th differences are all noise (the
    smooth part of a k-th difference is ~ size^k); ``σ_k² = (k!)²/(2k)! · mean(Δ^k f)²``."""
    u = rng.standard_normal(x.shape) * size
    values = np.array([f(x + k * u) for k in range(7)])
    return max(math.sqrt(math.factorial(k) ** 2 / math.factorial(2 * k) * float(np.mean(np.diff(values, k) ** 2)))
               for k in range(3, 7))


def _choose_step(f, x, entries, rho: float, s: float, rng) -> float:
    """``h = (3ρ/M)^(1/3)`` (module docstring), ``M ≈ |L‴|`` from Richardson on a few entries at
    the pilot step ``100·h₀``, where the truncation ``~ (100h₀)²M/2`` stands well above the
    rounding ``1.5ρ/(100h₀)`` (at ``h₀`` itself it is mostly below it)."""
    h0 = BASE_STEP * s
    hp = 100 * h0
    pilot = [entries[i] for i in rng.choice(len(entries), min(PILOT_ENTRIES, len(entries)), replace=False)]
    gap = np.abs(_central(f, x, pilot, 2 * hp) - _central(f, x, pilot, hp))    # ≈ 3·hp²·M/6 ± 1.5ρ/hp
    m = 2 * max(0.0, float(np.max(gap)) - 1.5 * rho / hp) / hp ** 2
    h = (3 * rho / m) ** (1 / 3) if m > 0 else 10 * h0
    return float(min(max(h, h0 / 10), 10 * h0))


def _complex_forward(forward, arrays, notes):
    """``(inputs, params)`` as complex128 when the forward takes them and returns a finite complex
    array; else ``None`` and a note saying why."""
    cplx = {kind: {n: (a.astype(np.complex128) if a.dtype.kind == "f" else a) for n, a in d.items()}
            for kind, d in arrays.items()}
    try:
        out = np.asarray(forward(dict(cplx["input"]), dict(cplx["param"]))[0])
    except Exception as exc:
        notes.append(f"complex step not used: the forward does not take complex input ({_one_line(exc)})")
        return None
    if not np.iscomplexobj(out) or not np.isfinite(out).all():
        notes.append("complex step not used: the forward does not return a finite complex output for complex input")
        return None
    return cplx


def _complex_grad(forward, cplx, kind, name, entries, delta, s: float) -> np.ndarray:
    """``Im L(x + i·h·e_i) / h`` for each entry, ``h = COMPLEX_STEP · s`` (its truncation,
    ``h²|L‴|/6``, is ~1e-40 of the gradient; no difference is taken, so nothing cancels)."""
    x = cplx[kind][name].copy()
    h = COMPLEX_STEP * s
    ins, prm = dict(cplx["input"]), dict(cplx["param"])
    (ins if kind == "input" else prm)[name] = x
    out = np.empty(len(entries))
    for j, i in enumerate(entries):
        old = x[i]
        x[i] = old + 1j * h
        out[j] = float(np.sum(delta * np.asarray(forward(ins, prm)[0])).imag) / h
        x[i] = old
    return out


def _autograd_grads(forward, arrays, checked, delta, autograd, notes):
    """``{(kind, name): ∂L/∂x}`` by ``torch.func.vjp`` of the forward called with float64 torch
    tensors, or ``None`` (with a note) when PyTorch is missing or the forward is not array-API."""
    if autograd is False:
        return None
    try:
        import torch
        from torch.func import vjp
    except ImportError:
        if autograd:
            notes.append("autograd not used: PyTorch is not installed")
        return None
    fixed = {kind: {n: torch.as_tensor(a) for n, a in d.items()} for kind, d in arrays.items()}

    def fn(*tensors):
        ins, prm = dict(fixed["input"]), dict(fixed["param"])
        for (kind, name), tensor in zip(checked, tensors):
            (ins if kind == "input" else prm)[name] = tensor
        out = forward(ins, prm)[0]
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"the forward returned {type(out).__name__} for torch input (not array-API)")
        return out

    try:
        out, pullback = vjp(fn, *(fixed[kind][name] for kind, name in checked))
        grads = pullback(torch.as_tensor(delta, dtype=out.dtype))
        return {key: g.detach().cpu().numpy().astype(np.float64) for key, g in zip(checked, grads)}
    except Exception as exc:
        notes.append(f"autograd not used: the forward did not run on torch tensors ({_one_line(exc)})")
        return None
