"""Read and write Hugging Face model directories -- ``GPT2LMHeadModel``, ``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``MistralForCausalLM`` (no sliding window), ``Qwen3ForCausalLM``,
``Olmo2ForCausalLM``, ``SmolLM3ForCausalLM``: the entries of :data:`.families.FAMILIES` --
without ``transformers``.

A directory written by ``save_pretrained`` holds ``config.json``, the weights
(``model.safetensors``, a sharded ``model.safetensors.index.json``, or the older
``pytorch_model.bin``) and usually a tokenizer (``tokenizer.json``, or ``vocab.json`` +
``merges.txt``). Safetensors files are read with the ``safetensors`` library; a ``.bin`` file is
a pickle that only PyTorch can read, so it needs ``torch`` installed.

The family is ``config.json``'s (:func:`~.families.hf_family`; :mod:`.families` holds one entry
per family). The config mappings are :mod:`.hf_config` (GPT-2) and :mod:`.hf_llama_config` (the
Llama layout: Llama, Qwen2, Mistral, ...), the tensor names and layouts :mod:`.hf_tensors` and
:mod:`.hf_llama_tensors`, the shared file plumbing :mod:`.files`; this module loads and saves whole directories, and its names
are the ones to import (``pedestrian.interop.hf.load_pretrained``, ``config_from_hf``, ...).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

from .files import OutputExistsError, SafetensorsFile, json_writer, listing, torch_load, write_dir_atomically
from . import hf_llama_config
from .hf_config import ACTIVATION_TO_HF, HF_TO_ACTIVATION, config_to_hf, export_problems, read_hf_config
from .families import FAMILIES, export_family, hf_family
from .hf_llama_config import config_from_hf
from .hf_llama_tensors import check_llama_shapes, convert_llama_from_hf, llama_state_to_hf
from .hf_tensors import check_hf_shapes, convert_from_hf, hf_tensor_shapes, state_from_hf, state_to_hf

__all__ = [
    "merged_for_export",
    "HFFolder",
    "load_pretrained",
    "load_hf_model",
    "load_hf_tokenizer",
    "save_pretrained",
    "config_from_hf",
    "config_to_hf",
    "hf_family",
    "export_problems",
    "hf_tensor_shapes",
    "state_from_hf",
    "state_to_hf",
    "read_hf_config",
    "open_hf_weights",
    "OutputExistsError",
    "HF_TO_ACTIVATION",
    "ACTIVATION_TO_HF",
]

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")
_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16}
_FLOAT_CODES = ("F64", "F32", "F16", "BF16")


# ------------------------------------------------------------------------------------ weight files
class HFWeights:
    """The tensors of a model directory: names and shapes up front, data read on demand.

    Attributes:
        source: the file(s) the tensors come from (for messages).
        shapes: name -> shape; dtypes: name -> safetensors dtype string (``"F32"``, ...).
    """

    def __init__(self, source: str, shapes: dict, dtypes: dict, getter: Callable[[str], np.ndarray]):
        self.source, self.shapes, self.dtypes, self._get = source, shapes, dtypes, getter

    def __getitem__(self, name: str) -> np.ndarray:
        return self._get(name)


def open_hf_weights(hf_dir) -> HFWeights:
    """The weights of a Hugging Face model directory, in the order ``transformers`` prefers:
    ``model.safetensors``, ``model.safetensors.index.json`` (shards), ``pytorch_model.bin``,
    ``pytorch_model.bin.index.json``.

    Raises:
        FileNotFoundError: none of those files (the message lists what the directory holds).
        ValueError: an unreadable file, or a ``.bin`` file without PyTorch installed.
    """
    d = Path(hf_dir).expanduser()
    st = d / "model.safetensors"
    if st.is_file():
        f = SafetensorsFile(st)
        return HFWeights(str(st), f.shapes, f.dtypes, f.get)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files, where = _read_index(index)
        shards = {name: SafetensorsFile(d / name) for name in files}
        shapes, dtypes = {}, {}
        for tensor, name in where.items():
            shard = shards[name]
            if tensor not in shard.shapes:
                raise ValueError(f"{index} places {tensor} in {name}, which does not hold it")
            shapes[tensor] = shard.shapes[tensor]
            dtypes[tensor] = shard.dtypes[tensor]
        return HFWeights(str(index), shapes, dtypes, lambda t: shards[where[t]].get(t))
    for name in ("pytorch_model.bin", "pytorch_model.bin.index.json"):
        p = d / name
        if p.is_file():
            if name.endswith(".json"):
                files, _ = _read_index(p)
                state = {}
                for shard in files:
                    state.update(torch_load(d / shard))
            else:
                state = torch_load(p)
            codes = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
            return HFWeights(str(p), {k: v.shape for k, v in state.items()},
                             {k: codes.get(v.dtype, str(v.dtype)) for k, v in state.items()},
                             state.__getitem__)
    have = sorted(p.name for p in d.iterdir()) if d.is_dir() else []
    raise FileNotFoundError(f"{d} holds no model weights: expected one of {list(_WEIGHT_FILES)}, "
                            f"found {have}")


def _read_index(index: Path) -> tuple[list[str], dict[str, str]]:
    try:
        where = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{index} is not a weight index (needs a 'weight_map'): {exc}") from None
    files = sorted(set(where.values()))
    missing = [f for f in files if not (index.parent / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{index} refers to shard file(s) that do not exist: {missing}")
    return files, where


# ------------------------------------------------------------------------------------ loading
class HFFolder:
    """A Hugging Face model directory, read as one run needs it: ``config.json`` opened once (when
    made), its family and :class:`~pedestrian.config.GPTConfig` decided once; the tensor names and
    shapes read and checked once, by :meth:`model` (before any tensor's data); the weight file's
    SHA-256 only when asked (:meth:`fingerprint`, once).

    Attributes:
        path: the directory. hf_config: the parsed ``config.json``. family: ``"gpt2"``,
        ``"llama"``, ``"qwen2"`` or ``"mistral"`` (:func:`hf_family`). config: the ``GPTConfig``.

    Raises:
        FileNotFoundError: no directory or ``config.json``. ValueError: another model family, or
            a setting pedestrian does not implement (one line naming the field and its value).
    """

    def __init__(self, hf_dir):
        self.path = Path(hf_dir).expanduser()
        self.hf_config = read_hf_config(hf_dir)
        source = str(Path(hf_dir) / "config.json")
        self.family = hf_family(self.hf_config, source=source)
        self.config = config_from_hf(self.hf_config, source=source, family=self.family)
        self._weights: HFWeights | None = None
        self._fingerprint: dict | None = None

    @property
    def weights(self) -> HFWeights:
        """The weight file(s), opened on first use (:func:`open_hf_weights`)."""
        if self._weights is None:
            self._weights = open_hf_weights(self.path)
        return self._weights

    def tokenizer(self):
        """The folder's tokenizer (:func:`load_hf_tokenizer`); ``ValueError`` if it has more ids
        than the model's ``vocab_size`` (it belongs to another model)."""
        tokenizer = load_hf_tokenizer(self.path)
        if tokenizer.vocab_size > self.config.vocab_size:
            raise ValueError(f"the tokenizer in {self.path} has {tokenizer.vocab_size} ids but the model's "
                             f"vocab_size is {self.config.vocab_size}; the tokenizer belongs to another model")
        return tokenizer

    def model(self, *, dtype: str = "float32", backend: str = "numpy"):
        """The :class:`~pedestrian.model.GPT` holding the folder's weights (see :func:`load_hf_model`)."""
        from ..model import GPT

        config, weights = self.config, self.weights
        gpt2 = FAMILIES[self.family].layout == "gpt2"
        if not gpt2:
            check_llama_shapes(weights.shapes, config, weights.source, self.family)
            canon = {name: name for name in weights.shapes}
        else:
            canon = check_hf_shapes(weights.shapes, config, weights.source)
        bad = [f"{k} ({weights.dtypes[k]})" for k in canon if weights.dtypes[k] not in _FLOAT_CODES]
        if bad:
            raise ValueError(f"{weights.source}: tensors that are not floating point: {listing(bad)}")
        tensors = {full: weights[name] for name, full in canon.items()}
        state = (convert_from_hf(tensors, config, weights.source) if gpt2
                 else convert_llama_from_hf(tensors, config, weights.source, self.family))
        model = GPT(config, dtype=dtype, backend=backend)
        try:
            model.load_state_dict(state, strict=True)
        except ValueError as exc:                       # e.g. a NaN weight: name the file it is in
            raise ValueError(f"{weights.source}: {exc}") from None
        return model

    def fingerprint(self) -> dict:
        """``{"hf_dir", "weights", "sha256"}``: the directory (absolute), the file that holds the
        tensors (:func:`open_hf_weights`) and its SHA-256, so that adapters can later be matched
        against the very weights they were trained on. Computed once (the file read in 4 MiB
        blocks)."""
        if self._fingerprint is None:
            source = Path(self.weights.source)
            h = hashlib.sha256()
            with open(source, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
            self._fingerprint = {"hf_dir": str(self.path.resolve()), "weights": source.name,
                                 "sha256": h.hexdigest()}
        return self._fingerprint


def load_hf_model(hf_dir, *, dtype: str = "float32", backend: str = "numpy"):
    """A pedestrian :class:`~pedestrian.model.GPT` holding a Hugging Face model's weights: a
    ``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``MistralForCausalLM``
    (the family of ``config.json``, :func:`hf_family`): ``HFFolder(hf_dir).model(...)``.

    Args:
        hf_dir: directory with ``config.json`` and the weights (see :func:`open_hf_weights`).
        dtype: ``"float32"`` or ``"float64"`` (the file's F16/BF16/F32 values are widened).
        backend: ``"numpy"`` or ``"torch"``.

    Returns:
        the model; its logits equal those of the ``transformers`` class that wrote the folder
        (float64: to rounding; float32: within a few ε of the logits' scale).

    Raises:
        FileNotFoundError: no directory, ``config.json`` or weights.
        ValueError: another model family, a setting pedestrian does not implement (one line naming
            the field and its value), tensors that do not match the config, or weights that are
            NaN or ±inf (every problem listed; nothing is loaded).
    """
    return HFFolder(hf_dir).model(dtype=dtype, backend=backend)


def load_hf_tokenizer(hf_dir):
    """The tokenizer of a Hugging Face model directory: a BPE ``tokenizer.json``, byte-level
    (GPT-2, SmolLM2, Qwen2, Llama 3) or sentencepiece-style with byte fallback (Llama 2, Mistral),
    read by ``tokenizers`` as it is (:class:`~pedestrian.text.tokenizer.BPETokenizer`).

    Looks for ``tokenizer.json``, then ``vocab.json`` + ``merges.txt``, then the
    ``pedestrian_tokenizer.json`` that :func:`save_pretrained` writes for a character tokenizer.

    Raises:
        FileNotFoundError: none of those files.
        ValueError: a file ``tokenizers`` cannot read, or one that is neither of those kinds.
    """
    from ..text.tokenizer import BPETokenizer, load_tokenizer

    d = Path(hf_dir).expanduser()
    if (d / "tokenizer.json").is_file():
        return BPETokenizer.from_file(d / "tokenizer.json")
    if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        return BPETokenizer.from_vocab_merges(d / "vocab.json", d / "merges.txt")
    if (d / "pedestrian_tokenizer.json").is_file():
        return load_tokenizer(d / "pedestrian_tokenizer.json")
    raise FileNotFoundError(f"{d} has no tokenizer: expected tokenizer.json, or vocab.json and "
                            "merges.txt (copy them from the model the weights came from)")


def load_pretrained(hf_dir, *, dtype: str = "float32", backend: str = "numpy"):
    """Load a Hugging Face directory of any family of :data:`.families.FAMILIES`: ``(GPT, tokenizer)``
    (:class:`HFFolder`: the config read once; the tokenizer, cheap, before the weights).

    Raises:
        FileNotFoundError: no directory, ``config.json``, weights or tokenizer files.
        ValueError: another family, a setting pedestrian does not implement (one line naming the
            field), mismatching tensors (all listed), or a tokenizer with more ids than the
            model's ``vocab_size``.
    """
    folder = HFFolder(hf_dir)
    tokenizer = folder.tokenizer()                 # cheap: fail before reading the weights
    return folder.model(dtype=dtype, backend=backend), tokenizer


# ------------------------------------------------------------------------------------ saving
def _eos_id(tokenizer) -> int | None:
    from ..text.bpe_tokenizer import EOS_TOKENS

    special = getattr(tokenizer, "special_tokens", {}) if tokenizer is not None else {}
    return next((special[t] for t in EOS_TOKENS if t in special), None)


def tokenizer_writers(tokenizer, context_length: int, family: str = "gpt2") -> dict[str, Callable[[Path], None]]:
    """Files that describe ``tokenizer`` in a Hugging Face directory of ``family``.

    A :class:`~pedestrian.text.tokenizer.BPETokenizer` becomes ``tokenizer.json`` plus a
    ``tokenizer_config.json`` (``GPT2Tokenizer`` with ``vocab.json``/``merges.txt`` for GPT-2,
    ``PreTrainedTokenizerFast`` for a Llama-family folder: ``tokenizer.json`` alone describes it);
    a character tokenizer, which neither has a format for, becomes ``pedestrian_tokenizer.json``.
    """
    from ..text.bpe_tokenizer import EOS_TOKENS
    from ..text.tokenizer import BPETokenizer

    if tokenizer is None:
        return {}
    if not isinstance(tokenizer, BPETokenizer):
        return {"pedestrian_tokenizer.json": tokenizer.save}
    special = tokenizer.special_tokens
    eos = next((t for t in EOS_TOKENS if t in special), None)
    if FAMILIES[family].layout != "gpt2":
        bos = next((t for t in ("<s>", "<|begin_of_text|>") if t in special), None)
        unk = "<unk>" if "<unk>" in special else None
        tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context_length,
                      "eos_token": eos, "bos_token": bos, "unk_token": unk}
        return {"tokenizer.json": lambda p: tokenizer.hf.save(str(p)),
                "tokenizer_config.json": json_writer(tok_config)}

    def vocab_merges(name):
        def write(p: Path):                  # the model saves both files: keep the one asked for
            for f in map(Path, tokenizer.hf.model.save(str(p.parent), f".{name}")):
                if f.name.endswith(f"-{name}"):
                    os.replace(f, p)
                else:
                    f.unlink()
        return write

    eot = "<|endoftext|>" if "<|endoftext|>" in special else None
    tok_config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": context_length,
                  "add_prefix_space": False, "bos_token": eot, "eos_token": eot, "unk_token": eot}
    return {"tokenizer.json": lambda p: tokenizer.hf.save(str(p)),
            "vocab.json": vocab_merges("vocab.json"), "merges.txt": vocab_merges("merges.txt"),
            "tokenizer_config.json": json_writer(tok_config)}


