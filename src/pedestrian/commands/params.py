"""Print the parameter table (per layer, per kind, total) of a preset or config, without allocating.

Examples:
  pedestrian params --preset gpt2
  pedestrian params --preset gpt2 --lora-rank 16 --lora-targets logits
  pedestrian params --vocab-size 65 --context-length 64 --d-model 128 --n-heads 4 --n-blocks 4
  pedestrian params --preset gpt2 --d-mlp 3000 --no-qkv-bias
  pedestrian params --preset gpt2 --position-encoding rope     # no position table: 786,432 fewer
"""

from __future__ import annotations

import argparse
import dataclasses

from ..config import ARCHS, CONFIG_FIELDS, MLPS, NORMS, POSITION_ENCODINGS, PRESETS, GPTConfig, with_arch
from ..model.layout import LORA_LAYER_KINDS
from ..paper.explain import params_table


def add_config_arguments(parser: argparse.ArgumentParser):
    """Model-shape flags shared by several commands (``--preset`` plus per-field overrides).
    Returns their argument group ("model"), for a command to add its own model flags to."""
    g = parser.add_argument_group("model")
    g.add_argument("--preset", choices=sorted(PRESETS), help="start from a named config")
    for name in ("vocab-size", "context-length", "d-model", "n-heads", "n-blocks", "d-head", "d-qk", "mlp-ratio"):
        g.add_argument("--" + name, type=int)
    g.add_argument("--arch", choices=list(ARCHS), help="gpt2 (default) or llama (RMS norm, SwiGLU, RoPE, "
                   "no biases, n_heads/2 key/value heads); fills the fields not given explicitly")
    g.add_argument("--norm", choices=list(NORMS), help="the blocks' norm (layernorm: GPT-2; rmsnorm: Llama)")
    g.add_argument("--mlp", choices=list(MLPS), help="the MLP (standard: GPT-2; swiglu: Llama's gated one)")
    g.add_argument("--n-kv-heads", type=int, help="key/value heads, dividing --n-heads (grouped-query attention)")
    g.add_argument("--d-mlp", type=int, metavar="N", help="MLP width, SwiGLU's too (default mlp_ratio · d_model; "
                   "--arch llama: 8/3 · d_model rounded up to a multiple of 8)")
    g.add_argument("--activation", choices=["gelu_tanh", "gelu", "relu", "silu"])
    g.add_argument("--ln-eps", type=float)
    g.add_argument("--no-bias", dest="bias", action="store_false", default=None)
    g.add_argument("--untied", dest="tie_weights", action="store_false", default=None)
    g.add_argument("--non-causal", dest="causal", action="store_false", default=None)
    g.add_argument("--position-encoding", choices=list(POSITION_ENCODINGS),
                   help="learned table (GPT-2, default), rotary q/k (rope), or none")
    g.add_argument("--rope-base", type=float, help="RoPE base b: pair j turns by b^(-2j/r) per position (10000)")
    g.add_argument("--rope-fraction", type=float, help="fraction of each head's d_qk RoPE rotates (1.0)")
    return g


def config_from_args(args: argparse.Namespace, base: dict | None = None) -> GPTConfig:
    """A :class:`GPTConfig` from ``--preset`` and field flags (flags win), over ``base``.

    Raises:
        ValueError: required widths missing (the message names them) or invalid values.
    """
    values = dict(base or {})
    if getattr(args, "preset", None):
        values.update(PRESETS[args.preset])
    given = {f: getattr(args, f) for f in CONFIG_FIELDS if getattr(args, f, None) is not None}
    values.update(given)
    values = with_arch(values, getattr(args, "arch", None), given)
    missing = [f for f in ("vocab_size", "context_length", "d_model", "n_heads", "n_blocks") if f not in values]
    if missing:
        raise ValueError("missing model settings: " + ", ".join("--" + m.replace("_", "-") for m in missing)
                         + " (or pass --preset)")
    return GPTConfig(**values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    g = parser.add_argument_group("biases (this command only)")
    g.add_argument("--qkv-bias", dest="qkv_bias", action="store_true", default=None,
                   help="q, k, v biases even with --no-bias")
    g.add_argument("--no-qkv-bias", dest="qkv_bias", action="store_false",
                   help="no q, k, v biases (the other biases follow --no-bias)")
    parser.add_argument("--lora-rank", type=int, help="also count LoRA adapters of this rank")
    parser.add_argument("--lora-targets", nargs="+", default=["all"],
                        help=f"LoRA layer kinds: {' '.join(LORA_LAYER_KINDS)} or all (default all)")
    parser.add_argument("--per-block", action="store_true", help="list every block's parameters "
                        "(default: block 0 only, the others are identical)")


def run(args: argparse.Namespace) -> int:
    if args.preset is None and args.vocab_size is None:
        args.preset = "gpt2"
    config = config_from_args(args)
    if args.qkv_bias is not None:
        config = dataclasses.replace(config, qkv_bias=args.qkv_bias)
    if args.lora_rank is not None and args.lora_rank < 1:
        raise ValueError(f"--lora-rank must be a positive integer, got {args.lora_rank}")
    lora = None if args.lora_rank is None else (args.lora_rank, args.lora_targets)
    print(params_table(config, args.per_block, lora))
    return 0
