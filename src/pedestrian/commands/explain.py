"""Print the paper's table for a model: every activation a_i and error signal Δ_i of one training
step, with its shape, formula, the parameters it touches, forward and backward FLOPs and the
memory the forward keeps for it; totals at the bottom, beside the 6·N·tokens rule.

The model: a checkpoint (--checkpoint: its config, dtype, batch and context), a `pedestrian
train` settings file (--config FILE.toml), a Hugging Face model folder (--hf-dir DIR: its
config.json), a preset (--preset, with the field flags of `pedestrian params`), or else the
default model of `pedestrian train` on the bundled plays (84 characters). --batch-size and
--seq-len set B and T (default: the run's batch size, or 1, and the context length; a
`pedestrian finetune` run's micro-batch and training window, with a line on its LoRA adapters). Nothing is allocated. How FLOPs and memory are counted: the notes under
the table and pedestrian.paper.explain.

Examples:
  pedestrian explain
  pedestrian explain --preset gpt2 --batch-size 8 --seq-len 1024
  pedestrian explain --preset char-small --position-encoding rope
  pedestrian explain --checkpoint runs/shakespeare_char/best
  pedestrian explain --config configs/shakespeare_char.toml
  pedestrian explain --preset smollm2-135m --seq-len 2048 --unfused-head
  pedestrian explain --hf-dir Qwen3-30B-A3B --seq-len 512
"""

from __future__ import annotations

import argparse

from ..config import CONFIG_FIELDS, GPTConfig
from ..paper.explain import explain_table, lora_run_note
from ..training.settings import add_model_flags, config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("which model (at most one of these)")
    src.add_argument("--checkpoint", metavar="CKPT", help="a checkpoint folder or run folder")
    src.add_argument("--config", metavar="FILE.toml", help="a `pedestrian train` settings file")
    src.add_argument("--hf-dir", metavar="DIR", help="a Hugging Face model folder (its config.json; no weights read)")
    add_model_flags(parser)                       # --preset and the field flags
    parser.add_argument("--batch-size", type=int, metavar="B", help="sequences per step")
    parser.add_argument("--seq-len", type=int, metavar="T", help="tokens per sequence (default: context length)")
    parser.add_argument("--dtype", choices=["float32", "float64"], help="for the memory column (default float32, "
                        "or the checkpoint's)")
    parser.add_argument("--unfused-head", action="store_true", help="count the step as model.fused_head = False "
                        "runs it: the logits and their softmax kept whole (default: model.loss's fused head)")


def _resolve(args) -> tuple[GPTConfig, int | None, str, list | None, dict]:
    """``(config, batch size or None, dtype, a checkpoint's plugged layers, a pedestrian finetune
    checkpoint's recorded settings or {})`` from the chosen source."""
    sources = [name for name in ("checkpoint", "config", "hf_dir", "preset") if getattr(args, name)]
    if len(sources) > 1:
        raise ValueError(f"give at most one of --checkpoint, --config, --hf-dir, --preset (got "
                         f"{', '.join('--' + s.replace('_', '-') for s in sources)})")
    dtype = args.dtype or "float32"
    flags = [f for f in CONFIG_FIELDS if getattr(args, f, None) is not None and f != "vocab_size"]
    if (args.checkpoint or args.config or args.hf_dir) and flags:
        raise ValueError(f"--{flags[0].replace('_', '-')} changes a preset's model; --checkpoint, --config and "
                         "--hf-dir bring their own (drop the flag, or use --preset)")
    if args.hf_dir:
        from ..interop.hf import HFFolder

        return HFFolder(args.hf_dir).config, None, dtype, None, {}
    if args.checkpoint:
        from ..checkpoint import read_state

        _, state = read_state(args.checkpoint)
        config = GPTConfig.from_dict(state["config"])
        meta = state.get("meta") or {}
        finetune = meta.get("finetune") or {}                # (a finetune run's settings are there)
        settings = meta.get("settings") or finetune
        return config, settings.get("batch_size"), args.dtype or state.get("dtype", "float32"), state.get("layers"), finetune
    if args.config:
        from ..training.settings import config_file_model

        config, settings = config_file_model(args.config, args.vocab_size or None)
        return config, settings.batch_size, args.dtype or settings.dtype, None, {}
    if args.preset or args.vocab_size:
        return config_from_args(args), None, dtype, None, {}
    from ..training import DEFAULT_MODEL, TrainSettings

    return config_from_args(args, {**DEFAULT_MODEL, "vocab_size": 84}), TrainSettings().batch_size, dtype, None, {}


def run(args: argparse.Namespace) -> int:
    from ..training.finetune import training_window

    config, run_batch, dtype, layers, finetune = _resolve(args)
    B = args.batch_size if args.batch_size is not None else (run_batch or 1)
    window = training_window(finetune.get("context_length"), config.context_length) if finetune else None
    T = args.seq_len if args.seq_len is not None else (window or config.context_length)
    print(explain_table(config, B, T, dtype, layers, fused_head=not args.unfused_head))
    if finetune:
        print("\n" + lora_run_note(config, finetune["lora_rank"], finetune["lora_targets"]))
    return 0
