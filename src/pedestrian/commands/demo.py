"""Forward and backward on real text, every gradient printed as the paper names it and checked;
or one attention head on numbers, every matrix on screen.

Takes a few windows of the bundled Shakespeare (or --data), a character tokenizer and a tiny
float64 GPT (weights larger than the usual initialisation, so every path carries a visible
signal), runs a0 -> a12 and back with the chosen --kernels, and prints one line per gradient in
the order the backward produces them -- the error signals Δi = ∂L/∂ai, each block's Δcausal =
∂L/∂ρ_causal, every parameter's gradient (∂L/∂W_q of block 0, ...) -- with its largest entry and
its agreement with a check (pedestrian.paper.gradients):

  fd        central finite differences (default; NumPy only) on --entries entries of every
            parameter, step --step: a line passes when |numeric - analytic| <= atol + rtol·|numeric|.
  autograd  every tensor against PyTorch autograd of the test suite's independent model
            (tests/oracles/torch_reference.py): a line passes within 1e-9 · max |autograd|.

With learned positions (or none) the key bias's line passes as rounding noise (its gradient is 0,
§3); under RoPE it is not 0 (each key's bias is rotated by its position) and is checked like any
other. A failing line ends with "<- FAILED"; exit status 1 if any check fails.

--head: the paper's section 3 example (Table 1), one attention head on a tiny random input, every
matrix named (--json: float64 nested lists). --mask: the paper's literal 0/1 mask beside the −∞
one. --properties: the paper's statements about positions, measured. Exit status 1 if the −∞
mask or a property does not behave as stated.

Examples:
  pedestrian demo                              # also: --check autograd, --kernels reference
  pedestrian demo --check fd --entries 10 --seed 3
  pedestrian demo --arch llama --check autograd  # RMS norm, SwiGLU, GQA, Llama 3 RoPE
  pedestrian demo --data my_text.txt --check fd --step 1e-6
  pedestrian demo --head                       # also: --mask, --properties
  pedestrian demo --head --T 5 --d 4 --d-rho 3 --d-h 2 --seed 7 --json
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

from ..kernels import KERNELS
from ..paper.demo import demo_model, properties_text
from ..paper.gradients import autograd_oracle, check_model_gradients, gradients_text
from ..paper.head_text import head_json, head_text, mask_json, mask_text
from ..paper.walkthrough import head_example, mask_comparison
from ..training.specs import flag as _flag

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", help="text file or folder (default: the bundled Shakespeare)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kernels", choices=KERNELS, default=None,
                        help="the paper's reference layers or the fast kernels "
                             "(default: PEDESTRIAN_KERNELS, else fast)")
    parser.add_argument("--arch", choices=["gpt2", "llama"], default=None, help="the demo model's "
                        "architecture: gpt2 (default) or llama (RMS norm, SwiGLU, GQA 4:2, Llama 3 RoPE)")
    parser.add_argument("--check", choices=["fd", "autograd"], default=None,
                        help="fd: finite differences (default); autograd: every tensor against "
                             "PyTorch autograd of the test suite's oracle (needs PyTorch and a source checkout)")
    parser.add_argument("--entries", type=int, default=None,
                        help="finite differences: entries checked per parameter tensor (>= 1, default 3)")
    parser.add_argument("--step", type=float, default=None, help="finite-difference step h (> 0, default 1e-5)")
    parser.add_argument("--rtol", type=float, default=None,
                        help="finite differences: relative tolerance (default 1e-6)")
    parser.add_argument("--atol", type=float, default=None,
                        help="finite differences: absolute tolerance (default 1e-8)")
    parser.add_argument("--properties", action="store_true",
                        help="measure the paper's position properties instead (see above)")
    head = parser.add_argument_group("one attention head on numbers (--head, --mask)")
    head.add_argument("--head", action="store_true", help="the worked example of one attention head")
    head.add_argument("--mask", action="store_true", help="the paper's 0/1 mask against −∞, same numbers")
    head.add_argument("--T", type=int, default=None, help="tokens (default 4)")
    head.add_argument("--d", type=int, default=None, help="input features (default 3)")
    head.add_argument("--d-rho", type=int, default=None, help="query/key width d_ρ (default 2)")
    head.add_argument("--d-h", type=int, default=None, help="value width d_h (default 2)")
    head.add_argument("--no-causal", action="store_true", help="--head without the causal mask")
    head.add_argument("--json", action="store_true", help="one JSON object instead of text")


#: flags of the whole-model check, and of the one-head example: a flag of one mode given to the
#: other is an error, not silently ignored
_MODEL_FLAGS = ("data", "kernels", "arch", "check", "entries", "step", "rtol", "atol")
_HEAD_FLAGS = ("T", "d", "d_rho", "d_h", "no_causal", "json")


def _given(args: argparse.Namespace, names) -> list:
    return [_flag(n) for n in names if getattr(args, n, None) not in (None, False)]


def _they(flags: list, verb: str = "belong") -> str:
    """``--a belongs`` / ``--a, --b belong``."""
    return ", ".join(flags) + f" {verb}" + ("s" if len(flags) == 1 else "")


def _check_modes(args: argparse.Namespace) -> None:
    """Reject combinations of flags that belong to different modes (``ValueError`` naming them)."""
    modes = _given(args, ("head", "mask", "properties"))
    if len(modes) > 1:
        raise ValueError(f"{' and '.join(modes)} cannot be combined; choose one")
    if args.head or args.mask:
        if _given(args, _MODEL_FLAGS):
            raise ValueError(f"{_they(_given(args, _MODEL_FLAGS))} to the whole-model check, "
                             f"not to {modes[0]} (which takes --T, --d, --d-rho, --d-h, --seed, --json)")
        if args.mask and args.no_causal:
            raise ValueError("--mask compares two causal masks; --no-causal has no place there")
        for name, default in (("T", 4), ("d", 3), ("d_rho", 2), ("d_h", 2)):
            value = getattr(args, name)
            if value is None:
                setattr(args, name, default)
            elif value < 1:
                raise ValueError(f"{_flag(name)} must be a positive integer, got {value}")
        return
    if _given(args, _HEAD_FLAGS):
        raise ValueError(f"{_they(_given(args, _HEAD_FLAGS))} to --head / --mask; "
                         "add one of them (pedestrian demo --head)")
    if args.properties:
        return
    if args.check == "autograd" and _given(args, ("entries", "step", "rtol", "atol")):
        raise ValueError(f"{_they(_given(args, ('entries', 'step', 'rtol', 'atol')), 'set')} the "
                         "finite differences; --check autograd takes none of them")
    for name, default in (("check", "fd"), ("entries", 3), ("step", 1e-5), ("rtol", 1e-6), ("atol", 1e-8)):
        if getattr(args, name) is None:
            setattr(args, name, default)


def _check_flags(args: argparse.Namespace) -> None:
    """Validate the flags (``ValueError`` naming the flag)."""
    if args.entries < 1:
        raise ValueError(f"--entries must be a positive integer, got {args.entries}")
    if not (math.isfinite(args.step) and args.step > 0):
        raise ValueError(f"--step must be a finite number > 0 (e.g. 1e-5), got {args.step}")
    for name in ("rtol", "atol"):
        v = getattr(args, name)
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise ValueError(f"--{name} must be a finite number >= 0, got {v}")


def run(args: argparse.Namespace) -> int:
    _check_modes(args)
    if args.head or args.mask:
        sizes = dict(T=args.T, d=args.d, d_rho=args.d_rho, d_h=args.d_h, seed=args.seed)
        if args.head:
            ex = head_example(**sizes, causal=not args.no_causal)
            text, ok = (json.dumps(head_json(ex)), True) if args.json else head_text(ex, args.seed, not args.no_causal)
        else:
            cmp = mask_comparison(**sizes)
            text, ok = (json.dumps(mask_json(cmp)), True) if args.json else mask_text(cmp, args.seed)
        print(text)
        return 0 if ok else 1
    if args.properties:
        text, ok = properties_text(args.data, args.seed)
        print(text)
        return 0 if ok else 1
    _check_flags(args)
    oracle = autograd_oracle() if args.check == "autograd" else None   # say what is missing now
    rng = np.random.default_rng(args.seed)         # the weights, the batch, then the fd entries
    model, x, y, tokenizer, text = demo_model(args.data, args.seed, args.kernels, rng, arch=args.arch or "gpt2")
    source = args.data or "the bundled Shakespeare"
    print(f"text: {len(text):,} characters of {source}, vocabulary {tokenizer.vocab_size}; "
          f"batch {x.shape}, first window: {tokenizer.decode(x[0])!r}")
    print(f"model: {model.config}, float64, kernels: {model.kernels_name} "
          f"(pedestrian.{'kernels' if model.kernels_name == 'fast' else 'layers'})")
    loss, lines, oracle_loss = check_model_gradients(model, x, y, args.check, entries=args.entries, step=args.step,
                                                     rtol=args.rtol, atol=args.atol, rng=rng, oracle=oracle)
    text, ok = gradients_text(loss, lines, tokenizer.vocab_size, args.check, entries=args.entries, step=args.step,
                              rtol=args.rtol, atol=args.atol, oracle_loss=oracle_loss)
    print(text)
    return 0 if ok else 1
