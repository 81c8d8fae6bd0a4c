"""Training-step benchmark: pedestrian's hand-written backward against PyTorch eager autograd.

Both sides hold the same weights (copied from pedestrian's parameters), see the same batches and
run the same AdamW update; they take turns (rounds in ABBA order, a pause before each turn so
that the other library's idle threads have stopped spinning) so that machine load hits both
alike, and every figure is a median. Peak memory is measured for each side in its
own subprocess (``VmHWM``, the peak resident set), so the two never mix.

Run (about 2 minutes per backend on 2 cores)::

    python3 benchmarks/bench_train.py --config all                   # NumPy backend
    python3 benchmarks/bench_train.py --config all --backend torch   # torch tensors as plain arrays
    python3 benchmarks/bench_train.py --config char-small --steps 10 --no-memory   # quick look
    python3 benchmarks/bench_train.py --config char-small llama-char --no-breakdown  # GPT-2 vs Llama style
    python3 benchmarks/bench_train.py --config all --threads 1       # single-threaded, both sides
    python3 benchmarks/bench_train.py --config all --backend torch --device cuda --no-breakdown  # on a GPU

Configs: char-small (GPT-2's layout at 4 x 128, tanh GELU, biases), nanogpt-recipe (the model of
nanoGPT's README CPU recipe: the same widths, exact GELU, no biases), gpt2-124M and llama-char
(char-small's widths with ``--arch llama``: RMS norm, SwiGLU, 2 key/value heads, RoPE; its PyTorch
side is transformers' ``LlamaForCausalLM`` with the same weights). Each is
timed twice: paused (a pause before each timed step) and back to back (steps in a row, as the
training loop runs them; the sides alternate in blocks).

Each side runs in a process of its own (spawned), as in a user's training run: the parent
only sends "run N steps" and collects the times and losses. The pedestrian side runs as
``pedestrian train`` does: the model's own loss, backward and AdamW, the fast kernels on numba's
threads.

Writes ``benchmarks/results/train_<backend>.json`` and ``.md`` and refreshes the matching table
in ``docs/performance.md``.

The PyTorch side is a nanoGPT-style ``torch.nn`` module (tied weights, ``nn.Linear`` holding the
transpose of our ``(f_in, f_out)`` weights) with its fastest eager settings: fused AdamW, and
``F.scaled_dot_product_attention`` or manual attention, whichever measures faster here.
"""

from __future__ import annotations

import argparse
import json
import os
import math
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

CONFIGS = {
    # name: (preset, overrides, batch size, sequence length)
    "char-small": ("char-small", {}, 12, 64),
    # nanoGPT's README CPU recipe (4 x 128, 4 heads, context 64, batch 12): exact GELU, no biases
    "nanogpt-recipe": ("char-small", dict(activation="gelu", bias=False), 12, 64),
    "gpt2-124M": ("gpt2", {}, 4, 64),
    # char-small's widths with `--arch llama` (RMS norm, SwiGLU 344, 2 key/value heads, RoPE, no
    # biases); its PyTorch side is transformers' LlamaForCausalLM
    "llama-char": ("llama-char", {}, 12, 64),
}
DEFAULT_STEPS = {"char-small": (3, 32), "nanogpt-recipe": (3, 32), "gpt2-124M": (2, 8), "llama-char": (3, 32)}   # (warm-up, timed) per side
#: per round and side: (timed steps, untimed lead-in steps after the pause). A small model's
#: step is shorter than the pause's effects (cold caches, a clock that slowed down), so it
#: runs a few steps per round after one it does not time; a gpt2-124M step is 3 s: no need.
ROUNDS = {"char-small": (4, 1), "nanogpt-recipe": (4, 1), "gpt2-124M": (1, 0), "llama-char": (4, 1)}
#: back-to-back steps, as a training loop runs them (no pause: the other side's threads may still
#: spin, and each side's own do between its steps): (blocks per side, steps per block), the sides
#: alternating block by block (ABBA)
BACK_TO_BACK = {"char-small": (4, 8), "nanogpt-recipe": (4, 8), "gpt2-124M": (2, 2), "llama-char": (4, 8)}
HPARAMS = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
#: pause before each timed step: OpenBLAS's worker threads spin for about 0.1 s after a matrix
#: product (2^28 cycles, OPENBLAS_THREAD_TIMEOUT), which would halve PyTorch's speed if its
#: step started at once (measured); PyTorch's OpenMP threads spin much less
SETTLE_S = 0.2


# ---------------------------------------------------------------------------------- pedestrian
def make_config(name: str):
    from pedestrian.config import preset

    preset_name, overrides, B, T = CONFIGS[name]
    return preset(preset_name, **overrides), B, T


