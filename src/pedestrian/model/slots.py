"""The GPT's slots: its norm, its MLP's activation and its MLP, each built in or plugged in.

Architecture as configuration: the chain of :mod:`pedestrian.model.gpt` calls every norm, every
activation and every MLP through one object per slot, ``model.slots.norm`` / ``.activation`` /
``.mlp``, whatever fills it -- the built-in kinds the config names (layer norm or RMS norm;
GELU, …; expand-g-contract or SwiGLU) or a layer of your own, a plain NumPy module (docs/guide.md,
"Plugging your own layer into the GPT")::

    SLOT = "norm"                   # optional: the slot it is meant for
    def init(d_model, d_mlp):       # -> {name: float64 array}: the parameters of ONE instance
    def forward(inputs, params):    # inputs = {"x": (B, T, width)} -> (y (B, T, width), cache)
    def backward(delta, cache):     # -> ({"x": dx}, {name: grad for every name init returned})

What flows through each slot (``width`` = ``d_model`` unless said), and its parameters' names:

- ``norm``: every norm -- ``a2 = LN1(x)``, ``a6 = LN2(a5)``, ``a11 = LN_final(a10)`` (and the
  norms after the sublayers, ``config.norm_placement``); ``blocks.{i}.ln1.<name>``,
  ``blocks.{i}.ln2.<name>`` (``ln1_post``, ``ln2_post``), ``ln_final.<name>`` -- not the q/k
  norms of the attention's prelude, which are RMS norms of other widths;
- ``activation``: the MLP's ``g``, ``a8 = g(a7)``, width ``d_mlp``; ``blocks.{i}.act.<name>``
  (only with ``config.mlp == "standard"``);
- ``mlp``: the whole MLP ``a6 → a9`` (no ``a7``, ``a8`` then); ``blocks.{i}.mlp.<name>``.

A plugged layer's parameters sit in the model's flat buffers beside the built-in ones (2-D and
larger ones decayed), in the model's dtype; its forward gets the model's arrays (float32 for a
float32 model) as read-only views, and what it returns is checked -- shape, a real dtype (cast
to the model's), finite values -- each failure one :class:`LayerError` line naming the
slot, the place and what was expected. Its backward must write (return) a gradient for every
parameter; the model copies them into its gradient buffer.
"""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..config import GPTConfig
from .layout import ParamSpec, param_specs

__all__ = ["SLOTS", "LAYER_FUNCTIONS", "LayerError", "Slots", "Plugged", "Instance", "load_layer",
           "layer_from_source", "import_file"]

#: the slots a layer can fill, in the order of the chain
SLOTS = ("norm", "activation", "mlp")
#: what a plugged layer module defines (``example()`` too, for ``pedestrian check``)
LAYER_FUNCTIONS = ("init", "forward", "backward")
_CONTRACT = ("a layer module defines init(d_model, d_mlp) -> {name: array}, forward(inputs, params) -> "
             "(y, cache) and backward(delta, cache) -> ({'x': dx}, {name: grad}) (docs/guide.md, "
             "\"Plugging your own layer into the GPT\")")


class LayerError(ValueError):
    """A plugged layer broke its contract while the model ran it (one line: slot, place, tensor,
    what was expected)."""


class Instance(NamedTuple):
    """A plugged layer at one place of the model: ``where`` (``"blocks.0.ln1"``), and ``params``
    (``name -> array``: the parameters' views, or in a gradient table the gradients', ``None``
    when frozen)."""

    where: str
    params: dict


