"""Generate text from a checkpoint or a Hugging Face GPT-2 directory, printing tokens as they come.

Examples:
  pedestrian sample --checkpoint runs/shakespeare_char/best --prompt "ROMEO:" --max-new-tokens 300 \\
      --temperature 0.8 --top-k 40 --seed 1
  pedestrian sample --hf-dir gpt2 --prompt "The meaning of life" --top-p 0.9 --seed 0
  pedestrian sample --checkpoint runs/finetune --prompt "Dear diary,"   # base + LoRA adapters
  pedestrian sample --checkpoint runs/shakespeare_char/best --prompt "ROMEO:" --repetition-penalty 1.2 \\
      --min-p 0.05 --temperature 0.9        # penalise repeats, drop tokens < 5% of the top one
  pedestrian sample --checkpoint runs/shakespeare_char/best --prompt "ROMEO:" --stop $'\\n\\n' \\
      --stop "JULIET:"                     # end at a blank line or at "JULIET:", unprinted
  pedestrian sample --checkpoint runs/shakespeare_char/best --prompt "ROMEO:" --prompt "First Citizen:" \\
      --temperature 0                      # two prompts of different lengths, one batch
  pedestrian sample --checkpoint runs/shakespeare_char/best --prompts-file prompts.txt   # one per line

Behaviour:
  - Several prompts (--prompt repeated, or --prompts-file) are generated together, left-padded,
    each row computing what it would alone; each continuation is printed when all are done,
    under a "--- prompt N ---" line (with --num-samples: "--- prompt N, sample M ---").
  - The prompt is echoed, then each new token is printed as soon as its text is complete: with
    byte-level BPE a token that ends inside a multi-byte UTF-8 character is held back until the
    character is complete (an incomplete character left at the very end prints as U+FFFD).
  - --temperature 0 is greedy decoding; --top-p must be in (0, 1] (0 is an error, not greedy);
    --top-k larger than the vocabulary means no top-k filter.
  - Order, as Hugging Face transformers: repetition penalty -> temperature -> top-k -> top-p ->
    min-p (greedy: the penalty, then argmax). --repetition-penalty R (> 0; 1 = none) divides
    the positive logit of every token already in the prompt or the output by R and multiplies
    a negative one by R; --min-p P (in [0, 1]) keeps the tokens at least P times as likely as
    the most likely one (1 keeps the tokens tied for the top: greedy only without a tie).
  - Only ids the tokenizer can decode are sampled: a model whose vocabulary is larger than its
    tokenizer's (GPT-2 padded to 50,304) never produces the extra ids.
  - An empty prompt starts from <|endoftext|> when the tokenizer has it (GPT-2 convention) and
    is an error otherwise. A prompt longer than the context keeps its last context_length
    tokens (with a one-line warning on stderr).
  - Every setting is checked before anything is printed.
  - Generation stops at <|endoftext|> (when the tokenizer has it; --ignore-eot to go on), at a
    --stop-id token, or when the generated text contains a --stop TEXT: stop strings are text,
    matched on the decoded output however it is split into tokens (--stop $'\\n' also stops
    inside a "\\n\\n" token; a stop may span several tokens), and only on the generated text,
    not on the prompt. The output ends right before the first stop: neither the stop token nor
    the stop text is printed (text that may still begin a stop string is held back until it
    is decided). Past the context length the window slides (see pedestrian.generation.generate).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import TextIO

from ..generation.prompts import check_completion, complete, encode_prompt


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter     # keep the examples' layout
    src = parser.add_argument_group("model (one of --checkpoint / --hf-dir, or both for a fine-tune)")
    src.add_argument("--checkpoint", help="a checkpoint or run folder of `pedestrian train`, or a "
                     "`pedestrian finetune` run folder (or its adapter/ checkpoint)")
    src.add_argument("--hf-dir", help="a Hugging Face GPT-2 directory (config.json + weights); with a "
                     "fine-tune --checkpoint: its base model (default: the one recorded in it)")
    parser.add_argument("--prompt", action="append", default=None,
                        help="text to continue (default: empty, see above); repeatable: several prompts "
                        "are generated together as one batch and printed one after the other, labelled")
    parser.add_argument("--prompts-file", metavar="FILE",
                        help="a UTF-8 text file with one prompt per line (empty lines skipped), "
                        "generated together like several --prompt")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default 200)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    parser.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens")
    parser.add_argument("--top-p", type=float, default=None,
                        help="nucleus: keep the smallest set of tokens with probability >= p, in (0, 1]")
    parser.add_argument("--min-p", type=float, default=None, metavar="P",
                        help="keep tokens at least P times as likely as the most likely one, in [0, 1] "
                        "(e.g. 0.05; applied after --top-p)")
    parser.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                        help="divide the positive logits of tokens already in the prompt or output by "
                        "R, multiply the negative ones (R > 0; 1 = none; e.g. 1.2)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (same seed, same text)")
    parser.add_argument("--num-samples", type=int, default=1,
                        help="generate this many samples of the prompt as one batch (default 1)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop when the generated text contains TEXT (any tokenization; TEXT is "
                        "not printed); repeatable, the first one found ends the sample")
    parser.add_argument("--stop-id", action="append", type=int, default=[], metavar="ID",
                        help="stop at this token id; repeatable")
    parser.add_argument("--ignore-eot", action="store_true", help="do not stop at <|endoftext|>")
    parser.add_argument("--window-shift", type=int, default=1,
                        help="past the context, drop this many oldest tokens per slide (default 1)")
    parser.add_argument("--no-cache", action="store_true",
                        help="recompute the full forward pass for every token (slow; for comparison)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default=None,
                        help="compute dtype (default: the checkpoint's, float32 for --hf-dir)")
    parser.add_argument("--backend", choices=["numpy", "torch"], default="numpy")
    parser.add_argument("--stats", action="store_true", help="print tokens/s to stderr at the end")


def _load_model(args: argparse.Namespace):
    """``(model, tokenizer)`` from ``--checkpoint`` and/or ``--hf-dir`` (imports are lazy).

    A fine-tune run (or its ``adapter/`` checkpoint) is loaded onto its base model: the one
    recorded in it, or ``--hf-dir``.
    """
    from ..cli import UserError

    if args.checkpoint:
        from ..training.finetune import adapter_checkpoint_dir, load_finetuned

        adapter = adapter_checkpoint_dir(args.checkpoint)
        if adapter is not None:
            return load_finetuned(adapter, args.hf_dir, dtype=args.dtype, backend=args.backend)
        if args.hf_dir:
            raise UserError(f"--hf-dir with --checkpoint names the base model of a fine-tune run; "
                            f"{args.checkpoint} is not one, so pass only one of them")
        from ..checkpoint import load_checkpoint

        ckpt = load_checkpoint(args.checkpoint, backend=args.backend, dtype=args.dtype)
        if getattr(ckpt, "tokenizer", None) is None:
            raise UserError(f"checkpoint {args.checkpoint} has no tokenizer saved beside it, so its "
                            "token ids cannot be turned into text")
        return ckpt.model, ckpt.tokenizer
    if args.hf_dir:
        from ..interop.hf import load_pretrained

        return load_pretrained(args.hf_dir, dtype=args.dtype or "float32", backend=args.backend)
    raise UserError("pass --checkpoint CKPT (a train or finetune run) or --hf-dir DIR (a Hugging Face "
                    "GPT-2 directory)")


def _prompt_texts(args: argparse.Namespace) -> list[str]:
    """The prompts of ``--prompt`` (repeatable) and ``--prompts-file`` (one per line), in that order;
    ``[""]`` when none is given."""
    texts = [args.prompt] if isinstance(args.prompt, str) else list(args.prompt or [])
    if getattr(args, "prompts_file", None):
        from pathlib import Path

        path = Path(args.prompts_file)
        try:
            lines = path.read_text(encoding="utf-8-sig").splitlines()
        except FileNotFoundError:
            raise ValueError(f"--prompts-file {path}: no such file") from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"--prompts-file {path} is not UTF-8 text (byte {exc.start}); save it as "
                             "UTF-8") from None
        texts += [line for line in lines if line.strip()]
        if not any(line.strip() for line in lines):
            raise ValueError(f"--prompts-file {path} holds no prompt (every line is empty)")
    return texts or [""]


def flag(name: str) -> str:
    """A setting's flag, for the library's messages: ``top_p`` -> ``--top-p``."""
    return "--" + {"stop_ids": "stop_id"}.get(name, name).replace("_", "-")


def run_sample(model, tokenizer, args: argparse.Namespace, out: TextIO | None = None,
               err: TextIO | None = None) -> int:
    """The body of ``pedestrian sample`` once the model and tokenizer are loaded: the prompts,
    :func:`pedestrian.generation.prompts.complete`, and the printing (to ``out`` / ``err``,
    default ``sys.stdout`` / ``sys.stderr``). One prompt and sample streams its text as it comes.

    Raises:
        ValueError: a bad setting (named by its flag) or prompt (see
            :mod:`pedestrian.generation.prompts`); NaN logits while generating.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    settings = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                    repetition_penalty=args.repetition_penalty, num_samples=args.num_samples,
                    stop=list(args.stop), stop_ids=list(args.stop_id), window_shift=args.window_shift)
    check_completion(model, tokenizer, max_new_tokens=args.max_new_tokens, named=flag, **settings)
    prompts = _prompt_texts(args)
    given = args.prompt is not None or bool(getattr(args, "prompts_file", None))
    only = "the --prompt" if given else "no --prompt was given, so the prompt"      # a single prompt
    prompt_ids = [encode_prompt(tokenizer, text, only if len(prompts) == 1 else f"--prompt {i + 1}")
                  for i, text in enumerate(prompts)]
    C = model.config.context_length
    for i, ids in enumerate(prompt_ids):
        if len(ids) > C:
            which = "the prompt" if len(prompts) == 1 else f"prompt {i + 1}"
            err.write(f"warning: {which} has {len(ids)} tokens but the model's context is {C}: "
                      f"only the last {C} condition the generation\n")
            err.flush()
    streaming = len(prompts) * args.num_samples == 1

    def stream(row: int, text: str) -> None:
        out.write(text)
        out.flush()

    if streaming:
        stream(0, prompts[0])
    with warnings.catch_warnings():                     # already said above, in one line
        warnings.filterwarnings("ignore", message="the prompt has", category=UserWarning)
        done = complete(model, tokenizer, prompt_ids, args.max_new_tokens, seed=args.seed,
                        ignore_eot=args.ignore_eot, use_cache=not args.no_cache,
                        on_text=stream if streaming else None, **settings)
    if streaming:
        out.write("\n")
    for (i, j), text in zip(done.rows, done.texts) if not streaming else ():
        label = (f"sample {j + 1}" if len(prompts) == 1 else
                 f"prompt {i + 1}" if args.num_samples == 1 else f"prompt {i + 1}, sample {j + 1}")
        out.write(f"--- {label} ---\n{prompts[i]}{text}\n")
    out.flush()
    if args.stats:
        B = len(done.rows)
        err.write(f"[{done.new_tokens} new tokens x {B} in {done.seconds:.3f} s: "
                  f"{done.new_tokens * B / max(done.seconds, 1e-12):.1f} tokens/s, "
                  f"{'uncached' if args.no_cache else 'KV cache'}]\n")
    return 0


def run(args: argparse.Namespace) -> int:
    model, tokenizer = _load_model(args)
    return run_sample(model, tokenizer, args)
