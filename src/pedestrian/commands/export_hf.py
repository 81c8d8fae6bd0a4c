"""Write a model as a Hugging Face directory (config.json, model.safetensors, tokenizer) of its family (GPT-2,
Llama, Qwen2/3, Mistral, Gemma 2/3, OLMo 2, SmolLM3, Mixtral, Qwen3-MoE, OLMoE); or its LoRA adapters as a PEFT directory.

Sources:
  --checkpoint CKPT          a full checkpoint of `pedestrian train` (adapters, if any, merged);
                             a fine-tune's adapter checkpoint is treated as --adapter
  --adapter RUN              a `pedestrian finetune` run (or its adapter/ checkpoint); the base is
                             the --hf-dir recorded in it (or --hf-dir BASE)

With --format model, adapters are merged (W + alpha D U); one on the tied logits goes into a
separate lm_head.weight (the export is untied, wte unchanged). transformers reads the result
with AutoModelForCausalLM.from_pretrained(OUT) (--format peft: peft.PeftModel.from_pretrained(base, OUT)).

Examples:
  pedestrian export-hf --checkpoint runs/shakespeare_char/best --out shakespeare-gpt2
  pedestrian export-hf --adapter runs/ft --out gpt2-ft              # base + adapters, merged
  pedestrian export-hf --adapter runs/ft --format peft --out ft-peft # only the adapters
"""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="CKPT", help="a full checkpoint (e.g. runs/NAME/best)")
    src.add_argument("--adapter", metavar="RUN", help="a finetune run folder or its adapter/ checkpoint")
    parser.add_argument("--hf-dir", metavar="DIR", help="base model of --adapter (default: the recorded one)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--format", choices=["model", "peft"], default="model",
                        help="model: a Hugging Face directory with adapters merged (default); "
                             "peft: only the adapters, as a PEFT directory")
    parser.add_argument("--overwrite", action="store_true", help="replace the files of an existing --out")


def run(args: argparse.Namespace) -> int:
    from ..cli import UserError
    from ..interop.hf import OutputExistsError, merged_for_export, save_pretrained, token_ids
    from ..interop.peft import save_peft_adapter
    from ..load import adapter_checkpoint_dir, load_model

    if args.checkpoint and adapter_checkpoint_dir(args.checkpoint) is not None:
        args.adapter, args.checkpoint = args.checkpoint, None      # an adapter: same as --adapter
    if args.hf_dir and not args.adapter:
        raise UserError("--hf-dir names the base model of --adapter; with --checkpoint leave it out")
    loaded = load_model(args.adapter or args.checkpoint, args.hf_dir, adapters=bool(args.adapter) or None)
    model = loaded.model
    try:
        if args.format == "peft":
            if not model.lora_targets:
                raise UserError("this model has no LoRA adapters; use --format model")
            out = save_peft_adapter(model, args.out, base_model_name_or_path=loaded.base, overwrite=args.overwrite)
            print(f"wrote the PEFT adapter ({len(model.lora_targets)} layers, r={model.lora_rank}, "
                  f"alpha={model.lora_alpha:g}) to {out}")
            return 0
        if model.lora_targets:
            tied = "logits" in model.lora_targets and model.config.tie_weights
            model = merged_for_export(model)
            if tied:
                print("note: the adapter on the tied logits is merged into a separate lm_head.weight, so "
                      "the exported model is untied (tie_word_embeddings=false; wte unchanged)")
        out = save_pretrained(model, args.out, loaded.tokenizer, overwrite=args.overwrite, token_ids=token_ids(loaded.hf_config),
                              copy_from=loaded.base)           # (a fine-tune's base: its chat template, stop ids)
    except OutputExistsError as exc:          # the library names overwrite=True; the user typed flags
        raise UserError(exc.advice("pass --overwrite")) from None
    arch = json.loads((out / "config.json").read_text(encoding="utf-8"))["architectures"][0]
    print(f"wrote a Hugging Face {arch} ({model.num_params():,} parameters) to {out}")
    if (out / "pedestrian_tokenizer.json").is_file():
        print("note: its character tokenizer has no Hugging Face format: transformers loads the model from this "
              "folder but AutoTokenizer cannot; pedestrian reads pedestrian_tokenizer.json (sample, eval, "
              "load_pretrained)")
    return 0