# ---------------------------------------------------------------------------------------- loading
def import_file(path) -> types.ModuleType:
    """Run the Python file ``path`` as a module of its own (imported by path, not installed).

    Raises:
        FileNotFoundError: no such file. ValueError: not a ``.py`` file, or it raised on import.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no layer module {path}" + (" (a directory)" if path.is_dir() else ""))
    spec = importlib.util.spec_from_file_location(f"pedestrian_layer_{path.stem}", path)
    if path.suffix != ".py" or spec is None:
        raise ValueError(f"{path} is not a Python file (.py)")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ValueError(f"{path} raised {_one_line(exc)} when imported") from exc
    return module


def load_layer(path) -> types.ModuleType:
    """The layer module in the file ``path``, ready to plug: ``GPT(config, layers={"norm": load_layer(p)})``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a ``.py`` file, the module raised on import, or it lacks one of
            :data:`LAYER_FUNCTIONS` (the message names which, and the contract).
    """
    module = import_file(path)
    _require_functions(module, str(path))
    module.__pedestrian_source__ = (str(path), Path(path).read_text(encoding="utf-8"))
    return module


def layer_from_source(source: str, path: str) -> types.ModuleType:
    """The layer module whose text is ``source`` (recorded in a checkpoint; ``path`` is where it
    came from, for messages and tracebacks). Loading a checkpoint that records plugged layers runs
    their code: load only checkpoints you trust, as with any Python file.

    Raises:
        ValueError: the code raised when run, or lacks one of :data:`LAYER_FUNCTIONS`.
    """
    module = types.ModuleType(f"pedestrian_layer_{Path(path).stem}")
    module.__file__ = path
    try:
        exec(compile(source, path, "exec"), module.__dict__)
    except Exception as exc:
        raise ValueError(f"the plugged layer recorded from {path} raised {_one_line(exc)} when run") from exc
    _require_functions(module, path)
    module.__pedestrian_source__ = (path, source)
    return module


def _require_functions(module, what: str) -> None:
    missing = [f"{n}()" for n in LAYER_FUNCTIONS if not callable(getattr(module, n, None))]
    if missing:
        raise ValueError(f"{what} defines no {', '.join(missing)}: {_CONTRACT}")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# ---------------------------------------------------------------------------------------- a plugged layer
class Plugged:
    """A user's layer in a slot: its module, where it came from, its parameters' shapes, and its
    forward and backward as the chain calls them (checked; see the module docstring).

    Args:
        slot: one of :data:`SLOTS`. module: the layer (a module or any object with
            :data:`LAYER_FUNCTIONS`).
        config: the model's config (``init`` gets its ``d_model``, ``d_mlp``); dtype: the model's.

    Attributes:
        path, source: the file and its text (of :func:`load_layer`, :func:`layer_from_source`, or
            the ``.py`` file an imported module came from; ``None`` for an object of another kind:
            such a model cannot be checkpointed).
        shapes: ``{name: shape}`` of one instance's parameters (from a first ``init`` call).

    Raises:
        ValueError: missing functions, an ``init`` that raises or returns something else than
            ``{name: finite float array}`` with names free of ``"."``.
    """

    def __init__(self, slot: str, module, config: GPTConfig, dtype):
        self.module = module
        self.path, self.source = getattr(module, "__pedestrian_source__", None) or _file_source(module)
        self.label = f"{slot} slot ({Path(self.path).name if self.path else getattr(module, '__name__', 'layer')})"
        _require_functions(module, self.label)
        self.slot, self.config, self.dtype = slot, config, np.dtype(dtype)
        self.shapes = {name: a.shape for name, a in self.initial().items()}

    def initial(self) -> dict:
        """``{name: float64 array}``: ``init(d_model, d_mlp)`` of one instance, checked."""
        try:
            values = self.module.init(self.config.d_model, self.config.d_mlp)
        except Exception as exc:
            raise ValueError(f"{self.label}: init(d_model, d_mlp) raised {_one_line(exc)}") from exc
        if not isinstance(values, dict):
            raise ValueError(f"{self.label}: init(d_model, d_mlp) must return a dict name -> array, got "
                             f"{type(values).__name__}")
        out = {}
        for name, a in values.items():
            a = np.asarray(a)
            if not isinstance(name, str) or not name or "." in name:
                raise ValueError(f"{self.label}: init() parameter name {name!r} must be a non-empty string "
                                 "without '.' (it becomes e.g. blocks.0.ln1.<name>)")
            if a.dtype.kind not in "fiu" or not np.all(np.isfinite(a)):
                raise ValueError(f"{self.label}: init() parameter {name!r} must hold finite real numbers, got "
                                 f"dtype {a.dtype}")
            out[name] = a.astype(np.float64)
        if getattr(self, "shapes", None) not in (None, {n: a.shape for n, a in out.items()}):
            raise ValueError(f"{self.label}: init() returned other names or shapes on a second call")
        return out

    def forward(self, x, w: Instance):
        """``(y, cache)`` of the layer on ``x`` ``(B, T, width)`` with the parameters of ``w``."""
        params = {n: _read_only(a) for n, a in w.params.items()}
        try:
            out = self.module.forward({"x": _read_only(x)}, params)
        except LayerError:
            raise
        except Exception as exc:
            raise LayerError(f"{self.label} at {w.where}: forward raised {_one_line(exc)}") from exc
        if not (isinstance(out, tuple) and len(out) == 2):
            raise LayerError(f"{self.label} at {w.where}: forward must return (output, cache), got "
                             f"{type(out).__name__}")
        return self._checked(out[0], x, f"{w.where} output"), out[1]

    def backward(self, delta, cache, g: Instance | None):
        """``Δ_in`` for ``delta``; writes the parameters' gradients into ``g``'s arrays (``None``
        arrays: frozen, not written)."""
        where = g.where if g is not None else self.slot
        try:
            out = self.module.backward(_read_only(delta), cache)
        except Exception as exc:
            raise LayerError(f"{self.label} at {where}: backward raised {_one_line(exc)}") from exc
        if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(d, dict) for d in out)):
            raise LayerError(f"{self.label} at {where}: backward must return ({{'x': dx}}, {{name: grad}}), "
                             f"got {type(out).__name__}")
        deltas, grads = out
        if "x" not in deltas:
            raise LayerError(f"{self.label} at {where}: backward returned no input delta 'x'; return "
                             "({'x': dx}, param_grads)")
        missing, extra = sorted(set(self.shapes) - set(grads)), sorted(set(grads) - set(self.shapes))
        if missing or extra:
            raise LayerError(f"{self.label} at {where}: backward returned gradients for {sorted(grads)}, expected "
                             f"one for every parameter init() made, {sorted(self.shapes)}"
                             + (f"; add {missing}" if missing else f"; remove {extra}"))
        for name, grad in grads.items():
            target = None if g is None else g.params.get(name)
            if target is not None:
                target[...] = self._checked(grad, target, f"{where}.{name} gradient")
        return self._checked(deltas["x"], delta, f"{where} input delta 'x'")

    def add_forward(self, x, r, w: Instance):
        """``((s, y), cache)``: the skip ``s = x + r``, then this layer on it (in the norm slot)."""
        s = x + r
        y, cache = self.forward(s, w)
        return (s, y), cache

    def add_backward(self, delta, cache, delta_skip, g: Instance | None):
        """``Δ_skip + Δ_in``: the signal at the skip's output that also feeds this layer."""
        return delta_skip + self.backward(delta, cache, g)

    def _checked(self, a, like, what: str):
        """``a`` as a C-contiguous array of the model's dtype with ``like``'s shape and finite values."""
        if not isinstance(a, np.ndarray) and not np.isscalar(a):
            raise LayerError(f"{self.label}: {what} must be a NumPy array, got {type(a).__name__}")
        a = np.asarray(a)
        if tuple(a.shape) != tuple(like.shape):
            raise LayerError(f"{self.label}: {what} has shape {tuple(a.shape)}, expected {tuple(like.shape)}")
        if a.dtype.kind not in "fiu":
            raise LayerError(f"{self.label}: {what} has dtype {a.dtype}, expected real numbers "
                             f"({self.dtype.name}, the model's dtype)")
        if not np.all(np.isfinite(a)):
            raise LayerError(f"{self.label}: {what} holds {int(np.sum(np.isnan(a)))} NaN and "
                             f"{int(np.sum(np.isinf(a)))} inf values, expected finite numbers")
        return np.asarray(a, dtype=self.dtype, order="C")

    def record(self) -> dict:
        """``{"slot", "path", "source"}``: what a checkpoint keeps to rebuild it.

        Raises:
            ValueError: a module given as an object, not loaded from a file (no source to record).
        """
        if self.source is None:
            raise ValueError(f"{self.label}: a checkpoint records a plugged layer's source file; plug it as "
                             "pedestrian.load_layer(path) or a path, not as an object without a .py file")
        return {"slot": self.slot, "path": self.path, "source": self.source}


