"""Check the hand-written backward of your own layer, tensor by tensor.

The file is a plain NumPy module that defines three functions:

  def example():                 # -> (inputs, params): dicts of name -> ndarray
  def forward(inputs, params):   # -> (output ndarray, cache)
  def backward(delta, cache):    # -> (input_deltas, param_grads): dicts keyed like inputs, params

Every floating-point input delta and parameter gradient is compared in float64 with central
differences, complex step and PyTorch autograd where the forward allows (docs/guide.md: Check your
own layer). One line per tensor; exit status 0 when every tensor passes, 1 when one fails, 2 on
a usage error.

Examples:
  pedestrian check docs/examples/dyt.py
  pedestrian check my_layer.py --max-entries 200 --no-autograd
"""

from __future__ import annotations

import argparse

from ..paper.check import check_gradients, load_layer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("layer", metavar="LAYER.py", help="the layer module (example, forward, backward)")
    parser.add_argument("--seed", type=int, default=0, help="draws the error signal δ and the sampled entries (0)")
    parser.add_argument("--max-entries", type=int, metavar="N",
                        help="check at most N entries per tensor, sampled (default: all)")
    parser.add_argument("--no-autograd", dest="autograd", action="store_false", default=None,
                        help="do not compare with PyTorch autograd (torch.func) even if installed")
    parser.add_argument("--no-complex-step", dest="complex_step", action="store_false",
                        help="do not try the forward on complex input")


def run(args: argparse.Namespace) -> int:
    if args.max_entries is not None and args.max_entries < 1:
        raise ValueError(f"--max-entries must be a positive integer, got {args.max_entries}")
    inputs, params, forward, backward = load_layer(args.layer)
    report = check_gradients(forward, backward, inputs, params, seed=args.seed, max_entries=args.max_entries,
                             complex_step=args.complex_step, autograd=args.autograd)
    return 0 if report.passed else 1