def make_optimizer(model):
    """pedestrian.training.optim.AdamW with the benchmark's hyper-parameters."""
    from pedestrian.training.optim import AdamW

    return AdamW(model, **HPARAMS), "pedestrian.training.optim.AdamW"


def pedestrian_step(model, opt, x, y) -> float:
    """One training step of a :class:`pedestrian.model.GPT`."""
    loss = model.loss(x, y)
    model.backward()
    opt.step()
    return loss


# ---------------------------------------------------------------------------------- PyTorch
class TorchLlama:
    """transformers' ``LlamaForCausalLM`` for a Llama-style ``config`` (RMS norm, SwiGLU, RoPE),
    called as the nanoGPT-style module is: ``model(idx, targets)`` -> the loss; ``attention``
    ``"sdpa"`` or ``"manual"`` (transformers' ``"eager"``)."""

    def __new__(cls, config, attention: str):
        import torch.nn as nn
        import torch.nn.functional as F
        import transformers

        transformers.logging.set_verbosity_error()
        c = config
        hf_config = transformers.LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_mlp,
            num_hidden_layers=c.n_blocks, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
            head_dim=c.d_head, max_position_embeddings=c.context_length, rms_norm_eps=c.ln_eps,
            rope_theta=c.rope_base, tie_word_embeddings=c.tie_weights, attention_bias=False, mlp_bias=False)

        class Wrapped(nn.Module):
            def __init__(self):
                super().__init__()
                self.hf = transformers.LlamaForCausalLM(hf_config)
                self.attention = attention

            def forward(self, idx, targets):
                want = {"sdpa": "sdpa", "manual": "eager"}[self.attention]
                if self.hf.config._attn_implementation != want:
                    self.hf.set_attn_implementation(want)
                logits = self.hf(input_ids=idx, use_cache=False).logits
                return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-100)

        return Wrapped()