def _file_source(module) -> tuple:
    """``(path, text)`` of the ``.py`` file a module was imported from, else ``(None, None)``."""
    file = getattr(module, "__file__", None)
    if isinstance(file, str) and file.endswith(".py") and Path(file).is_file():
        return file, Path(file).read_text(encoding="utf-8")
    return None, None


def _read_only(a):
    if a is None or not isinstance(a, np.ndarray):
        return a
    view = a.view()
    view.flags.writeable = False
    return view


# ---------------------------------------------------------------------------------------- the built-in kinds
class BuiltinNorm:
    """The config's norm: layer norm (weight, bias) or RMS norm (weight only), paper section 5."""

    def __init__(self, config: GPTConfig, kernels):
        self.K, self.rms, self.eps = kernels, config.norm == "rmsnorm", config.ln_eps

    def forward(self, x, w):
        if self.rms:
            return self.K.rmsnorm_forward(x, w.weight, self.eps)
        return self.K.layernorm_forward(x, w.weight, w.bias, self.eps)

    def backward(self, delta, cache, g):
        """Writes ``g``'s arrays (``None``: frozen)."""
        if self.rms:
            return self.K.rmsnorm_backward(delta, cache, dweight=g.weight)
        return self.K.layernorm_backward(delta, cache, dweight=g.weight, dbias=g.bias)

    def add_forward(self, x, r, w):
        """``((s, y), cache)``: the skip ``s = x + r`` and the norm of it, one kernel call."""
        if self.rms:
            return self.K.add_rmsnorm_forward(x, r, w.weight, self.eps)
        return self.K.add_layernorm_forward(x, r, w.weight, w.bias, self.eps)

    def add_backward(self, delta, cache, delta_skip, g):
        """``Δ_skip + normᵀ(Δ)``, the signal at a skip's output that feeds this norm; writes ``g``'s arrays."""
        if self.rms:
            return self.K.add_rmsnorm_backward(delta, cache, delta_skip, dweight=g.weight)
        return self.K.add_layernorm_backward(delta, cache, delta_skip, dweight=g.weight, dbias=g.bias)


