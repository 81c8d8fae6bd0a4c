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
from ..paper.explain import ELEMENTWISE, explain_rows, totals
from .params import add_config_arguments, config_from_args


def _human(n: float, unit: str = "") -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= factor:
            return f"{n / factor:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**14 else f"{n} B"


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
    itemsize = 8 if dtype == "float64" else 4
    rows = explain_rows(config, B, T, itemsize)
    tot = totals(config, rows, B, T, itemsize)
    c = config
    print(f"config: {c}")
    print(f"B={B} T={T} d={c.d_model} H={c.n_heads} d_qk={c.d_qk} d_h={c.d_head} d_mlp={c.d_mlp} V={c.vocab_size} "
          f"n_blocks={c.n_blocks}, {dtype}, positions: {c.position_encoding}")
    header = (f"{'a_i':<5}{'shape':<18}{'forward':<40}{'parameters':<24}{'fwd FLOPs':>12}  "
              f"{'Δ_i (backward)':<48}{'bwd FLOPs':>12}{'memory':>12}")
    print("\n" + header + "\n" + "-" * len(header))
    in_block = False
    for r in rows:
        if r.per_block and not in_block:
            print(f"  block i, for i = 0 … {c.n_blocks - 1} (x = a1, then the previous block's a10):")
            in_block = True
        elif not r.per_block and in_block:
            in_block = False
        shape = "()" if not r.shape else "(" + ", ".join(str(s) for s in r.shape) + ")"
        print(f"{r.name:<5}{shape:<18}{r.forward:<40}{r.params:<24}{_human(r.fwd_flops):>12}  "
              f"{r.backward:<48}{_human(r.bwd_flops):>12}{_mib(r.memory):>12}")
    print("-" * len(header))
    print(f"one step: forward {_human(tot['fwd'], 'FLOP')}, backward {_human(tot['bwd'], 'FLOP')}, "
          f"total {tot['step']:,} FLOPs ({_human(tot['step'], 'FLOP')}); block rows × {c.n_blocks}")
    print(f"  matrix products alone: {tot['matmul_step']:,} ({_human(tot['matmul_step'], 'FLOP')}, "
          f"{100 * tot['matmul_step'] / tot['step']:.1f}% of the total)")
    print(f"  6·N·tokens rule: 6 × {tot['n_params']:,} parameters × {tot['tokens']:,} tokens = "
          f"{tot['six_n']:,} ({_human(tot['six_n'], 'FLOP')}); exact / rule = {tot['step'] / tot['six_n']:.3f}")
    print("    (the rule is 2 FLOPs per parameter per token forward and 4 backward: it leaves out the attention's\n"
          "    q kᵀ and P v and the elementwise work, and counts the embedding tables as if they were products)")
    print(f"memory kept by the forward: {_mib(tot['memory'])}; parameters, gradients and the two AdamW "
          f"moments: {_mib(tot['params_memory'])} ({tot['n_params']:,} parameters, {itemsize} bytes each)")
    print("elementwise costs (operations per element, forward / backward): "
          + ", ".join(f"{k} {v['fwd']}/{v['bwd']}" for k, v in ELEMENTWISE.items() if k != "layernorm")
          + f", layernorm {ELEMENTWISE['layernorm']['fwd']}/{ELEMENTWISE['layernorm']['bwd']} (+1/+1 with β, "
          f"+{ELEMENTWISE['layernorm']['per_row_fwd']} per row forward)")
    if c.dropout > 0:
        print(f"dropout {c.dropout}: its masks (three per block and one after the embedding) are not in the table")
    return 0