def build_torch_model(config, attention: str):
    """A nanoGPT-style module for ``config`` (bias, tied or untied logits, causal); for a
    Llama-style config (SwiGLU MLP) transformers' ``LlamaForCausalLM`` (:class:`TorchLlama`)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    if config.mlp == "swiglu":
        return TorchLlama(config, attention)
    c = config
    hq, hv = c.n_heads * c.d_qk, c.n_heads * c.d_head
    act = {"gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu,
           "relu": F.relu}[c.activation]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(c.d_model, eps=c.ln_eps, bias=c.bias)
            self.c_attn = nn.Linear(c.d_model, 2 * hq + hv, bias=c.bias)
            self.c_proj = nn.Linear(hv, c.d_model, bias=c.bias)
            self.ln_2 = nn.LayerNorm(c.d_model, eps=c.ln_eps, bias=c.bias)
            self.c_fc = nn.Linear(c.d_model, c.d_mlp, bias=c.bias)
            self.mlp_proj = nn.Linear(c.d_mlp, c.d_model, bias=c.bias)
            self.register_buffer("mask", torch.tril(torch.ones(c.context_length, c.context_length,
                                                               dtype=torch.bool)), persistent=False)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split([hq, hq, hv], dim=2)
            q = q.view(B, T, c.n_heads, c.d_qk).transpose(1, 2)
            k = k.view(B, T, c.n_heads, c.d_qk).transpose(1, 2)
            v = v.view(B, T, c.n_heads, c.d_head).transpose(1, 2)
            if model.attention == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=c.causal)
            else:
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c.d_qk))
                if c.causal:
                    att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
                y = torch.softmax(att, dim=-1) @ v
            y = y.transpose(1, 2).contiguous().view(B, T, hv)
            x = x + self.c_proj(y)
            return x + self.mlp_proj(act(self.c_fc(self.ln_2(x))))

    class TorchGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = attention
            self.wte = nn.Embedding(c.vocab_size, c.d_model)
            self.wpe = nn.Embedding(c.context_length, c.d_model)
            self.h = nn.ModuleList([Block() for _ in range(c.n_blocks)])
            self.ln_f = nn.LayerNorm(c.d_model, eps=c.ln_eps, bias=c.bias)
            self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=c.bias and not c.tie_weights)
            if c.tie_weights:
                self.lm_head.weight = self.wte.weight

        def forward(self, idx, targets):
            T = idx.shape[1]
            x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
            for block in self.h:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1),
                                   ignore_index=-100)

    model = TorchGPT()
    return model


def copy_weights_to_torch(params: dict, tmodel, config) -> None:
    """pedestrian ``(f_in, f_out)`` weights -> nn.Linear's ``(f_out, f_in)``."""
    import torch

    from pedestrian.backend import to_numpy

    if config.mlp == "swiglu":                       # transformers' own names and layouts
        from pedestrian.interop.hf_llama_tensors import llama_state_to_hf

        state = {k: torch.from_numpy(v) for k, v in llama_state_to_hf(params, config).items()}
        missing, unexpected = tmodel.hf.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise RuntimeError(f"weights do not match LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
        return

    def put(dst, name, transpose=False):
        value = to_numpy(params[name])
        with torch.no_grad():
            dst.copy_(torch.from_numpy(np.ascontiguousarray(value.T if transpose else value)))

    put(tmodel.wte.weight, "tok_emb.weight")
    put(tmodel.wpe.weight, "pos_emb.weight")
    for i, blk in enumerate(tmodel.h):
        p = f"blocks.{i}"
        qkv_w = np.concatenate([to_numpy(params[f"{p}.attn.{h}.weight"]) for h in "qkv"], axis=1)
        with torch.no_grad():
            blk.c_attn.weight.copy_(torch.from_numpy(np.ascontiguousarray(qkv_w.T)))
        put(blk.ln_1.weight, f"{p}.ln1.weight")
        put(blk.ln_2.weight, f"{p}.ln2.weight")
        put(blk.c_proj.weight, f"{p}.attn_proj.weight", True)
        put(blk.c_fc.weight, f"{p}.mlp_expand.weight", True)
        put(blk.mlp_proj.weight, f"{p}.mlp_contract.weight", True)
        if config.bias:
            qkv_b = np.concatenate([to_numpy(params[f"{p}.attn.{h}.bias"]) for h in "qkv"])
            with torch.no_grad():
                blk.c_attn.bias.copy_(torch.from_numpy(qkv_b))
            put(blk.ln_1.bias, f"{p}.ln1.bias")
            put(blk.ln_2.bias, f"{p}.ln2.bias")
            put(blk.c_proj.bias, f"{p}.attn_proj.bias")
            put(blk.c_fc.bias, f"{p}.mlp_expand.bias")
            put(blk.mlp_proj.bias, f"{p}.mlp_contract.bias")
    put(tmodel.ln_f.weight, "ln_final.weight")
    if config.bias:
        put(tmodel.ln_f.bias, "ln_final.bias")
    if not config.tie_weights:
        put(tmodel.lm_head.weight, "logits.weight", True)
        if config.bias:
            put(tmodel.lm_head.bias, "logits.bias")


def make_torch_optimizer(tmodel):
    """Fused AdamW (CPU kernels exist since torch 2.4), else foreach; pedestrian's decay split."""
    import torch

    decay = [p for p in tmodel.parameters() if p.dim() >= 2]
    no_decay = [p for p in tmodel.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": HPARAMS["weight_decay"]},
              {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=HPARAMS["lr"], betas=HPARAMS["betas"], eps=HPARAMS["eps"])
    try:
        return torch.optim.AdamW(groups, fused=True, **kw), "fused"
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(groups, foreach=True, **kw), "foreach"


def torch_step(tmodel, topt, x, y) -> float:
    topt.zero_grad(set_to_none=True)
    loss = tmodel(x, y)
    loss.backward()
    topt.step()
    return float(loss.detach())


# ---------------------------------------------------------------------------------- per-layer
class LayerTimer:
    """Time every layer function the model calls (wrappers put into the model's kernels module,
    ``model.kernels``: :mod:`pedestrian.kernels` or :mod:`pedestrian.layers`).

    Linear layers are labelled by their weight's shape (qkv, attn_proj, mlp_expand,
    mlp_contract, logits) and their matrix-product FLOPs are counted (the tied logits layer's
    ``dW_tok = Δ12ᵀ a11`` included). Only the functions the model calls are wrapped, so a layer
    calling another is not counted twice.
    """

    def __init__(self, config, kernels):
        self.kernels = kernels
        c = config
        hq, hv = c.n_heads * c.d_qk, c.n_heads * c.d_head
        n_kv = c.n_kv_heads or c.n_heads
        self.shape_names = {(c.d_model, hq + n_kv * (c.d_qk + c.d_head)): "qkv", (hv, c.d_model): "attn_proj",
                            (c.d_model, c.d_mlp): "mlp_expand" if c.mlp == "standard" else "mlp_gate|expand", (c.d_mlp, c.d_model): "mlp_contract",
                            (c.d_model, c.vocab_size): "logits"}
        self.totals: dict[str, float] = {}
        self.flops: dict[str, float] = {}
        self._saved: dict = {}
        self._lock = threading.Lock()

    def _label_flops(self, name, args, kw):
        if name.startswith("linear_"):
            w = args[1] if name == "linear_forward" else args[2]
            f_in, f_out = w.shape
            rows = int(np.prod(args[0].shape)) // (f_in if name == "linear_forward" else f_out)
            n_mm = 1 if name == "linear_forward" else (kw.get("need_input", True) + (kw.get("dweight") is not None))
            label = f"{name}[{self.shape_names.get(tuple(w.shape), tuple(w.shape))}]"
            return label, 2.0 * rows * f_in * f_out * n_mm
        return name, 0.0

    def __enter__(self):
        from pedestrian.layers import MODEL_FUNCTIONS

        pm = self.kernels
        for name in MODEL_FUNCTIONS:
            fn = getattr(pm, name)
            if name != "attention_weights":
                self._saved[name] = fn

                def wrapped(*args, __fn=fn, __name=name, **kw):
                    t0 = time.perf_counter()
                    out = __fn(*args, **kw)
                    dt = time.perf_counter() - t0
                    label, flops = self._label_flops(__name, args, kw)
                    with self._lock:                    # (calls may come from several threads)
                        self.totals[label] = self.totals.get(label, 0.0) + dt
                        self.flops[label] = self.flops.get(label, 0.0) + flops
                    return out

                setattr(pm, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(self.kernels, name, fn)


def layer_breakdown(model, opt, batches, steps: int = 3) -> dict:
    """Milliseconds per step (means over ``steps``): forward / backward / optimizer, each layer
    function inside (wall clock: each kernel shares its own work over the threads), and the
    GFLOP/s of the matrix products."""
    phases = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    with LayerTimer(model.config, model.kernels) as timer:
        for i in range(steps):
            x, y = batches[i % len(batches)]
            t0 = time.perf_counter()
            model.loss(x, y)
            t1 = time.perf_counter()
            model.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            phases["forward"] += t1 - t0
            phases["backward"] += t2 - t1
            phases["optimizer"] += t3 - t2
    out = {"phases_ms": {k: round(1e3 * v / steps, 2) for k, v in phases.items()}}
    layers = {k: round(1e3 * v / steps, 2) for k, v in sorted(timer.totals.items(),
                                                               key=lambda kv: -kv[1])}
    fwd = sum(v for k, v in layers.items() if "_forward" in k)
    bwd = sum(v for k, v in layers.items() if "_forward" not in k)
    layers["(forward glue: residual adds, validation, …)"] = round(out["phases_ms"]["forward"] - fwd, 2)
    layers["(backward glue: skips, LoRA, …)"] = round(out["phases_ms"]["backward"] - bwd, 2)
    out["layers_ms"] = layers
    out["matmul_gflops"] = {k: round(timer.flops[k] / timer.totals[k] / 1e9, 1)
                            for k in layers if timer.flops.get(k)}
    out["matmul_ms"] = round(sum(v for k, v in layers.items() if timer.flops.get(k)), 2)
    return out


# ---------------------------------------------------------------------------------- running
def make_batches(config, B, T, n=4, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        seq = rng.integers(0, config.vocab_size, size=(B, T + 1))
        out.append((seq[:, :-1].astype(np.int64), seq[:, 1:].astype(np.int64)))
    return out


def sync(device: str) -> None:
    """Wait for the device's queued work (a GPU runs torch's calls asynchronously); a no-op on the CPU."""
    if device != "cpu":
        import torch

        torch.cuda.synchronize(device)


def pick_torch_attention(tmodel, batches, reps: int, device: str = "cpu") -> tuple[str, dict]:
    """Time forward+backward with SDPA and with manual attention; keep the faster.

    Two interleaved rounds per mode, each with one untimed call first.
    """
    times: dict = {}
    for mode in ("sdpa", "manual", "sdpa", "manual"):
        tmodel.attention = mode
        x, y = batches[0]
        for j in range(reps + 1):
            t0 = time.perf_counter()
            tmodel(x, y).backward()
            sync(device)
            if j:
                times.setdefault(mode, []).append(time.perf_counter() - t0)
        tmodel.zero_grad(set_to_none=True)
    med = {k: round(common.median_ms(v), 2) for k, v in times.items()}
    best = min(med, key=med.get)
    tmodel.attention = best
    return best, med


class _Side(common.SpawnedSide):
    """One side of the comparison in a process of its own (spawned: nothing inherited), driven
    over a pipe (:class:`common.SpawnedSide`). Each side's thread pools then live alone in their process, as in a user's
    training run: numba's OpenMP threads and PyTorch's spin for a while after each parallel
    region, so in one process each side's idle threads would slow the other's steps several-fold
    (measured: 2.3 s against 70 ms per step, back to back)."""

    def __init__(self, side: str, config, B: int, T: int, backend: str, *, reps: int = 2, attention: str = "auto",
                 device: str = "cpu"):
        super().__init__(_serve, side, config, B, T, backend, reps, attention, device)


def force_attention(kind: str) -> None:
    """Make pedestrian's fast path in this process run ``kind`` attention: ``"auto"`` (the
    library's choice, left as it is), ``"full"`` (the full-matrix kernel) or ``"tiled"``."""
    from pedestrian.kernels.attention_tiled import TILED_MIN_T

    if kind != "auto":
        TILED_MIN_T.update({k: (1 << 40 if kind == "full" else 1) for k in TILED_MIN_T})


def _serve(side: str, config, B: int, T: int, backend: str, reps: int, attention: str, device: str, conn) -> None:
    """The side's process (``"pedestrian"`` or ``"torch"``): build its model from pedestrian's
    seed-0 weights, then answer ``("steps", n, lead_in)`` with ``[(seconds, loss), …]`` of the
    ``n`` timed steps, ``("block", n)``, ``("breakdown",)``, ``("profile",)``, ``("exit",)``.
    ``attention``: pedestrian's attention kernel, ``"auto"`` (the library's choice), ``"full"``
    or ``"tiled"`` (``bench_context.py --kernels``). ``device``: ``"cpu"`` or a torch device
    (both sides' arrays there; each step waits for the device before its time is taken)."""
    try:
        from pedestrian.model import GPT

        force_attention(attention)
        batches = make_batches(config, B, T, n=2 if T > 256 else 4)
        on_device = side == "pedestrian" and device != "cpu"
        model = GPT(config, seed=0, backend=backend if side == "pedestrian" else "numpy",
                    device=device if on_device else None)
        info: dict = {}
        if side == "pedestrian":
            opt, info["optimizer"] = make_optimizer(model)
            if backend == "torch":
                import torch

                batches = [(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)) for x, y in batches]

            def step(k: int) -> float:
                loss = float(pedestrian_step(model, opt, *batches[k % len(batches)]))
                sync(device)
                return loss
        else:
            import torch

            torch.manual_seed(0)
            batches = [(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)) for x, y in batches]
            tmodel = build_torch_model(config, "sdpa")
            copy_weights_to_torch(model.params, tmodel, config)
            tmodel.to(device)
            topt, info["optimizer"] = make_torch_optimizer(tmodel)
            info["optimizer"] = f"torch.optim.AdamW({info['optimizer']})"
            info["attention"], info["attention_ms"] = pick_torch_attention(tmodel, batches, reps=reps, device=device)

            def step(k: int) -> float:
                return torch_step(tmodel, topt, *batches[k % len(batches)])
        done = 0
        conn.send(info)
        while True:
            command = conn.recv()
            if command[0] == "exit":
                return
            if command[0] == "steps":
                n, lead_in = command[1], command[2]
                out = []
                for j in range(lead_in + n):
                    t0 = time.perf_counter()
                    loss = step(done)
                    done += 1
                    if j >= lead_in:
                        out.append((time.perf_counter() - t0, loss))
                conn.send(out)
            elif command[0] == "block":                      # n steps in a row, one time for all
                t0 = time.perf_counter()
                losses = [step(done + j) for j in range(command[1])]
                done += command[1]
                conn.send(((time.perf_counter() - t0) / command[1], losses))
            elif command[0] == "breakdown":
                conn.send(layer_breakdown(model, opt, batches))
            elif command[0] == "profile":
                import cProfile
                import io
                import pstats

                pr, text = cProfile.Profile(), io.StringIO()
                pr.enable()
                for i in range(3):
                    step(done + i)
                pr.disable()
                done += 3
                pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(25)
                conn.send(text.getvalue())
    except BaseException as exc:  # reported by the parent
        conn.send(exc)


def run_config(name: str, backend: str, warmup: int, steps: int, memory: bool,
               breakdown: bool, profile: bool, device: str = "cpu") -> dict:
    config, B, T = make_config(name)
    reps = 2 if name != "gpt2-124M" else 1
    sides = tuple(_Side(side, config, B, T, backend, reps=reps, device=device) for side in ("pedestrian", "torch"))
    attention, attention_ms = sides[1].info["attention"], sides[1].info["attention_ms"]
    per_round, lead_in = ROUNDS[name]
    times: tuple[list, list] = ([], [])
    losses: tuple[list, list] = ([], [])
    for side in (0, 1):
        sides[side].ask("steps", warmup, 0)                 # (both sides see the same batches)
    rounds = max(1, -(-steps // per_round))
    for r in range(rounds):
        for side in ((0, 1) if r % 2 == 0 else (1, 0)):      # ABBA: neither side always goes first
            time.sleep(SETTLE_S)                            # the other side's threads go idle
            for seconds, loss in sides[side].ask("steps", per_round, lead_in):
                times[side].append(seconds)
                losses[side].append(loss)
    b2b: tuple[list, list] = ([], [])
    blocks, per_block = BACK_TO_BACK[name]
    for r in range(2 * blocks):
        side = (0, 1, 1, 0)[r % 4]
        b2b[side].append(sides[side].ask("block", per_block)[0])
    ped_t, tor_t = times
    ped_loss, tor_loss = losses
    steps = len(ped_t)
    ped_ms, tor_ms = common.median_ms(ped_t), common.median_ms(tor_t)
    tokens = B * T
    flops = common.training_flops(config, B, T)["step"]
    from pedestrian.model import GPT

    model = GPT(config, seed=0)
    result = {
        "config": name, "backend": backend, "device": device, "kernels": model.kernels_name, "batch_size": B, "seq_len": T,
        "n_params": model.num_params(), "steps_timed": steps, "warmup": warmup,
        "pedestrian_ms": round(ped_ms, 2), "torch_ms": round(tor_ms, 2),
        "pedestrian_ms_iqr": [round(1e3 * q, 2) for q in statistics.quantiles(ped_t, n=4)[::2]],
        "torch_ms_iqr": [round(1e3 * q, 2) for q in statistics.quantiles(tor_t, n=4)[::2]],
        "ratio": round(ped_ms / tor_ms, 3),
        "pedestrian_back_to_back_ms": round(common.median_ms(b2b[0]), 2),
        "torch_back_to_back_ms": round(common.median_ms(b2b[1]), 2),
        "ratio_back_to_back": round(common.median_ms(b2b[0]) / common.median_ms(b2b[1]), 3),
        "pedestrian_tokens_per_s": round(tokens / ped_ms * 1e3, 1),
        "torch_tokens_per_s": round(tokens / tor_ms * 1e3, 1),
        "step_gflop": round(flops / 1e9, 2),
        "pedestrian_gflops": round(flops / ped_ms / 1e6, 1),
        "torch_gflops": round(flops / tor_ms / 1e6, 1),
        "pedestrian_optimizer": sides[0].info["optimizer"],
        "pedestrian_threads": _threads(),
        "torch_optimizer": sides[1].info["optimizer"],
        "torch_attention": attention, "torch_attention_fwd_bwd_ms": attention_ms,
        "max_loss_difference": float(f"{max(abs(a - b) for a, b in zip(ped_loss, tor_loss)):.3g}"),
        "losses_first_last": [round(ped_loss[0], 4), round(ped_loss[-1], 4)],
    }
    if breakdown:
        result["pedestrian_breakdown"] = sides[0].ask("breakdown")
    if profile:
        print(sides[0].ask("profile"), file=sys.stderr)
    for side in sides:
        side.close()
    if memory:
        for side in ("pedestrian", "torch"):
            result[f"{side}_peak_rss_mib"] = common.child_json(
                [__file__, "--child-memory", side, "--config", name, "--backend", backend,
                 "--torch-attention", attention, "--device", device])
    return result


def _threads() -> int:
    from pedestrian.kernels.jit import threads_used

    return threads_used()


def child_memory(side: str, name: str, backend: str, attention: str, device: str = "cpu") -> dict:
    """Peak RSS of 3 training steps of one side alone (this runs in its own process); on a GPU
    also the peak of PyTorch's device allocator (``torch.cuda.max_memory_allocated``), which both
    sides allocate through."""
    base = common.peak_rss_mib()
    config, B, T = make_config(name)
    batches = make_batches(config, B, T, n=3)
    if backend == "torch" or side == "torch":
        import torch

        batches = [(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)) for x, y in batches]
    if side == "pedestrian":
        from pedestrian.model import GPT

        model = GPT(config, seed=0, backend=backend, device=None if device == "cpu" else device)
        opt, _ = make_optimizer(model)
        for x, y in batches:
            pedestrian_step(model, opt, x, y)
    else:
        tmodel = build_torch_model(config, attention).to(device)   # its own init: values do not change memory
        topt, _ = make_torch_optimizer(tmodel)
        for x, y in batches:
            torch_step(tmodel, topt, x, y)
    out = {"peak_rss_mib": round(common.peak_rss_mib(), 1), "rss_before_model_mib": round(base, 1)}
    if device != "cpu":
        out["peak_device_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return out


# ---------------------------------------------------------------------------------- report
def markdown(results: list[dict], info: dict, peaks: dict | None, backend: str, device: str = "cpu") -> str:
    """The results as a section of ``docs/performance.md``; ``peaks`` ``None`` (a GPU run): no MFU."""
    if peaks is None:
        return _markdown_device(results, info, backend, device)
    peak = peaks["numpy" if backend == "numpy" else "torch"]["square"]
    lines = [f"### Training step, `backend=\"{backend}\"`", "", common.machine_line(info), "",
             f"Matmul peak measured in this run (float32, {peaks['numpy']['square_n']}² square, best of the start and the end): "
             f"NumPy {peaks['numpy']['square']} GFLOP/s, PyTorch {peaks['torch']['square']} GFLOP/s; "
             f"batched 48×64×64 (the attention shape): NumPy {peaks['numpy']['batched_48x64']}, "
             f"PyTorch {peaks['torch']['batched_48x64']} GFLOP/s. MFU = achieved matmul GFLOP/s "
             f"÷ the square peak of the side's own library.", "",
             "Paused: each timed step after a pause (the other side's threads idle); back to back: "
             "steps in a row, as the training loop runs them.", "",
             "| config | B×T | pedestrian ms | PyTorch ms | ratio | back to back ms (ped / torch) | ratio b2b "
             "| tokens/s (ped / torch) | GFLOP/s (ped / torch) | MFU (ped / torch) | peak RSS MiB (ped / torch) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        tpeak = peaks["torch"]["square"]
        mem = (f"{r['pedestrian_peak_rss_mib']['peak_rss_mib']:.0f} / "
               f"{r['torch_peak_rss_mib']['peak_rss_mib']:.0f}"
               if "torch_peak_rss_mib" in r else "not measured")
        lines.append(
            f"| {r['config']} | {r['batch_size']}×{r['seq_len']} | {r['pedestrian_ms']:.1f} "
            f"| {r['torch_ms']:.1f} | **{r['ratio']:.2f}** | {r['pedestrian_back_to_back_ms']:.1f} / "
            f"{r['torch_back_to_back_ms']:.1f} | **{r['ratio_back_to_back']:.2f}** | {r['pedestrian_tokens_per_s']:.0f} / "
            f"{r['torch_tokens_per_s']:.0f} | {r['pedestrian_gflops']:.0f} / {r['torch_gflops']:.0f} "
            f"| {100 * r['pedestrian_gflops'] / peak:.0f}% / {100 * r['torch_gflops'] / tpeak:.0f}% "
            f"| {mem} |")
    lines += ["", "PyTorch side: " + ", ".join(
        f"{r['config']}: {r['torch_optimizer']}, attention `{r['torch_attention']}` "
        f"(fwd+bwd ms {r['torch_attention_fwd_bwd_ms']})" for r in results) + ".",
        "pedestrian optimizer: " + results[0]["pedestrian_optimizer"] + f"; threads: "
        f"{results[0].get('pedestrian_threads', 1)} (numba's, every kernel; products in row blocks of "
        "one-thread BLAS calls). Each side runs in a process of its own. Largest |loss difference| "
        "between the two sides over the run: " + ", ".join(
            f"{r['config']} {r['max_loss_difference']:.1e}" for r in results) + "."]
    for r in results:
        bd = r.get("pedestrian_breakdown")
        if not bd:
            continue
        ph = bd["phases_ms"]
        lines += ["", f"Per-layer time of one pedestrian step, {r['config']} (wall-clock ms: forward "
                  f"{ph['forward']:.1f}, backward {ph['backward']:.1f}, optimizer {ph['optimizer']:.1f}).",
                  "", "| layer function | ms/step | GFLOP/s |", "|---|---|---|"]
        lines += [f"| {k} | {v:.2f} | {bd['matmul_gflops'].get(k, '')} |" for k, v in bd["layers_ms"].items()]
        total = ph["forward"] + ph["backward"] + ph["optimizer"]
        lines += ["", f"Matrix products: {bd['matmul_ms']:.1f} ms of {total:.1f} ms "
                  f"({100 * bd['matmul_ms'] / total:.0f}%); the rest is elementwise work, attention's "
                  "small per-head products and softmax, Python overhead and the optimizer."]
    return "\n".join(lines) + "\n"


def _markdown_device(results: list[dict], info: dict, backend: str, device: str) -> str:
    lines = [f"### Training step, `backend=\"{backend}\", device=\"{device}\"`", "",
             common.machine_line(info) + f" GPU: {info.get('gpu', '?')}.", "",
             "Both sides' arrays on the GPU; each timed step ends with `torch.cuda.synchronize()`. Paused: each "
             "timed step after a pause; back to back: steps in a row. Peak memory: PyTorch's device allocator "
             "(`torch.cuda.max_memory_allocated`, 3 steps of each side alone in a fresh process).", "",
             "| config | B×T | pedestrian ms | PyTorch ms | ratio | back to back ms (ped / torch) | ratio b2b "
             "| tokens/s (ped / torch) | peak GPU MiB (ped / torch) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        mem = (f"{r['pedestrian_peak_rss_mib']['peak_device_mib']:.0f} / {r['torch_peak_rss_mib']['peak_device_mib']:.0f}"
               if "torch_peak_rss_mib" in r else "not measured")
        lines.append(
            f"| {r['config']} | {r['batch_size']}×{r['seq_len']} | {r['pedestrian_ms']:.1f} | {r['torch_ms']:.1f} "
            f"| **{r['ratio']:.2f}** | {r['pedestrian_back_to_back_ms']:.1f} / {r['torch_back_to_back_ms']:.1f} "
            f"| **{r['ratio_back_to_back']:.2f}** | {r['pedestrian_tokens_per_s']:.0f} / {r['torch_tokens_per_s']:.0f} | {mem} |")
    lines += ["", "PyTorch side: " + ", ".join(f"{r['config']}: {r['torch_optimizer']}, attention `{r['torch_attention']}`"
                                              for r in results) + ". Largest |loss difference| between the sides: "
              + ", ".join(f"{r['config']} {r['max_loss_difference']:.1e}" for r in results) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", nargs="+", default=["all"], choices=["all", *CONFIGS],
                    help="one or more configs, or all (default)")
    ap.add_argument("--backend", default="numpy", choices=["numpy", "torch"])
    ap.add_argument("--device", default="cpu", help="cpu (default) or a torch device such as cuda (needs --backend "
                    "torch): both sides' arrays there")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per side (default per config)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile 3 pedestrian steps to stderr")
    ap.add_argument("--no-save", action="store_true", help="print only; write no result files")
    ap.add_argument("--threads", type=int, default=None,
                    help="run both sides with this many threads (re-executes with OPENBLAS_NUM_THREADS, "
                         "OMP_NUM_THREADS and PEDESTRIAN_NUM_THREADS set; default: as the machine has it)")
    ap.add_argument("--kernels", default="fast", choices=["fast", "reference"],
                    help="pedestrian's layer functions: the fast kernels (default) or the reference layers")
    ap.add_argument("--child-memory", choices=["pedestrian", "torch"], help=argparse.SUPPRESS)
    ap.add_argument("--torch-attention", default="sdpa", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ["PEDESTRIAN_KERNELS"] = args.kernels       # GPT(kernels=None) reads it; children too
    if args.threads is not None and not args.child_memory:   # (children inherit the variables;
        common.reexec_with_threads(args.threads)             # re-executing would import torch there)

    if args.child_memory:
        config_name = args.config[0]
        print(json.dumps(child_memory(args.child_memory, config_name, args.backend, args.torch_attention,
                                      args.device)))
        return 0
    if args.device != "cpu" and args.backend != "torch":
        ap.error(f"--device {args.device} needs --backend torch (NumPy arrays live on the CPU)")

    info = common.machine_info()
    if args.device == "cpu":
        peaks = {"numpy": common.matmul_peak_gflops("numpy"), "torch": common.matmul_peak_gflops("torch")}
    else:                                     # the CPU's matmul peak says nothing of a GPU's step
        import torch

        peaks, info["gpu"] = None, torch.cuda.get_device_name(args.device)
    print(json.dumps({"machine": info, "matmul_peak": peaks}), file=sys.stderr)
    every = "all" in args.config
    names = list(CONFIGS) if every else list(dict.fromkeys(args.config))
    results = []
    for name in names:
        w, s = DEFAULT_STEPS[name]
        r = run_config(name, args.backend, args.warmup if args.warmup is not None else w,
                       args.steps or s, not args.no_memory,
                       not args.no_breakdown and args.device == "cpu",   # (a GPU's calls return before they end)
                       args.profile, args.device)
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "pedestrian_breakdown"}), file=sys.stderr)
    # the peak again at the end: the larger of the two is the less disturbed measurement
    for lib in peaks or ():
        again = common.matmul_peak_gflops(lib)
        for k in ("square", "batched_48x64"):
            peaks[lib][k] = max(peaks[lib][k], again[k])
    if peaks is not None:
        backend_peak = peaks["numpy" if args.backend == "numpy" else "torch"]["square"]
        for r in results:
            r["pedestrian_mfu"] = round(r["pedestrian_gflops"] / backend_peak, 3)
            r["torch_mfu"] = round(r["torch_gflops"] / peaks["torch"]["square"], 3)
    text = markdown(results, info, peaks, args.backend, args.device)
    print(text)
    if not args.no_save:
        tag = f"train_{args.backend}" + ("" if args.device == "cpu" else "_" + args.device.split(":")[0]) \
            + ("" if every else "_" + "_".join(names)) + ("" if args.threads is None else f"_{args.threads}thread")
        common.write_json(tag, {"machine": info, "matmul_peak": peaks, "hparams": HPARAMS,
                                "results": results})
        common.write_markdown(tag, text)
        if every and args.threads is None and args.device == "cpu":
            common.update_doc_section(tag, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