class BuiltinActivation:
    """The config's activation ``g`` (:data:`pedestrian.layers.activations.ACTIVATIONS`); no parameters."""

    def __init__(self, config: GPTConfig, kernels):
        self.K, self.name = kernels, config.activation

    def forward(self, x, w=None):
        return self.K.activation_forward(x, self.name)

    def backward(self, delta, cache, g=None):
        return self.K.activation_backward(delta, cache, self.name)


class BuiltinMLP:
    """``a7 = FC_expand(a6)``, ``a8 = g(a7)`` (the activation slot), ``a9 = FC_contract(a8)``; or
    SwiGLU's ``a8 = silu(FC_gate(a6)) ∘ FC_up(a6)``, ``a9 = FC_down(a8)``, the gate and up layers
    one fused product (``mlp_gate_up``, as ``qkv``: ``a7_gate``, ``a7_up`` are the halves of its
    output, ``Δ6 = [Δ7_gate | Δ7_up] W_gate_upᵀ``). Keeps ``a7`` (or
    ``a7_gate``, ``a7_up``) and ``a8`` on the block ``b``, and ``Δ8``, ``Δ7`` on ``D``; the backward
    makes ``a8`` again from ``a7`` where the forward let it go (``b.a8 = None``, model.recompute).

    ``forward(fc, b, w, lora) -> a9`` and ``backward(fc, D, b, w, g, lora) -> Δ6`` (from ``D.d9``)
    take the model's fully connected layer (forward or backward, LoRA adapters included) as ``fc``,
    the block's activations ``b`` (or signals ``D``), its weights ``w`` and gradients ``g``."""

    def __init__(self, config: GPTConfig, kernels, activation):
        self.K, self.swiglu, self.activation = kernels, config.mlp == "swiglu", activation

    def forward(self, fc, b, w, lora):
        if self.swiglu:                                                              # one product, both layers:
            a7 = fc(w.mlp_gate_up, b.a6, lora)                                       # (B, T, 2·d_mlp)
            m = a7.shape[-1] // 2
            b.a7_gate, b.a7_up = a7[..., :m], a7[..., m:]                            # (B, T, d_mlp) views
            b.a8, b.act = self.K.swiglu_forward(b.a7_gate, b.a7_up)                  # silu(gate) ∘ up
        elif self._fused(w.mlp_expand):                                              # a7 = a6 W + b, a8 = g(a7),
            (b.a7, b.a8), b.act = self.K.linear_activation_forward(                  # one call (B, T, d_mlp)
                b.a6, w.mlp_expand.weight, w.mlp_expand.bias, self.activation.name)
        else:
            b.a7 = fc(w.mlp_expand, b.a6, lora)                                      # (B, T, d_mlp)
            b.a8, b.act = self.activation.forward(b.a7, w.act)                       # g
        return fc(w.mlp_contract, b.a8, lora)                                        # (B, T, d)

    def _fused(self, expand) -> bool:
        """Whether the expand layer and the activation run as one kernel call: a built-in
        activation, and no LoRA adapter on the layer (its branch is added after the bias, before
        ``g``: the two calls keep that order)."""
        return isinstance(self.activation, BuiltinActivation) and not expand.adapters

    def backward(self, fc, D, b, w, g, lora):
        if b.a8 is None:                                                             # let go by the forward
            b.a8 = (self.K.swiglu_forward(b.a7_gate, b.a7_up) if self.swiglu         # (model.recompute): again
                    else self.activation.forward(b.a7, w.act))[0]
        D.d8 = fc(w.mlp_contract, g.mlp_contract, D.d9, b.a8, lora)                  # Δ8
        if not self.swiglu and self._fused(w.mlp_expand):                            # Δ7, dW, db, Δ6: one call
            d6, D.d7 = self.K.linear_activation_backward(D.d8, b.act, w.mlp_expand.weight, self.activation.name,
                                                         dweight=g.mlp_expand.weight, dbias=g.mlp_expand.bias)
            return d6
        if not self.swiglu:
            D.d7 = self.activation.backward(D.d8, b.act, g.act)                      # Δ7
            return fc(w.mlp_expand, g.mlp_expand, D.d7, b.a6, lora)                  # Δ6
        d7 = self.K.swiglu_backward(D.d8, b.act, fused=True)                         # [Δ7_gate | Δ7_up]
        m = d7.shape[-1] // 2
        D.d7_gate, D.d7_up = d7[..., :m], d7[..., m:]                                # (B, T, d_mlp) views
        return fc(w.mlp_gate_up, g.mlp_gate_up, d7, b.a6, lora)                      # Δ6: both paths, one product


