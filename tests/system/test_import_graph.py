"""The shape of the import graph of ``src/pedestrian``, read from the source (``ast``):

- the package is laid out by capability, in layers: each part (a subpackage, or a module of the
  top level) imports only the parts :data:`LAYERS` allows it (the paper's layers import nothing
  of the package but the backend; the kernels only the layers; the model neither text nor
  generation; the command line everything), and the top level holds only the modules listed there;
- no import cycle between modules (every ``import`` counts, also those inside functions: a lazy
  import hides a cycle, it does not remove it);
- no module reads another module's private names: no ``from x import _name``, and no access
  ``obj._name`` unless ``obj`` is ``self`` / ``cls`` / a class of the same module, or ``_name``
  is a private name this module defines itself (an attribute it assigns on ``self``, a method,
  a module-level name) -- e.g. a method setting up another instance's private state.
  Dunders are public;
- no private state on ``self`` is shared across modules (issue 32: the GPT was three files of mixins,
  ``model/params.py`` reading ``self._base`` that ``model/gpt.py`` set): a module reads only the
  ``self._x`` it sets or defines itself, and reads every ``self._x`` it sets.

Exceptions are listed below, each with its reason: third-party privates that have no public
equivalent, and known cases in files other helpers are rewriting (issue 11) -- an entry that no
longer occurs fails the test too, so the lists only shrink.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pedestrian

SRC = Path(pedestrian.__file__).parent
PACKAGE = SRC.name

#: (module, accessed name) -> why it is unavoidable
THIRD_PARTY_PRIVATE: dict = {
    ("pedestrian.kernels.jit", "dispatcher._cache"):
        "numba's Dispatcher has no public hook on loading a disk-cache entry; a damaged entry "
        "is dropped and compiled again there (issue 31)",
}

#: (module, accessed name) -> who removes it. Issue 11, item 6 and the helpers' own files.
PENDING_PRIVATE: dict = {}

#: import cycles (as sorted tuples of modules) -> who removes them
PENDING_CYCLES = {
}

#: part of the package (a subpackage, or a top-level module) -> the parts it may import, bottom up.
#: A part not listed here fails the test: a new top-level module, or a new package, is a decision.
LAYERS = {
    "backend": set(),                                      # NumPy / torch / array-API glue
    "atomic": set(),                                       # crash-safe writes
    "layers": {"backend"},                                 # the paper's math, the reference
    "kernels": {"backend", "layers"},                      # the fast path, same signatures
    "gpu": {"backend", "kernels", "layers"},               # the GPU's fast path (Triton), falling back on kernels
    "config": {"layers"},                                  # GPTConfig, presets
    "model": {"backend", "config", "gpu", "layers", "kernels"},   # the GPT, its parameters and their layout, its KV cache
    "text": {"atomic"},                                    # corpus, token files, tokenizers
    "generation": {"backend", "model", "text"},            # decoding, sampling, prompts in and text out
    "checkpoint": {"atomic", "backend", "config", "model", "text"},
    "interop": {"atomic", "backend", "config", "model", "text"},      # Hugging Face, PEFT
    # model folders, each read once: a Hugging Face directory, a checkpoint, a fine-tune's base + adapters
    "load": {"checkpoint", "interop"},
    "paper": {"atomic", "config", "layers", "model", "text"},  # the paper on screen: tables, demo, pictures
    # the training run: settings and the flag merge, ranks, the trainer, LoRA fine-tuning; paper's
    # check_gradients checks a run's plugged layers before its first step (training/plugged.py)
    "training": {"atomic", "backend", "checkpoint", "config", "generation", "gpu", "interop", "kernels", "layers",
                 "load", "model", "paper", "text"},
    "cli": {"atomic", "training"},
    # the commands parse and print: they reach the math only through the model and paper/
    "commands": {"checkpoint", "cli", "config", "generation", "interop", "kernels", "load", "model", "paper",
                 "text", "training"},
    "__init__": {"config", "model", "paper"},              # ``from pedestrian import GPT``, check_gradients (lazily)
    "__main__": {"cli"},
}


def modules() -> dict:
    """``dotted name -> (path, is_package)`` of every module of the package."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


MODULES = modules()


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module name a ``from ... import`` reads from."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_edges(module: str) -> set:
    path, is_package = MODULES[module]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            edges |= {a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom):
            source = resolve(module, is_package, node)
            if source.split(".")[0] != PACKAGE:
                continue
            for a in node.names:                       # a submodule, or a name of the module
                edges.add(f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source)
    edges.discard(module)
    return {e for e in edges if e in MODULES}


def cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan), as sorted tuples."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own_private_names(tree: ast.Module) -> tuple[set, set]:
    """``(private names this module defines, names of its classes)``."""
    names, classes = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            classes.add(node.name)
            names.add(node.name)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
    return {n for n in names if is_private(n)}, classes


