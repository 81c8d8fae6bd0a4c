"""Generate text from a checkpoint or a Hugging Face directory (any family finetune loads), printing tokens as they come.

Examples:
  pedestrian sample --checkpoint runs/shakespeare_char --prompt "ROMEO:" --temperature 0.8 --top-k 40 --seed 1
  pedestrian sample --hf-dir gpt2 --prompt "The meaning of life" --top-p 0.9 --seed 0
  pedestrian sample --checkpoint runs/finetune --prompt "Dear diary,"   # base + LoRA adapters
  pedestrian sample --checkpoint runs/shakespeare_char --prompt "ROMEO:" --repetition-penalty 1.2 --min-p 0.05
  pedestrian sample --checkpoint runs/shakespeare_char --prompt "ROMEO:" --stop $'\\n\\n' --stop "JULIET:"
  pedestrian sample --checkpoint runs/shakespeare_char --prompt "ROMEO:" --prompt "First Citizen:"  # one batch
  pedestrian sample --checkpoint runs/shakespeare_char --prompts-file prompts.txt   # one prompt per line
  pedestrian sample --hf-dir SmolLM2-135M-Instruct --chat --prompt "What is a gradient?" --system "Be brief."

Behaviour (more in docs/guide.md, Sampling):
  - Several prompts (--prompt repeated, or --prompts-file) are generated together, left-padded,
    each row computing what it would alone, and printed when all are done under a "--- prompt N
    ---" line ("--- prompt N, sample M ---" with --num-samples).
  - --chat: each prompt is a user turn (after a --system turn) rendered with the folder's chat
    template and the assistant's header (as transformers' apply_chat_template with
    add_generation_prompt); the answer alone is printed, ending at the folder's eos_token_id
    (Llama 3 Instruct's <|eot_id|>, Qwen2's <|im_end|>).
  - One prompt is echoed, then each token printed as soon as its text is complete (a byte-level
    BPE token ending inside a UTF-8 character waits for the rest; left incomplete: U+FFFD).
  - Order, as Hugging Face transformers: repetition penalty -> temperature -> top-k -> top-p ->
    min-p. --temperature 0 is greedy (after the penalty); --top-p is in (0, 1] (0 is an error);
    --top-k above the vocabulary means no top-k filter.
  - Only ids the tokenizer can decode are sampled (a model whose vocabulary is larger than its
    tokenizer's, GPT-2 padded to 50,304, never produces the extra ids).
  - An empty prompt starts from <|endoftext|> (error without it); a prompt longer than the
    context keeps its last context_length tokens (one warning line on stderr).
  - Every setting is checked before anything is printed.
  - A sample ends at the folder's eos_token_id (generation_config.json, else config.json; int or
    list, as transformers' generate; a checkpoint: <|endoftext|>) (--ignore-eot: go on), a --stop-id token, or right before a
    --stop TEXT in the generated text, however it is tokenized: neither the stop token nor the
    stop text is printed. Past the context the window slides (pedestrian.generation.generate).
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from ..generation.prompts import check_completion, encode_prompt, read_prompts, write_completions
from ..generation.sampling import Sampling
from ..training.specs import flag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter     # keep the examples' layout
    src = parser.add_argument_group("model (one of --checkpoint / --hf-dir, or both for a fine-tune)")
    src.add_argument("--checkpoint", help="a checkpoint or run folder of `pedestrian train`, or a "
                     "`pedestrian finetune` run folder (or its adapter/ checkpoint)")
    src.add_argument("--hf-dir", help="a Hugging Face directory (GPT-2, Llama, Qwen, Mistral, Gemma, OLMo, SmolLM3, MoE) (config.json + weights); with a "
                     "fine-tune --checkpoint: its base model (default: the one recorded in it)")
    parser.add_argument("--prompt", action="append", default=None,
                        help="text to continue (default: empty, see above); repeatable: several prompts "
                        "are generated together as one batch and printed one after the other, labelled")
    parser.add_argument("--chat", action="store_true",
                        help="each prompt is a user turn of a chat, rendered with the --hf-dir folder's chat template "
                        "(with the assistant's header after it); only the answer is printed")
    parser.add_argument("--system", metavar="TEXT", default=None,
                        help="with --chat: a system turn before the user's")
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
    parser.add_argument("--ignore-eot", action="store_true", help="do not stop at the end-of-sequence ids (the "
                        "folder's eos_token_id, else <|endoftext|>)")
    parser.add_argument("--window-shift", type=int, default=1,
                        help="past the context, drop this many oldest tokens per slide (default 1)")
    parser.add_argument("--no-cache", action="store_true",
                        help="recompute the full forward pass for every token (slow; for comparison)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default=None,
                        help="compute dtype (default: the checkpoint's, float32 for --hf-dir)")
    parser.add_argument("--backend", choices=["numpy", "torch"], default="numpy")
    parser.add_argument("--stats", action="store_true", help="print tokens/s to stderr at the end")


def _load_model(args: argparse.Namespace):
    """``(model, tokenizer, folder)`` from ``--checkpoint`` and/or ``--hf-dir``
    (:func:`pedestrian.load.load_model`); ``folder``: the Hugging Face directory (the model's, or
    a fine-tune's base), else ``None``."""
    from ..cli import UserError
    from ..load import adapter_checkpoint_dir, load_model

    if args.checkpoint and args.hf_dir and adapter_checkpoint_dir(args.checkpoint) is None:
        raise UserError(f"--hf-dir with --checkpoint names the base model of a fine-tune run; "
                        f"{args.checkpoint} is not one, so pass only one of them")
    loaded = load_model(args.checkpoint, args.hf_dir, dtype=args.dtype, backend=args.backend)
    if loaded.tokenizer is None:
        raise UserError(f"checkpoint {args.checkpoint} has no tokenizer saved beside it, so its "
                        "token ids cannot be turned into text")
    return loaded.model, loaded.tokenizer, loaded.base


def sampling_from_args(args: argparse.Namespace) -> Sampling:
    """The :class:`~pedestrian.generation.sampling.Sampling` of ``pedestrian sample``'s flags; a
    ``ValueError`` names the flag (``top_p``: ``--top-p``, ``stop_ids``: ``--stop-id``)."""
    return Sampling(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty, args.seed,
                    tuple(args.stop_id), tuple(args.stop), args.ignore_eot, named=named)


def named(name: str) -> str:
    return flag({"stop_ids": "stop_id"}.get(name, name))


def run_sample(model, tokenizer, args: argparse.Namespace, out: TextIO | None = None,
               err: TextIO | None = None, *, eos_ids=None, template=None) -> int:
    """The body of ``pedestrian sample`` once the model and tokenizer are loaded: the prompts,
    :func:`pedestrian.generation.prompts.write_completions` (to ``out``, default ``sys.stdout``),
    the warnings and ``--stats`` (to ``err``, default ``sys.stderr``). ``eos_ids``: the ids a
    sample ends at (a Hugging Face folder's ``eos_token_id``; ``None``: the tokenizer's
    ``<|endoftext|>``), see :func:`pedestrian.generation.prompts.complete`. ``template``: with
    ``--chat``, the folder's :class:`~pedestrian.text.chat.ChatTemplate`: each prompt becomes
    ``[system turn (--system),] user turn`` rendered with the assistant's header after it
    (:func:`pedestrian.text.chat.render`), and only the answers are printed.

    Raises:
        ValueError: a bad setting (named by its flag) or prompt (see
            :mod:`pedestrian.generation.prompts`); NaN logits while generating.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    sampling = sampling_from_args(args)
    check_completion(model, tokenizer, max_new_tokens=args.max_new_tokens, num_samples=args.num_samples,
                     stop_ids=sampling.stop_ids, window_shift=args.window_shift, named=named)
    prompts = read_prompts([args.prompt] if isinstance(args.prompt, str) else args.prompt or [],
                           getattr(args, "prompts_file", None))
    given = args.prompt is not None or bool(getattr(args, "prompts_file", None))
    only = "the --prompt" if given else "no --prompt was given, so the prompt"      # a single prompt
    if template is not None:                     # --chat: a user turn each, the answer printed alone
        from ..text.chat import user_turn_prompt

        prompt_ids = [user_turn_prompt(text, tokenizer, template, system=args.system) for text in prompts]
        prompts = [""] * len(prompts)
    else:
        prompt_ids = [encode_prompt(tokenizer, text, only if len(prompts) == 1 else f"--prompt {i + 1}")
                      for i, text in enumerate(prompts)]
    done = write_completions(model, tokenizer, prompts, prompt_ids, args.max_new_tokens, sampling, out, err,
                             num_samples=args.num_samples, window_shift=args.window_shift, use_cache=not args.no_cache,
                             eos_ids=eos_ids)
    if args.stats:
        B = len(done.rows)
        err.write(f"[{done.new_tokens} new tokens x {B} in {done.seconds:.3f} s: "
                  f"{done.new_tokens * B / max(done.seconds, 1e-12):.1f} tokens/s, "
                  f"{'uncached' if args.no_cache else 'KV cache'}]\n")
    return 0


def run(args: argparse.Namespace) -> int:
    from ..interop.hf_chat import eos_token_ids

    from ..cli import UserError

    if args.system is not None and not args.chat:
        raise UserError("--system is the system turn of a --chat prompt; add --chat (and an --hf-dir folder "
                        "with a chat template)")
    model, tokenizer, folder = _load_model(args)
    template = None
    if args.chat:
        if folder is None:
            raise UserError("--chat renders the prompt with a Hugging Face folder's chat template; this "
                            "checkpoint has none: pass --hf-dir DIR (an instruct model's folder)")
        from ..interop.hf_chat import folder_chat_template

        template = folder_chat_template(folder)
    eos_ids = eos_token_ids(folder) if folder else None                 # the folder's, as generate()
    return run_sample(model, tokenizer, args, eos_ids=eos_ids, template=template)
