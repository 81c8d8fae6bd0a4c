"""An SFT step and a DPO step with LoRA at SmolLM2-135M's shape: pedestrian against transformers +
PEFT (the same masking written here) and, where ``trl`` is installed, TRL's own log-probability
head -- time and peak memory, each (side, step) in a process of its own.

The model: preset ``smollm2-135m`` at context ``--context`` (default 512; 30 blocks, d_model 576,
vocabulary 49,152, tied), float32, random weights (the values do not change the cost). LoRA r 8 on
q_proj k_proj v_proj o_proj gate_proj up_proj down_proj (PEFT ``lora_alpha`` 16 = pedestrian's
α 2), no dropout, the base frozen, AdamW on the adapters.

The batch: ``--pairs`` P prompt + answer pairs (default 2), each sequence ``T + 1`` tokens at most
(the prompt half of it, the answers of random lengths, padded): the **SFT step** trains on the
``2P`` rows of prompt + answer (the loss on the answer tokens only: the targets of the prompt and
the padding are ``-100``), the **DPO step** on the P pairs (the same ``2P`` rows: chosen, then
rejected), β 0.1:

- pedestrian: ``train_step`` (fused head) for SFT; :func:`pedestrian.training.dpo.dpo_step` for
  DPO (the reference = the same model with its adapters off, one per-row fused head call, no
  ``2P × T × V`` logits kept);
- ``peft``: transformers' ``LlamaForCausalLM`` under ``peft.get_peft_model``; SFT
  ``cross_entropy(logits, targets, ignore_index=-100)``; DPO per-row ``log_softmax(logits)``
  gathered on the answer targets and summed, the reference under ``disable_adapter()`` and
  ``no_grad``, ``−logsigmoid(β m).mean()`` -- TRL's formula written out;
- ``trl`` (if ``import trl`` works): the same, but the log-probabilities from TRL's fused LM
  head (``trl.trainer.utils.add_fused_lm_head``: ``model(..., labels=, fused_lm_head=True)``, what
  ``DPOTrainer`` runs), for SFT and DPO alike.

Each (side, step) runs in a fresh subprocess: ``--warmup`` steps, then ``--steps`` timed by the
wall clock (``time.perf_counter``), median reported, and the process's peak resident memory
(``VmHWM``) after them. Threads: ``--threads N`` sets numba's, the BLAS libraries' and torch's.

    python3 benchmarks/bench_dpo.py                        # the measurement (an idle machine)
    python3 benchmarks/bench_dpo.py --tiny                 # a few-second check that it runs

Writes ``benchmarks/results/dpo_smollm2_135m.json`` and ``.md`` (``--tiny`` writes nothing) and
prints a Markdown table (time and memory of each side, pedestrian's ratio to each peer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_RANK, LORA_ALPHA, BETA, LR = 8, 16.0, 0.1, 1e-4
KINDS = ("sft", "dpo")


def make_config(T: int, tiny: bool):
    from pedestrian.config import GPTConfig, preset

    if tiny:
        return GPTConfig(vocab_size=512, context_length=T, d_model=64, n_heads=4, n_kv_heads=2, n_blocks=2,
                         norm="rmsnorm", mlp="swiglu", d_mlp=128, position_encoding="rope", bias=False,
                         tie_weights=True)
    return preset("smollm2-135m", context_length=T)


def make_batch(config, P: int, T: int, seed: int = 0):
    """``(tokens, targets)`` ``(2P, T)``: rows ``prompt + answer`` (chosen rows, then rejected), the
    prompt ``T // 2`` tokens, each answer ``T // 4 … T // 2 + 1`` tokens, targets on the answers."""
    from pedestrian.training.preference import Pair, pair_batch

    rng = np.random.default_rng(seed)
    n_prompt = T // 2

    def ids(n):
        return tuple(int(i) for i in rng.integers(1, config.vocab_size, n))

    pairs = [Pair(ids(n_prompt), ids(int(rng.integers(T // 4, T - n_prompt + 2))),
                  ids(int(rng.integers(T // 4, T - n_prompt + 2)))) for _ in range(P)]
    return pair_batch(pairs, T)


def hf_config(config):
    import transformers

    c = config
    return transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_mlp,
        num_hidden_layers=c.n_blocks, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads or c.n_heads,
        head_dim=c.d_head, max_position_embeddings=c.context_length, rms_norm_eps=c.ln_eps,
        rope_theta=c.rope_base, tie_word_embeddings=c.tie_weights, attention_bias=False, mlp_bias=False,
        hidden_act="silu", bos_token_id=0, eos_token_id=0, pad_token_id=0)


# ---------------------------------------------------------------------------------- the sides
def pedestrian_step(config, kind):
    from pedestrian.model import GPT
    from pedestrian.training import train_step
    from pedestrian.training.dpo import dpo_step
    from pedestrian.training.optim import AdamW

    model = GPT(config, seed=0)
    model.add_lora(SEVEN, rank=LORA_RANK, alpha=LORA_ALPHA / LORA_RANK, freeze_base=True)
    opt = AdamW(model, lr=LR)
    if kind == "sft":
        return lambda x, y: train_step(model, opt, [(x, y)], LR)[0]
    return lambda x, y: dpo_step(model, opt, [(x, y)], LR, beta=BETA)[0]


def peer_step(config, kind, fused_head: bool):
    import peft
    import torch
    import torch.nn.functional as F
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(hf_config(config))
    if fused_head:
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(base)                           # before PEFT wraps it (TRL's order)
    model = peft.get_peft_model(base, peft.LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                                      target_modules=SEVEN, bias="none"))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, fused=True)

    def token_logps(x, y):                               # (2P, T) log p of each counted target, 0 elsewhere
        if fused_head:                                   # TRL's: the labels shifted inside, so pass x ++ y_last
            ids = torch.cat([x, y[:, -1:].clamp(min=0)], dim=1)
            labels = torch.cat([torch.full_like(y[:, :1], -100), y], dim=1)
            return model(input_ids=ids, labels=labels, fused_lm_head=True, use_cache=False).log_probs
        logits = model(input_ids=x, use_cache=False).logits
        lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, y.clamp(min=0)[..., None])[..., 0]
        return lp * (y != -100)

    def sft(x, y):
        x, y = torch.from_numpy(x), torch.from_numpy(y)
        opt.zero_grad(set_to_none=True)
        if fused_head:
            loss = -token_logps(x, y).sum() / (y != -100).sum()
        else:
            logits = model(input_ids=x, use_cache=False).logits
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1), ignore_index=-100)
        loss.backward()
        opt.step()
        return float(loss.detach())

    def dpo(x, y):
        x, y = torch.from_numpy(x), torch.from_numpy(y)
        opt.zero_grad(set_to_none=True)
        with torch.no_grad(), model.disable_adapter():
            ref = token_logps(x, y).sum(-1)
        logp = token_logps(x, y).sum(-1)
        P = x.shape[0] // 2
        m = BETA * ((logp[:P] - ref[:P]) - (logp[P:] - ref[P:]))
        loss = -F.logsigmoid(m).mean()
        loss.backward()
        opt.step()
        return float(loss.detach())

    return sft if kind == "sft" else dpo


def child(args) -> None:
    """One (side, step): build, warm up, time, print ``{"ms", "peak_mib", "loss"}`` as JSON."""
    common.reexec_with_threads(args.threads)
    config = make_config(args.context, args.tiny)
    x, y = make_batch(config, args.pairs, args.context)
    side, kind = args.child.split(":")
    step = pedestrian_step(config, kind) if side == "pedestrian" else peer_step(config, kind, side == "trl")
    for _ in range(args.warmup):
        loss = step(x, y)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        loss = step(x, y)
        times.append(time.perf_counter() - t)
    print(json.dumps({"ms": 1e3 * statistics.median(times), "all_ms": [1e3 * t for t in times],
                      "peak_mib": common.peak_rss_mib(), "loss": loss}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=None, help="T (default 512; --tiny: 32)")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a 2-block, d_model 64 model: check that it runs")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.context = args.context or (32 if args.tiny else 512)
    if args.child:
        return child(args)
    try:
        import trl  # noqa: F401
        sides = ["pedestrian", "peft", "trl"]
    except ImportError:
        sides = ["pedestrian", "peft"]
    info = common.machine_info()
    flags = ["--context", str(args.context), "--pairs", str(args.pairs), "--threads", str(args.threads),
             "--warmup", str(args.warmup), "--steps", str(args.steps)] + (["--tiny"] if args.tiny else [])
    results = {}
    for kind in KINDS:
        for side in sides:
            r = common.child_json([str(Path(__file__).resolve()), *flags, "--child", f"{side}:{kind}"],
                                  timeout=3600)
            results[f"{side}:{kind}"] = r
            print(f"{side:>10} {kind}: {r['ms']:9.1f} ms  peak {r['peak_mib']:8.1f} MiB  loss {r['loss']:.4f}",
                  flush=True)
    lines = [f"SFT and DPO steps with LoRA r {LORA_RANK}, {args.pairs} pairs (2 × {args.pairs} rows) × "
             f"{args.context} tokens, {args.threads} thread(s){' (tiny model)' if args.tiny else ''}.",
             "", common.machine_line(info), "",
             "| step | side | time (ms, median) | peak memory (MiB) | pedestrian ÷ side: time | memory |",
             "|---|---|---:|---:|---:|---:|"]
    for kind in KINDS:
        mine = results[f"pedestrian:{kind}"]
        for side in sides:
            r = results[f"{side}:{kind}"]
            lines.append(f"| {kind.upper()} | {side} | {r['ms']:.1f} | {r['peak_mib']:.0f} | "
                         f"{mine['ms'] / r['ms']:.2f} | {mine['peak_mib'] / r['peak_mib']:.2f} |")
    print("\n".join(lines))
    if not args.tiny:                                    # (a --tiny check writes nothing)
        common.write_json("dpo_smollm2_135m", {"info": info, "args": vars(args), "results": results})
        common.write_markdown("dpo_smollm2_135m", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
