"""Print the paper's table for a model: every activation a_i and error signal Δ_i of one training
step, with its shape, formula, the parameters it touches, forward and backward FLOPs and the
memory the forward keeps for it; totals at the bottom, beside the 6·N·tokens rule.

The model comes from a checkpoint (--checkpoint, its own config, dtype, batch and context), a
training settings file (--config FILE.toml, as `pedestrian train` reads it), a preset (--preset,
with the same field flags as `pedestrian params`), or -- with none of those -- the default model
of `pedestrian train` on the bundled plays (84 characters). --batch-size and --seq-len set B and T
(defaults: the run's batch size, or 1, and the context length). Nothing is allocated.

FLOPs: every matrix product exactly, 2 per multiply-add (forward; the backward computes two
products per fully connected layer, Δ_in = Δ Wᵀ and dW = xᵀ Δ, and four in the attention).
Elementwise work is counted at the costs listed under the table: the arithmetic operations per
element of the reference layers (src/pedestrian/layers), each +, −, ×, ÷, exp, tanh, erf, sqrt,
cos, sin and each summed element of a reduction counted once; comparisons, gathers and copies
count 0. One block's rows are printed once (every block is the same); totals count them
n_blocks times. Memory: the array the forward keeps for the backward, in the model's dtype (a0:
int64); totals add the parameters, their gradients and the two AdamW moments.

Examples:
  pedestrian explain
  pedestrian explain --preset gpt2 --batch-size 8 --seq-len 1024
  pedestrian explain --preset char-small --position-encoding rope
  pedestrian explain --checkpoint runs/shakespeare_char/best
  pedestrian explain --config configs/shakespeare_char.toml
"""

from __future__ import annotations

import argparse

from ..config import CONFIG_FIELDS, GPTConfig
from ..paper.explain import explain_table
from .params import add_config_arguments, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("which model (at most one of these)")
    src.add_argument("--checkpoint", metavar="CKPT", help="a checkpoint folder or run folder")
    src.add_argument("--config", metavar="FILE.toml", help="a `pedestrian train` settings file")
    add_config_arguments(parser)                  # --preset and the field flags
    parser.add_argument("--batch-size", type=int, metavar="B", help="sequences per step")
    parser.add_argument("--seq-len", type=int, metavar="T", help="tokens per sequence (default: context length)")
    parser.add_argument("--dtype", choices=["float32", "float64"], help="for the memory column (default float32, "
                        "or the checkpoint's)")


def _resolve(args) -> tuple[GPTConfig, int | None, str]:
    """``(config, batch size or None, dtype)`` from the chosen source."""
    sources = [name for name in ("checkpoint", "config", "preset") if getattr(args, name)]
    if len(sources) > 1:
        raise ValueError(f"give at most one of --checkpoint, --config, --preset (got {', '.join(sources)})")
    dtype = args.dtype or "float32"
    flags = [f for f in CONFIG_FIELDS if getattr(args, f, None) is not None and f != "vocab_size"]
    if (args.checkpoint or args.config) and flags:
        raise ValueError(f"--{flags[0].replace('_', '-')} changes a preset's model; --checkpoint and --config "
                         "bring their own (drop the flag, or use --preset)")
    if args.checkpoint:
        from ..checkpoint import read_state

        _, state = read_state(args.checkpoint)
        config = GPTConfig.from_dict(state["config"])
        settings = (state.get("meta") or {}).get("settings") or {}
        return config, settings.get("batch_size"), args.dtype or state.get("dtype", "float32")
    if args.config:
        from ..training import DEFAULT_MODEL, TrainSettings, read_config_file

        given = read_config_file(args.config)
        settings = TrainSettings(**{k: v for k, v in given.items()
                                    if k in TrainSettings.__dataclass_fields__ and k != "model"})
        model = dict(DEFAULT_MODEL)
        if "preset" in given:
            from ..config import PRESETS

            model = {k: v for k, v in PRESETS[given["preset"]].items() if k != "vocab_size"}
        model.update({k: v for k, v in given.items() if k in GPTConfig.__dataclass_fields__})
        vocab = args.vocab_size or _vocab_size(settings)
        return GPTConfig(vocab_size=vocab, **model), settings.batch_size, args.dtype or settings.dtype
    if args.preset or args.vocab_size:
        return config_from_args(args), None, dtype
    from ..training import DEFAULT_MODEL, TrainSettings

    return config_from_args(args, {**DEFAULT_MODEL, "vocab_size": 84}), TrainSettings().batch_size, dtype


def _vocab_size(settings) -> int:
    """The vocabulary a training run would get: BPE's size setting, or the corpus' characters."""
    if settings.tokenizer == "bpe":
        return settings.bpe_vocab_size
    from ..text.data import load_corpus
    from ..text.tokenizer import CharTokenizer

    return CharTokenizer.from_text(load_corpus(settings.data)).vocab_size


def run(args: argparse.Namespace) -> int:
    config, run_batch, dtype = _resolve(args)
    B = args.batch_size if args.batch_size is not None else (run_batch or 1)
    T = args.seq_len if args.seq_len is not None else config.context_length
    print(explain_table(config, B, T, dtype))
    return 0
