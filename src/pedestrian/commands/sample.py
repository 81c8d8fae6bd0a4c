"""Generate text from a checkpoint or a Hugging Face GPT-2 directory, printing tokens as they come.

Examples:
  pedestrian sample --checkpoint runs/char/ckpt --prompt "ROMEO:" --max-new-tokens 300 \\
      --temperature 0.8 --top-k 40 --seed 1
  pedestrian sample --hf-dir gpt2 --prompt "The meaning of life" --top-p 0.9 --seed 0
  pedestrian sample --checkpoint runs/finetune --prompt "Dear diary,"   # base + LoRA adapters

Behaviour:
  - The prompt is echoed, then each new token is printed as soon as its text is complete: with
    byte-level BPE a token that ends inside a multi-byte UTF-8 character is held back until the
    character is complete (an incomplete character left at the very end prints as U+FFFD).
  - --temperature 0 is greedy decoding; --top-p must be in (0, 1] (0 is an error, not greedy);
    --top-k larger than the vocabulary means no top-k filter.
  - An empty prompt starts from <|endoftext|> when the tokenizer has it (GPT-2 convention) and
    is an error otherwise. A prompt longer than the context keeps its last context_length
    tokens (with a one-line warning on stderr).
  - Every setting is checked before anything is printed.
  - Generation stops at <|endoftext|> (when the tokenizer has it; --ignore-eot to go on) or at
    any --stop / --stop-id token; the stop token is not printed. Past the context length the
    window slides (see pedestrian.generate).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

import numpy as np

EOT = "<|endoftext|>"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter     # keep the examples' layout
    src = parser.add_argument_group("model (one of --checkpoint / --hf-dir, or both for a fine-tune)")
    src.add_argument("--checkpoint", help="a checkpoint or run folder of `pedestrian train`, or a "
                     "`pedestrian finetune` run folder (or its adapter/ checkpoint)")
    src.add_argument("--hf-dir", help="a Hugging Face GPT-2 directory (config.json + weights); with a "
                     "fine-tune --checkpoint: its base model (default: the one recorded in it)")
    parser.add_argument("--prompt", default="", help="text to continue (default: empty, see above)")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate (default 200)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    parser.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens")
    parser.add_argument("--top-p", type=float, default=None,
                        help="nucleus: keep the smallest set of tokens with probability >= p, in (0, 1]")
    parser.add_argument("--seed", type=int, default=None, help="random seed (same seed, same text)")
    parser.add_argument("--num-samples", type=int, default=1,
                        help="generate this many samples of the prompt as one batch (default 1)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop when this text (exactly one token) is generated; repeatable")
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
        from ..finetune import adapter_checkpoint_dir, load_finetuned

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


def _special_id(tokenizer, text: str) -> int | None:
    return getattr(tokenizer, "special_tokens", {}).get(text)


def _stop_ids(tokenizer, args) -> list[int]:
    stops = list(args.stop_id)
    for text in args.stop:
        ids = tokenizer.encode(text)
        if len(ids) != 1:
            raise ValueError(f"--stop {text!r} encodes to {len(ids)} tokens {ids}; a stop must be "
                             "exactly one token (use --stop-id ID for a token id)")
        stops += ids
    eot = _special_id(tokenizer, EOT)
    if eot is not None and not args.ignore_eot:
        stops.append(eot)
    return stops


def run_sample(model, tokenizer, args: argparse.Namespace, out: TextIO | None = None,
               err: TextIO | None = None) -> int:
    """The body of ``pedestrian sample`` once the model and tokenizer are loaded.

    Args:
        model: a :class:`~pedestrian.model.GPT`; tokenizer: a Char/BPE tokenizer.
        args: parsed ``pedestrian sample`` arguments (the model-source flags are not used).
        out / err: text streams (default ``sys.stdout`` / ``sys.stderr``).

    Raises:
        ValueError: bad sampling settings, an empty prompt without ``<|endoftext|>``, an
            unknown character for a char tokenizer, a multi-token ``--stop``.
    """
    from ..generate import generate
    from ..sampling import check_sampling
    from ..tokenizer import StreamDecoder

    import warnings

    from ..tokenizer import UnknownCharacterError, check_text

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        raise ValueError(f"--top-p must be in (0, 1] (1 = no nucleus filter), got {args.top_p:g}; "
                         "for greedy decoding use --temperature 0")
    if args.top_k is not None and args.top_k < 1:
        raise ValueError(f"--top-k must be a positive integer, got {args.top_k}")
    check_sampling(args.temperature, args.top_k, args.top_p)
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    C = model.config.context_length
    if not 1 <= args.window_shift <= C:
        raise ValueError(f"--window-shift must be in [1, context_length={C}] (window_shift), "
                         f"got {args.window_shift}")
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                         f"{model.config.vocab_size}; they do not belong together")
    check_text(args.prompt, "the --prompt")             # bytes that are not UTF-8 on the command line
    try:
        prompt_ids = tokenizer.encode(args.prompt)       # a char tokenizer raises on unknown chars
    except UnknownCharacterError as exc:
        shown = ", ".join(f"{c!r}" for c in list(exc.unknown)[:10])
        raise ValueError(f"the prompt has {len(exc.unknown)} character(s) this model's character vocabulary "
                         f"lacks ({shown}); use only characters that occur in its training text, or "
                         "train with --tokenizer bpe (which encodes any text)") from None
    if not prompt_ids:
        eot = _special_id(tokenizer, EOT)
        if eot is None:
            raise ValueError("the prompt is empty and this tokenizer has no <|endoftext|> token to "
                             "start from; pass --prompt with at least one character")
        prompt_ids = [eot]
    stops = _stop_ids(tokenizer, args)
    V = model.config.vocab_size
    bad = [i for i in args.stop_id if not 0 <= i < V]
    if bad:
        raise ValueError(f"--stop-id {bad[0]} is not a token id of this model: ids are 0 ... {V - 1}")
    stop_set = set(stops)
    if len(prompt_ids) > C:
        err.write(f"warning: the prompt has {len(prompt_ids)} tokens but the model's context is {C}: "
                  f"only the last {C} condition the generation\n")
        err.flush()
    prompt = np.tile(np.asarray(prompt_ids, dtype=np.int64), (args.num_samples, 1))

    streaming = args.num_samples == 1
    decoder = StreamDecoder(tokenizer, skip_special_tokens=True)
    done = [False]

    def on_token(ids):
        if done[0]:
            return
        token = int(ids[0])
        if token in stop_set:
            done[0] = True
            return
        text = decoder.push(token)
        if text:
            out.write(text)
            out.flush()

    if streaming:
        out.write(args.prompt)
        out.flush()
    t0 = time.perf_counter()
    with warnings.catch_warnings():                     # already said above, in one line
        warnings.filterwarnings("ignore", message="the prompt has", category=UserWarning)
        tokens = generate(model, prompt, args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_tokens=stops or None,
                          use_cache=not args.no_cache, on_token=on_token if streaming else None,
                          window_shift=args.window_shift)
    seconds = time.perf_counter() - t0
    if streaming:
        out.write(decoder.flush() + "\n")
    else:
        for i, row in enumerate(tokens):
            new = [int(t) for t in row[len(prompt_ids):]]
            for j, t in enumerate(new):
                if t in stop_set:
                    new = new[:j]
                    break
            out.write(f"--- sample {i + 1} ---\n{args.prompt}")
            decoder = StreamDecoder(tokenizer, skip_special_tokens=True)
            out.write("".join(decoder.push(t) for t in new) + decoder.flush() + "\n")
    out.flush()
    if args.stats:
        n_new = tokens.shape[1] - len(prompt_ids)
        err.write(f"[{n_new} new tokens x {args.num_samples} in {seconds:.3f} s: "
                  f"{n_new * args.num_samples / max(seconds, 1e-12):.1f} tokens/s, "
                  f"{'uncached' if args.no_cache else 'KV cache'}]\n")
    return 0


def run(args: argparse.Namespace) -> int:
    model, tokenizer = _load_model(args)
    return run_sample(model, tokenizer, args)
