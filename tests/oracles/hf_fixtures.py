"""Tiny Hugging Face GPT-2 models, tokenizers and directories for the interop tests.

Everything here is built with ``transformers`` itself (the oracle): a small byte-level BPE
tokenizer trained with ``tokenizers`` and saved by ``GPT2TokenizerFast.save_pretrained``, and
random ``GPT2LMHeadModel`` s saved by ``save_pretrained`` (or, for the older ``.bin`` format,
``torch.save`` of the state dict, which is what ``save_pretrained`` wrote before safetensors).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from pedestrian.text.tokenizer import BPETokenizer  # noqa: E402

TEXT = ("the quick brown fox jumps over the lazy dog. " * 20
        + "pack my box with five dozen liquor jugs! " * 20
        + "Sphinx of black quartz, judge my vow.\n" * 10)

_TOKENIZER: BPETokenizer | None = None


def tiny_tokenizer() -> BPETokenizer:
    """A 300-id byte-level BPE (``<|endoftext|>`` = 0, 256 bytes, 43 merges)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = BPETokenizer.train(TEXT, vocab_size=300)
    return _TOKENIZER


def hf_config(**overrides):
    """A ``GPT2Config`` for the tiny tokenizer (2 blocks, d=16, 2 heads, 64 positions)."""
    kw = dict(vocab_size=tiny_tokenizer().vocab_size, n_positions=64, n_embd=16, n_layer=2, n_head=2,
              bos_token_id=0, eos_token_id=0, initializer_range=0.2,
              attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    kw.update(overrides)
    return transformers.GPT2Config(**kw)


def hf_model(seed: int = 0, **overrides):
    """A random ``GPT2LMHeadModel`` (float32, eval mode) with non-trivial biases and LN params."""
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(hf_config(**overrides)).eval()
    with torch.no_grad():                      # HF initialises biases to 0 and LN to 1: perturb
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_tokenizer(directory: Path, kind: str = "json") -> None:
    """``kind="json"``: ``tokenizer.json`` (+ config) via transformers; ``"vocab"``: only
    ``vocab.json`` + ``merges.txt``."""
    tok = tiny_tokenizer()
    directory.mkdir(parents=True, exist_ok=True)
    if kind == "json":
        fast = transformers.GPT2TokenizerFast(tokenizer_object=tok.hf, bos_token="<|endoftext|>",
                                              eos_token="<|endoftext|>", unk_token="<|endoftext|>")
        fast.save_pretrained(str(directory))
    else:
        tok.hf.model.save(str(directory))


def save_hf_dir(model, directory: Path, fmt: str = "safetensors", tokenizer: str | None = "json") -> Path:
    """Write ``model`` as a Hugging Face directory.

    ``fmt``: ``"safetensors"`` (``save_pretrained``), ``"bin"`` (``pytorch_model.bin`` with the
    same names) or ``"bin-legacy"`` (the original GPT-2 release layout: names without the
    ``transformer.`` prefix, no ``lm_head``, plus the ``attn.bias`` / ``attn.masked_bias``
    buffers).
    """
    directory = Path(directory)
    if fmt == "safetensors":
        model.save_pretrained(str(directory))
    else:
        directory.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(str(directory))
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if fmt == "bin-legacy":
            C = model.config.n_positions
            state = {k[len("transformer."):]: v for k, v in state.items() if k.startswith("transformer.")}
            for i in range(model.config.n_layer):
                state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(C, C, dtype=torch.bool)).view(1, 1, C, C)
                state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
        torch.save(state, directory / "pytorch_model.bin")
    if tokenizer is not None:
        save_tokenizer(directory, tokenizer)
    return directory


def hf_logits(model, tokens: np.ndarray, dtype=None) -> np.ndarray:
    """``model(tokens).logits`` as NumPy (optionally after converting the model's dtype)."""
    if dtype is not None:
        model = model.to(dtype)
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def rel_err(a, b) -> float:
    """``max|a - b| / max|b|`` (``b`` the reference)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-300))


def edit_config(directory: Path, **changes) -> None:
    """Change keys of ``directory/config.json`` in place."""
    path = Path(directory) / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))