def private_accesses(module: str, source: str | None = None) -> set:
    """``(module, what)`` for every read of another module's private name in ``module``."""
    path, is_package = MODULES.get(module, (None, False))
    tree = ast.parse(source if source is not None else path.read_text(encoding="utf-8"))
    own, classes = own_private_names(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = resolve(module, is_package, node)
            found |= {(module, f"from {src} import {a.name}") for a in node.names if is_private(a.name)}
        elif isinstance(node, ast.Attribute) and is_private(node.attr):
            v = node.value
            if isinstance(v, ast.Name) and (v.id in ("self", "cls") or v.id in classes):
                continue
            if node.attr in own:
                continue
            found.add((module, ast.unparse(node)))
    return found


def shared_self_state(module: str, source: str | None = None) -> set:
    """``(module, what)`` for private state on ``self`` that ``module`` shares with other modules:
    a ``self._x`` it reads but neither sets nor defines (a base class or mixin elsewhere sets it),
    or one it sets and never reads (set for another module's code to read)."""
    path, _ = MODULES.get(module, (None, False))
    tree = ast.parse(source if source is not None else path.read_text(encoding="utf-8"))
    own, _ = own_private_names(tree)
    def on_self(node):
        return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
            and node.value.id == "self" and is_private(node.attr)

    read, written = set(), set()
    for node in ast.walk(tree):
        if on_self(node):
            (written if isinstance(node.ctx, ast.Store) else read).add(node.attr)
        elif isinstance(node, ast.AugAssign) and on_self(node.target):
            read.add(node.target.attr)                     # self._n += 1 reads it too
    return ({(module, f"reads self.{n}, set elsewhere") for n in read - own}
            | {(module, f"sets self.{n}, read elsewhere") for n in written - read})


def part(module: str) -> str:
    """``pedestrian.model.gpt`` -> ``model``; ``pedestrian`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_each_part_imports_only_the_parts_below_it():
    unknown = sorted({part(m) for m in MODULES} - set(LAYERS))
    assert not unknown, f"parts of the package not in LAYERS (declare where they sit): {unknown}"
    found = {(m, e) for m in MODULES for e in import_edges(m)
             if part(e) != part(m) and part(e) not in LAYERS[part(m)]}
    assert not found, "imports across the layers:\n" + "\n".join(f"  {m} -> {e}" for m, e in sorted(found))
    assert {part(e) for e in import_edges("pedestrian.model.gpt")} >= {"config", "kernels"}, "the scan is broken"


def test_no_import_cycle():
    graph = {m: import_edges(m) for m in MODULES}
    assert len(graph) > 30 and graph["pedestrian.model"], "the scan finds nothing: it is broken"
    found = set(cycles(graph))
    new = found - set(PENDING_CYCLES)
    assert not new, f"import cycles: {sorted(new)}"
    fixed = set(PENDING_CYCLES) - found
    assert not fixed, f"no longer a cycle, remove from PENDING_CYCLES: {sorted(fixed)}"


def test_no_module_reads_another_modules_private_names():
    found = set().union(*(private_accesses(m) for m in MODULES))
    allowed = set(THIRD_PARTY_PRIVATE) | set(PENDING_PRIVATE)
    new = found - allowed
    assert not new, "private names read from outside their module:\n" + "\n".join(
        f"  {m}: {what}" for m, what in sorted(new))
    fixed = allowed - found
    assert not fixed, f"no longer found, remove from the exception lists: {sorted(fixed)}"


def test_no_private_state_on_self_is_shared_across_modules():
    found = set().union(*(shared_self_state(m) for m in MODULES))
    assert not found, "private state on self shared across modules:\n" + "\n".join(
        f"  {m}: {what}" for m, what in sorted(found))


def test_the_scans_can_fail():
    """Both scans find what they look for."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [("a", "b", "c")]
    source = ("from .other import _hidden, public\n"
              "class Mine:\n"
              "    def __init__(self):\n"
              "        self._state = 1\n"
              "    def f(self, other, thing):\n"
              "        other._state, Mine._g, self._h\n"     # own names: fine
              "        return thing._foreign, thing.__class__\n")
    assert private_accesses("pedestrian.model.gpt", source) == {
        ("pedestrian.model.gpt", "from pedestrian.model.other import _hidden"),
        ("pedestrian.model.gpt", "thing._foreign"),
    }
    mixin = ("class Params:\n"                          # what model/params.py was: a mixin of GPT
             "    def flat(self):\n"
             "        self._cache = None\n"
             "        self._count += 1\n"
             "        return self._base.flat, self._count, self._own()\n"
             "    def _own(self):\n"
             "        return 0\n")
    assert shared_self_state("pedestrian.model.params", mixin) == {
        ("pedestrian.model.params", "reads self._base, set elsewhere"),
        ("pedestrian.model.params", "sets self._cache, read elsewhere"),
    }