#: the files of a base folder an export of its fine-tune keeps as they are (:func:`save_pretrained`'s
#: ``copy_from``): the chat template, the generation config (its stop ids), the tokenizer's config
CHAT_FILES = ("tokenizer_config.json", "chat_template.jinja", "generation_config.json", "special_tokens_map.json")


def save_pretrained(model, out_dir, tokenizer=None, *, overwrite: bool = False, token_ids: dict | None = None,
                    copy_from=None) -> Path:
    """Write ``model`` (and ``tokenizer``) as a Hugging Face directory: a ``GPT2LMHeadModel``
    for a GPT-2-shaped config (layer norms, the standard MLP, learned positions), else a
    ``LlamaForCausalLM`` (or ``Qwen2ForCausalLM`` with q, k, v biases only;
    :func:`~.families.export_family`).

    ``AutoModelForCausalLM.from_pretrained(out_dir)`` then gives the same logits, and
    :func:`load_pretrained` gives back exactly the same parameters. Files: ``config.json``
    (:func:`config_to_hf` or :func:`~.hf_llama_config.config_to_hf`), ``model.safetensors``
    (the model's dtype; tied models without ``lm_head.weight``, as ``transformers`` writes them)
    and the tokenizer files of :func:`tokenizer_writers`. Writing is atomic (see
    :func:`write_dir_atomically`).

    Args:
        model: a :class:`~pedestrian.model.GPT` without LoRA adapters.
        tokenizer: optional; its end-of-text id (:data:`~pedestrian.text.bpe_tokenizer.EOS_TOKENS`)
            becomes ``eos_token_id`` (and GPT-2's ``bos_token_id``).
        overwrite: replace the files in an existing non-empty directory.
        token_ids: ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` for a Llama-family
            ``config.json`` (an int, a list or ``None`` each, as Hugging Face writes them), in place
            of the tokenizer's end-of-text id and no ``bos_token_id`` / ``pad_token_id`` (written
            ``null``: a class default such as SmolLM3's 128004 may lie outside the vocabulary): a merged fine-tune passes its base folder's,
            so the export keeps them. GPT-2 writes its end-of-text id as both, its convention.
        copy_from: a merged fine-tune's base folder (whose tokenizer ``tokenizer`` is): its
            :data:`CHAT_FILES` that exist are copied as they are, in place of the tokenizer config
            written here -- an instruct model's export keeps its chat template and stop ids.

    Raises:
        ValueError: the model has adapters (merge them with ``merge_lora()`` or write them with
            :func:`pedestrian.interop.peft.save_peft_adapter`) or plugged layers, a config neither GPT-2 nor a
            Llama-family model can express, a tokenizer with more ids than ``vocab_size``, or an
            output problem.
        WriteError (an ``OSError``): the OS refused the write (no space, file too large, no
            permission, read-only); ``out_dir`` is left as it was.
    """
    from safetensors.numpy import save_file

    if model.lora_targets:
        raise ValueError("the model has LoRA adapters; merge them first (model.merge_lora()) or write "
                         "them separately as a PEFT adapter (pedestrian.interop.peft.save_peft_adapter)")
    if model.slots.plugged:
        raise ValueError(f"the model's {', '.join(model.slots.plugged)} slot holds a plugged layer, which no Hugging "
                         "Face architecture has; keep it as a pedestrian checkpoint")
    config = model.config
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size "
                         f"is {config.vocab_size}")
    eos = _eos_id(tokenizer)
    family = export_family(config)
    if FAMILIES[family].layout == "gpt2":
        hf_config = config_to_hf(config, dtype=model.dtype_name, eos_token_id=eos)
        tensors = state_to_hf(model.state_dict(), config)
    else:
        ids = {"bos_token_id": None, "eos_token_id": eos, "pad_token_id": None, **(token_ids or {})}
        hf_config = hf_llama_config.config_to_hf(config, dtype=model.dtype_name, bos_token_id=ids["bos_token_id"],
                                                 eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])
        tensors = llama_state_to_hf(model.state_dict(), config)
    writers = {"config.json": json_writer(hf_config),
               "model.safetensors": lambda p: save_file(tensors, str(p), metadata={"format": "pt"}),
               **tokenizer_writers(tokenizer, config.context_length, family)}
    if copy_from is not None and tokenizer is not None:
        import shutil

        base = Path(copy_from).expanduser()
        writers.update({name: (lambda p, src=base / name: shutil.copyfile(src, p))
                        for name in CHAT_FILES if (base / name).is_file()})
    return write_dir_atomically(out_dir, writers, overwrite=overwrite, conflicts=_WEIGHT_FILES)