class PluggedMLP:
    """A plugged layer as the whole MLP, ``a9 = mlp(a6)`` (its cache kept as ``b.mlp``)."""

    def __init__(self, layer: Plugged):
        self.layer = layer

    def forward(self, fc, b, w, lora):
        y, b.mlp = self.layer.forward(b.a6, w.mlp)
        return y

    def backward(self, fc, D, b, w, g, lora):
        return self.layer.backward(D.d9, b.mlp, g.mlp)


# ---------------------------------------------------------------------------------------- the table
class Slots:
    """What fills a model's slots: ``norm``, ``activation``, ``mlp`` (objects with ``forward`` and
    ``backward``, see the classes above), and the plugged layers among them.

    Args:
        config: the model's config; kernels: its kernel table; dtype: its dtype.
        layers: ``{slot: module or path}`` (``None`` or ``{}``: every slot built in).

    Attributes:
        plugged: ``{slot: Plugged}``.

    Raises:
        ValueError: an unknown slot; ``activation`` with ``config.mlp == "swiglu"`` (SwiGLU gates with
            silu) or together with ``mlp``; a module's ``SLOT`` naming another slot; the module
            problems of :class:`Plugged`.
    """

    def __init__(self, config: GPTConfig, kernels, dtype, layers: dict | None = None):
        layers = dict(layers or {})
        for slot, module in layers.items():
            if slot not in SLOTS:
                raise ValueError(f"unknown layer slot {slot!r}; plug a layer into one of {SLOTS}")
            if isinstance(module, (str, Path)):
                layers[slot] = module = load_layer(module)
            meant = getattr(module, "SLOT", slot)
            if meant != slot:
                raise ValueError(f"the layer plugged into the {slot} slot says SLOT = {meant!r}; plug it into "
                                 f"{meant!r}, or change its SLOT")
        if "activation" in layers and config.mlp == "swiglu":
            raise ValueError("the activation slot needs mlp='standard' (SwiGLU gates with silu); use "
                             "mlp='standard', or plug your layer into the mlp slot")
        if "mlp" in layers and config.n_experts:
            raise ValueError(f"the mlp slot replaces the whole MLP, and this config has n_experts="
                             f"{config.n_experts} (a mixture of experts); plug norm only, or set n_experts=0")
        if "activation" in layers and "mlp" in layers:
            raise ValueError("the mlp slot replaces the whole MLP, its activation included; plug either "
                             "activation or mlp")
        self.config = config
        self.plugged = {slot: Plugged(slot, m, config, dtype) for slot, m in layers.items()}
        self.norm = self.plugged.get("norm") or BuiltinNorm(config, kernels)
        self.activation = self.plugged.get("activation") or BuiltinActivation(config, kernels)
        self.mlp = PluggedMLP(self.plugged["mlp"]) if "mlp" in self.plugged else (
            BuiltinMLP(config, kernels, self.activation))
        if config.n_experts:                               # the dense MLP only in the blocks without experts
            from .moe import MoEMLP

            self.mlp = MoEMLP(config, kernels, self.mlp)

    def specs(self) -> list[ParamSpec]:
        """Every parameter in order: :func:`pedestrian.model.layout.param_specs`, each plugged slot's
        instances in place of the built-in layers they replace (an activation's before
        ``mlp_contract``), kind ``"plugged"``, decayed when 2-D or larger."""
        out, done = [], set()
        for s in param_specs(self.config):
            slot, where = _owner(s.name)
            if slot == "mlp" and "activation" in self.plugged and ".mlp_contract." in s.name and where not in done:
                done.add(where)
                out += self._instance_specs("activation", where.replace(".mlp", ".act"))
            if slot not in self.plugged:
                out.append(s)
            elif where not in done:
                done.add(where)
                out += self._instance_specs(slot, where)
        return out

    def _instance_specs(self, slot: str, where: str) -> list[ParamSpec]:
        return [ParamSpec(f"{where}.{n}", tuple(shape), "plugged", len(shape) >= 2)
                for n, shape in self.plugged[slot].shapes.items()]

    def instances(self) -> dict:
        """``{where: Plugged}`` of every plugged instance (``"blocks.0.ln1"``, ``"ln_final"``, ...)."""
        out = {}
        for s in self.specs():
            if s.kind == "plugged":
                out[s.name.rsplit(".", 1)[0]] = self.plugged[_owner(s.name)[0]]
        return out

    def entry(self, slot: str, where: str, P: dict):
        """A plugged slot's :class:`Instance` at ``where`` over the arrays ``P`` (``None`` when the
        slot is built in)."""
        layer = self.plugged.get(slot)
        return None if layer is None else Instance(where, {n: P.get(f"{where}.{n}") for n in layer.shapes})

    def records(self) -> list[dict]:
        """:meth:`Plugged.record` of every plugged layer (what a checkpoint keeps)."""
        return [layer.record() for layer in self.plugged.values()]


def _owner(name: str) -> tuple:
    """``(slot, instance)`` a built-in or plugged parameter belongs to: ``("norm", "blocks.0.ln1")``,
    ``("mlp", "blocks.0.mlp")`` (any MLP layer), ``("activation", "blocks.0.act")``, or ``(None, None)``."""
    parts = name.split(".")
    if parts[0] == "ln_final":
        return "norm", "ln_final"
    if parts[0] != "blocks":
        return None, None
    where = ".".join(parts[:3])
    if parts[2] in ("ln1", "ln2", "ln1_post", "ln2_post"):
        return "norm", where
    if parts[2] in ("mlp", "mlp_gate", "mlp_expand", "mlp_contract"):
        return "mlp", f"blocks.{parts[1]}.mlp"
    if parts[2] == "act":
        return "activation", where
    return None, None

