"""A LoRA step at Qwen3-0.6B's shape: pedestrian against transformers + PEFT in one run.

The model: ``Qwen3ForCausalLM`` at Qwen3-0.6B's published shape (28 blocks, d_model 1,024,
16 query / 8 key-value heads of 128 with per-head q/k RMS norms, SwiGLU 3,072, vocabulary
151,936, tied; 596 M parameters), float32, random weights written by transformers'
``save_pretrained`` and loaded from that folder by both sides (so the first losses agree).
Context 512 (``--context``), batch 1.

The step: LoRA r 8 (PEFT ``lora_alpha`` 16 = pedestrian's α 2, no dropout, base frozen) on the
seven projections ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``, AdamW on the
adapters. Each side runs in a fresh process of its own on the same number of threads, warm-up
steps then timed steps (wall clock, median), and reports its peak resident memory (``VmHWM``: the
whole process). The sides run one after the other: the ratio means something on an idle machine.

Usage::

    python3 benchmarks/bench_qwen3.py            # writes benchmarks/results/qwen3_0.6b_lora.*
    python3 benchmarks/bench_qwen3.py --tiny     # a tiny shape: checks that everything runs
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_moe  # noqa: E402
import common  # noqa: E402

SHAPES = {
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072),
    "tiny": dict(vocab_size=500, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, intermediate_size=64),
}
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS = ["q", "k", "v", "attn_proj", "mlp_gate", "mlp_expand", "mlp_contract"]   # the same seven
RANK, LORA_ALPHA, LR = 8, 16.0, 1e-4


def write_folder(shape: dict, context: int, path: Path) -> None:
    import torch
    import transformers

    cfg = transformers.Qwen3Config(**shape, max_position_embeddings=context, tie_word_embeddings=True,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(str(path))


def child(args) -> None:
    """One side's steps in this process (torch imported by the transformers side only, as in
    :func:`bench_moe.child`)."""
    if args.side == "transformers":
        import torch

        torch.set_num_threads(args.threads)
    if args.side == "pedestrian":                   # (bench_moe's runners, with the seven projections)
        result = bench_moe.run_pedestrian(args.folder, args.context, args.warmup, args.steps, TARGETS)
    else:
        result = bench_moe.run_transformers(args.folder, args.context, args.warmup, args.steps, HF_TARGETS)
    result["peak_mib"] = common.peak_rss_mib()
    print(json.dumps(result))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny shape (checks that the script runs)")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--threads", type=int, default=2, help="threads of each side (default 2)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--side", choices=["pedestrian", "transformers"], help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        child(args)
        return 0
    common.reexec_with_threads(args.threads)
    name = "tiny" if args.tiny else "qwen3-0.6b"
    T = 32 if args.tiny else args.context
    shape, info = SHAPES[name], common.machine_info()
    with tempfile.TemporaryDirectory() as tmp:
        write_folder(shape, T, Path(tmp))
        results = {}
        for side in ("pedestrian", "transformers"):
            results[side] = common.child_json([__file__, "--side", side, "--folder", tmp, "--context", str(T),
                                               "--threads", str(args.threads), "--warmup", str(args.warmup),
                                               "--steps", str(args.steps)], timeout=3600)
            print(side, results[side], flush=True)
    ped, hf = results["pedestrian"], results["transformers"]
    time_ratio, mem_ratio = ped["ms"] / hf["ms"], ped["peak_mib"] / hf["peak_mib"]
    text = (f"{common.machine_line(info)}\n\nQwen3 at {name}'s shape ({shape['num_hidden_layers']} blocks, d "
            f"{shape['hidden_size']}, {shape['num_attention_heads']}/{shape['num_key_value_heads']} heads of "
            f"{shape['head_dim']}, SwiGLU {shape['intermediate_size']}, vocabulary {shape['vocab_size']:,}, tied), "
            f"context {T}, LoRA r {RANK} on the seven projections, {args.threads} threads, median of {args.steps} "
            "steps:\n\n| side | step ms | peak MiB | first loss |\n|---|---|---|---|\n"
            f"| pedestrian | {ped['ms']:.1f} | {ped['peak_mib']:.0f} | {ped['first_loss']:.6f} |\n"
            f"| transformers + PEFT | {hf['ms']:.1f} | {hf['peak_mib']:.0f} | {hf['first_loss']:.6f} |\n\n"
            f"time ratio {time_ratio:.2f}, memory ratio {mem_ratio:.2f} (pedestrian / transformers)\n")
    if not args.tiny:
        common.write_json("qwen3_0.6b_lora", {"info": info, "shape": shape, "context": T, "results": results,
                                              "time_ratio": time_ratio, "memory_ratio": mem_ratio})
        common.write_markdown("qwen3_0.6b_lora", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
