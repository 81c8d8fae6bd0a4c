"""The file plumbing the two formats share (:mod:`.hf`, :mod:`.peft`): tensor files read
(safetensors, BF16 widened; PyTorch pickles), JSON objects read, a folder written all at once, and
the lists in their error messages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from ..atomic import atomic_dir

LIST_MAX = 20


def listing(items, limit: int = LIST_MAX) -> str:
    """``"a, b, ... (N more)"``: the first ``limit`` items of a list for an error message."""
    items = list(items)
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def read_json_object(path: Path) -> dict:
    """Parse a JSON file that must hold an object.

    Raises:
        ValueError: not UTF-8, not valid JSON, or not an object (the message names the file).
    """
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return cfg


# ------------------------------------------------------------------------------------ tensor files
#: bytes per element of the safetensors dtypes (the format's table), to locate a BF16 tensor
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "U16": 2, "I16": 2, "F16": 2,
                "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}


class SafetensorsFile:
    """Names, shapes, dtypes and metadata of one ``.safetensors`` file, tensors read on demand,
    all through ``safetensors.safe_open`` (which validates the header: offsets in bounds,
    no overlaps, no holes).

    Attributes:
        path: the file. names: tensor names, in file (offset) order. shapes: name -> shape
        tuple. dtypes: name -> safetensors dtype code (``"F32"``, ``"BF16"``, ...).
        metadata: the ``__metadata__`` string dict (``{}`` if none).

    Raises:
        ValueError: the file cannot be opened or is not a valid safetensors file.
    """

    def __init__(self, path: Path):
        from safetensors import SafetensorError, safe_open

        self.path = Path(path)
        try:
            with safe_open(str(path), framework="numpy") as f:
                self.names = list(f.offset_keys())
                self.metadata = dict(f.metadata() or {})
                slices = {k: f.get_slice(k) for k in self.names}
                self.shapes = {k: tuple(v.get_shape()) for k, v in slices.items()}
                self.dtypes = {k: v.get_dtype() for k, v in slices.items()}
        except (SafetensorError, OSError, ValueError) as exc:
            raise ValueError(f"{path} is not a safetensors file ({exc}); copy or download it again "
                             "(a cut-off copy looks like this)") from None

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a NumPy array (BF16, which NumPy lacks, widened to float32)."""
        if self.dtypes[name] == "BF16":
            return self._bf16_as_float32(name)
        from safetensors import safe_open

        with safe_open(str(self.path), framework="numpy") as f:
            return f.get_tensor(name)

    def _bf16_as_float32(self, name: str) -> np.ndarray:
        # safe_open(framework="numpy") cannot build a bfloat16 array, so read the raw bits. The
        # format stores the tensors back to back in offset order, without holes, up to the end
        # of the file (safe_open has checked that), which places each one.
        sizes = {}
        for k in self.names:
            if self.dtypes[k] not in _ST_ITEMSIZE:
                raise ValueError(f"{self.path}: cannot read the BF16 tensor {name} beside a tensor of "
                                 f"dtype {self.dtypes[k]}")
            sizes[k] = _ST_ITEMSIZE[self.dtypes[k]] * int(np.prod(self.shapes[k], dtype=np.int64))
        start = self.path.stat().st_size - sum(sizes.values())
        for k in self.names:
            if k == name:
                break
            start += sizes[k]
        raw = np.fromfile(self.path, dtype="<u2", count=sizes[name] // 2, offset=start)
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(self.shapes[name])


def torch_load(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a PyTorch pickle (``pytorch_model.bin``), as NumPy arrays (BF16 widened).

    Raises:
        ValueError: PyTorch is not installed, or the file cannot be read.
    """
    try:
        import torch
    except ImportError:
        raise ValueError(f"{path} is a PyTorch pickle, which only PyTorch can read: install torch "
                         "(pip install torch) or convert the model to model.safetensors") from None
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds on a corrupt file
        raise ValueError(f"could not read {path} with torch.load: {exc}") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path} does not hold a state dict (got {type(state).__name__})")
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = (v.float() if v.dtype == torch.bfloat16 else v).detach().cpu().numpy()
    return out


# ------------------------------------------------------------------------------------ writing a folder
class OutputExistsError(ValueError):
    """The output folder ``path`` exists and holds files, and replacing them was not allowed.

    ``str()`` names the Python argument (``overwrite=True``); :meth:`advice` words it for another
    caller (the ``export-hf`` command names its ``--overwrite`` flag)."""

    def __init__(self, path: Path):
        self.path = path
        super().__init__(self.advice("pass overwrite=True"))

    def advice(self, how: str) -> str:
        """The message with ``how`` as the way to allow it (``"pass --overwrite"``)."""
        return f"{self.path} already exists and is not empty; choose a new directory or {how} to replace the files written here"


def write_dir_atomically(out_dir, writers: Mapping[str, Callable[[Path], None]], *,
                         overwrite: bool = False, conflicts=(), what: str = "the model directory") -> Path:
    """Write files into ``out_dir`` so that a failure leaves nothing half-written.

    Every file is first written into a temporary folder next to ``out_dir``
    (:func:`pedestrian.atomic.atomic_dir` with ``merge=True``); a new ``out_dir`` is then
    renamed into place in one step, an existing one gets each file by ``os.replace`` (its other
    files stay).

    Args:
        writers: file name -> function writing that file to the path it is given.
        overwrite: allow an existing non-empty ``out_dir`` (only the files written are replaced).
        conflicts: file names that must not remain beside the new files (e.g. other weight
            files that would shadow them); their presence is an error.
        what: how to name the folder in an error message.

    Raises:
        OutputExistsError (a ``ValueError``): ``out_dir`` is non-empty and ``overwrite`` is false.
        ValueError: ``out_dir`` holds a conflict.
        NotADirectoryError: ``out_dir`` is a file.
        WriteError (an ``OSError``): the OS refused the write (no space, file too large, no
            permission, read-only); ``out_dir`` is left as it was.
    """
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} exists and is not a directory; choose another output path")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise OutputExistsError(out)
        stale = [n for n in conflicts if n not in writers and (out / n).exists()]
        if stale:
            raise ValueError(f"{out} holds {stale}, which would be mixed with the new files; "
                             "remove them or choose another directory")
    with atomic_dir(out, what=what, merge=True) as tmp:
        for name, write in writers.items():
            write(tmp / name)
    return out


def json_writer(obj) -> Callable[[Path], None]:
    """A writer for :func:`write_dir_atomically`: ``obj`` as indented JSON."""
    return lambda p: p.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