def token_ids(hf_config: dict | None) -> dict | None:
    """``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` of a parsed ``config.json`` (those it sets; as written
    there: an int, a list or ``None``), or ``None`` without one: what :func:`save_pretrained`'s
    ``token_ids`` takes to keep a base model's ids in an export (:attr:`HFFolder.hf_config`)."""
    return {k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf_config} or None if hf_config else None


def merged_for_export(model):
    """A copy of ``model`` with its LoRA adapters merged, ready for :func:`save_pretrained`.

    ``W ← W + α D U`` for every adapted layer, each with its own ``α`` (paper section 6;
    ``model`` itself is not changed). A LoRA on *tied* logits (GPT-2 ties ``lm_head`` to ``wte``) cannot be merged
    into ``tok_emb.weight`` without changing the embedding lookup too, so the copy is
    **untied** instead: ``tie_weights=False`` (HF ``tie_word_embeddings=false``), the token
    embedding unchanged, and ``logits.weight = W_tokᵀ + α D U`` of shape ``(d_model, V)``
    (HF ``lm_head.weight = wte + (α D U)ᵀ``, ``(V, d_model)``, no bias). The copy gives the
    same logits as the adapted model.

    Args:
        model: a :class:`~pedestrian.model.GPT` (with or without adapters).

    Returns:
        a new :class:`~pedestrian.model.GPT` without adapters, same dtype, NumPy backend.

    Raises:
        ValueError: the merged parameters do not fit the (untied) config (a bug).
    """
    import dataclasses

    from ..model import GPT

    state = {k: np.asarray(v, dtype=np.float64) for k, v in model.state_dict().items()}
    config = model.config
    targets = list(model.lora_targets or [])
    if "logits" in targets and config.tie_weights:
        config = dataclasses.replace(config, tie_weights=False, logits_bias=False)
        state["logits.weight"] = state["tok_emb.weight"].T.copy()
    for fc in targets:
        state[f"{fc}.weight"] = state[f"{fc}.weight"] + model.lora_alphas[fc] * (
            state.pop(f"{fc}.lora_D") @ state.pop(f"{fc}.lora_U"))
    out = GPT(config, dtype=model.dtype_name)
    out.load_state_dict(state, strict=True)
    return out
