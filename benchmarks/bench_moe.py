"""A LoRA step of a small mixture of experts: pedestrian against transformers + PEFT in one run.

The model: a Qwen3-MoE of a small shape (8 blocks, d_model 512, 8 query / 4 key-value heads of
64 with per-head q/k norms, 16 experts 384 wide, 2 per token, renormalised; vocabulary 32,000;
untied; ``output_router_logits`` with ``router_aux_loss_coef`` 0.001, so both losses carry the
load-balancing term), float32, random weights written by transformers' ``save_pretrained`` and
loaded from that folder by both sides. Context 512, batch 1.

The step: LoRA r 8 (PEFT ``lora_alpha`` 16 = pedestrian's α 2, no dropout, base frozen) on
``q_proj k_proj v_proj o_proj``, the loss's backward through the frozen experts and routers,
AdamW on the adapters. Only the attention is adapted on both sides: transformers 5 keeps a
block's experts as 3-D parameters, which PEFT's ``target_modules`` cannot adapt (pedestrian can:
``--lora-targets gate_proj up_proj down_proj`` puts an adapter on every expert; not compared).

Each side runs in a fresh process of its own (``--side``), on the same number of threads
(``torch.set_num_threads`` = numba's), warm-up steps then timed steps (wall clock, median), and
reports its peak resident memory (``VmHWM``, the whole process: weights, optimizer, activations).
The sides run one after the other, so the ratio is meaningful on an idle machine only.

Usage::

    python3 benchmarks/bench_moe.py                   # the shape above, writes benchmarks/results/moe_lora.*
    python3 benchmarks/bench_moe.py --tiny            # a tiny shape: checks that everything runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SHAPES = {
    "small": dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=64, intermediate_size=1536, moe_intermediate_size=384, num_experts=16,
                  num_experts_per_tok=2, context=512),
    "tiny": dict(vocab_size=500, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                 context=64),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
RANK, LORA_ALPHA, LR = 8, 16.0, 1e-4


def write_folder(shape: dict, path: Path) -> None:
    import torch
    import transformers

    kw = {k: v for k, v in shape.items() if k != "context"}
    cfg = transformers.Qwen3MoeConfig(**kw, max_position_embeddings=shape["context"], norm_topk_prob=True,
                                      output_router_logits=True, router_aux_loss_coef=0.001, tie_word_embeddings=False,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(str(path))


def batch(vocab: int, T: int):
    """``(x, targets)``: ``T`` random ids, and the same ids shifted by one with the last target
    ignored -- the targets transformers forms from ``labels=x`` (so the two losses are one number)."""
    x = np.random.default_rng(0).integers(0, vocab, size=(1, T)).astype(np.int64)
    return x, np.concatenate([x[:, 1:], np.full((1, 1), -100)], axis=1)


def run_pedestrian(folder: str, T: int, warmup: int, steps: int, targets=("q", "k", "v", "attn_proj")) -> dict:
    """pedestrian's LoRA steps on the folder (``targets``: its layer names); median ms, first loss."""
    from pedestrian.interop.hf import load_hf_model
    from pedestrian.training.optim import AdamW

    model = load_hf_model(folder)
    model.training = True
    model.add_lora(list(targets), rank=RANK, alpha=LORA_ALPHA / RANK)
    opt = AdamW(model, lr=LR)
    x, y = batch(model.config.vocab_size, T)
    times, losses = [], []
    for i in range(warmup + steps):
        t = time.perf_counter()
        losses.append(float(model.loss(x, y)))
        model.backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return {"ms": 1e3 * statistics.median(times), "first_loss": losses[0], "parts": {
        k: float(v) for k, v in model.loss_parts.items()}}


def run_transformers(folder: str, T: int, warmup: int, steps: int, targets=TARGETS) -> dict:
    """transformers + PEFT's LoRA steps on the folder (``targets``: PEFT module names)."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                                       target_modules=list(targets)))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    x = torch.as_tensor(batch(model.config.vocab_size, T)[0])
    times, losses = [], []
    for i in range(warmup + steps):
        t = time.perf_counter()
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss))
        if i >= warmup:
            times.append(time.perf_counter() - t)
    aux = getattr(out, "aux_loss", None)
    return {"ms": 1e3 * statistics.median(times), "first_loss": losses[0], "aux": None if aux is None else float(aux)}


def child(args) -> None:
    """One side's steps in this process. Only the transformers side imports torch (195 MiB of
    resident memory that a pedestrian user's process does not hold); the thread count reaches
    pedestrian through the environment :func:`common.reexec_with_threads` set."""
    if args.side == "transformers":
        import torch

        torch.set_num_threads(args.threads)
    run = run_pedestrian if args.side == "pedestrian" else run_transformers
    result = run(args.folder, args.context, args.warmup, args.steps)
    result["peak_mib"] = common.peak_rss_mib()
    print(json.dumps(result))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny shape (checks that the script runs)")
    p.add_argument("--threads", type=int, default=2, help="threads of each side (default 2)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--side", choices=["pedestrian", "transformers"], help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        child(args)
        return 0
    common.reexec_with_threads(args.threads)
    shape = SHAPES["tiny" if args.tiny else "small"]
    info = common.machine_info()
    with tempfile.TemporaryDirectory() as tmp:
        write_folder(shape, Path(tmp))
        results = {}
        for side in ("pedestrian", "transformers"):
            results[side] = common.child_json([__file__, "--side", side, "--folder", tmp, "--context",
                                               str(shape["context"]), "--threads", str(args.threads), "--warmup",
                                               str(args.warmup), "--steps", str(args.steps)], timeout=3600)
            print(side, results[side], flush=True)
    ped, hf = results["pedestrian"], results["transformers"]
    time_ratio, mem_ratio = ped["ms"] / hf["ms"], ped["peak_mib"] / hf["peak_mib"]
    name = "moe_lora_tiny" if args.tiny else "moe_lora"
    text = (f"{common.machine_line(info)}\n\nQwen3-MoE {'tiny' if args.tiny else 'small'} shape "
            f"({shape['num_hidden_layers']} blocks, d {shape['hidden_size']}, {shape['num_experts']} experts × "
            f"{shape['moe_intermediate_size']}, {shape['num_experts_per_tok']} per token), context {shape['context']}, "
            f"LoRA r {RANK} on q k v o, {args.threads} threads, median of {args.steps} steps:\n\n"
            "| side | step ms | peak MiB | first loss |\n|---|---|---|---|\n"
            f"| pedestrian | {ped['ms']:.1f} | {ped['peak_mib']:.0f} | {ped['first_loss']:.6f} |\n"
            f"| transformers + PEFT | {hf['ms']:.1f} | {hf['peak_mib']:.0f} | {hf['first_loss']:.6f} |\n\n"
            f"time ratio {time_ratio:.2f}, memory ratio {mem_ratio:.2f} (pedestrian / transformers)\n")
    common.write_json(name, {"info": info, "shape": shape, "results": results, "time_ratio": time_ratio,
                             "memory_ratio": mem_ratio})
    common.write_markdown(name, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
