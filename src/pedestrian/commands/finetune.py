"""LoRA fine-tuning of a Hugging Face directory (GPT-2, Llama, Qwen2/3, Mistral, Gemma 2/3, SmolLM3, OLMo 2, Mixtral, Qwen3-MoE or OLMoE) on a text file or a
conversations file (.jsonl, through the folder's chat template), or on
preference pairs with DPO (--dpo): the base weights stay frozen (their gradients are never computed)
and only small adapters are trained.

Writes, under --out: adapter/ (an adapter-only checkpoint, a small file), peft/ (the same
adapters as a PEFT directory for transformers + peft; a mixture's experts as PEFT's
target_parameters; where PEFT cannot hold them the run says so), log.jsonl and loss_curve.png.

Examples:
  pedestrian finetune --hf-dir gpt2 --data my_notes.txt --lora-rank 8
  pedestrian finetune --hf-dir gpt2 --data corpus/ --lora-rank 16 --lora-alpha 2 \\
      --lora-targets q k v attn_proj mlp_expand mlp_contract --max-steps 500 --out runs/ft
  pedestrian export-hf --adapter runs/ft --out gpt2-ft     # merge into a new GPT-2 directory
  pedestrian finetune --hf-dir instruct --data chat.jsonl --lora-rank 16 --pack --out runs/chat
  pedestrian finetune --hf-dir instruct --dpo pairs.jsonl --dpo-beta 0.1 --lora-rank 8 --out runs/dpo
  pedestrian sample --hf-dir gpt2-ft --prompt "Dear diary,"
  pedestrian finetune --hf-dir SmolLM2-135M --data my_notes.txt --lora-rank 8 \\
      --lora-targets q_proj k_proj v_proj o_proj gate_proj up_proj down_proj --out runs/smol-ft
  pedestrian finetune --hf-dir SmolLM2-135M --data my_notes.txt --lora-rank 8 --out runs/smol-ft --resume
  pedestrian finetune --hf-dir SmolLM2-135M-Instruct --dpo pairs.jsonl --dpo-beta 0.1 --lora-rank 8 \\
      --lora-targets q_proj v_proj --out runs/smol-dpo     # preference pairs: DPO
"""

from __future__ import annotations

import argparse
import sys

from ..training.finetune import FinetuneSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    FinetuneSettings.add_flags(parser)            # every flag from the settings' declarations


def run(args: argparse.Namespace) -> int:
    from ..training.finetune import finetune

    settings = FinetuneSettings.from_args(args)
    result = finetune(settings, explicit=FinetuneSettings.explicit(args))
    if result.stop_reason == "interrupted":
        print(f"interrupted: the adapters of step {result.step} are saved in {result.out / 'adapter'} and "
              f"{result.out / 'peft'}; continue with: {result.resume_command}", file=sys.stderr)
        return 130
    what = "DPO loss" if settings.dpo else "loss"
    unit = "" if settings.dpo else " nats/token"
    print(f"validation {what} {result.initial_val_loss:.4f} -> {result.val_loss:.4f}{unit} after "
          f"{result.step} steps ({result.trainable_params:,} trainable parameters); "
          f"adapters in {result.out / 'adapter'}" + (f" and {result.peft}" if result.peft else ""))
    return 0
