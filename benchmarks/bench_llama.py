"""Llama family at SmolLM2-135M's shape: pedestrian against transformers (+ PEFT) in one run.

The model: preset ``smollm2-135m`` at context 512 (30 blocks, d_model 576, 9 query / 3 key-value
heads of width 64, SwiGLU width 1536, vocabulary 49,152, tied embeddings; 134,515,008
parameters), float32, random weights. The peer: ``transformers.LlamaForCausalLM`` built from a
``LlamaConfig`` of the same shape (its own random init, its default attention implementation),
``torch.optim.AdamW(fused=True)`` for the full step, PEFT LoRA for the adapter step. The
transformers side writes its weights with ``save_pretrained`` and pedestrian loads that folder
(``load_hf_model``), so both sides start from the same numbers and their losses and greedy tokens
are compared.

Measured, each side in a process of its own (spawned, as in bench_train.py: one library's idle
threads never slow the other), both on the same number of threads
(``torch.set_num_threads`` = numba's threads):

- **generation**: greedy decoding with the KV cache (``pedestrian.generation.generate`` /
  ``generate(do_sample=False, use_cache=True)``), batch 1, an 8-token prompt; decode tokens/s
  from a time stamp per token (``on_token`` / a transformers streamer), so the prompt's prefill is
  left out; beside the memory-bandwidth limit ``bandwidth / weight bytes`` (every float32 weight
  read once per token; the read bandwidth measured in this run, see :func:`read_bandwidth_gbs`;
  and round by round, beside the read bandwidth measured just before each round's runs),
  and beside the weights' share alone (one NumPy ``x @ W`` per weight matrix); the KV cache's
  bytes with 3 key/value heads and with 9 (multi-head);
- **a full training step** (forward, backward, AdamW on every weight), the same step
  **recomputing each block in the backward** (pedestrian ``model.recompute``; transformers
  ``gradient_checkpointing_enable()``), that step with AdamW inside the backward on both sides, the
  **memory-budget step** (pedestrian ``--update-in-backward --recompute-blocks`` :data:`BUDGET_BLOCKS`
  against the peer's plain step: what each side's user runs to fit), and **a LoRA step**
  (r 8 on q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, PEFT ``lora_alpha`` 16 =
  pedestrian's α 2, no dropout, base frozen; AdamW on the adapters), batch 1 × 512 tokens:
  the sides take turns (ABBA), each turn a few steps back to back; every step is timed by the
  wall clock (``time.perf_counter``) and by the side's CPU time (``time.process_time``, all its
  threads). The time ratio is the median over rounds of (pedestrian's turn ÷ the neighbouring
  transformers turn), wall clock: what a user waits for; on a shared machine neighbouring turns
  see about the same load. The CPU-time ratio is reported beside it (it does not count time the
  process waits for a core, but does count threads spinning at a barrier);
- **peak memory** of each step kind, each side alone in a fresh subprocess (``VmHWM`` after two
  steps, as bench_train.py's ``--child-memory``).

Run (9.8 minutes measured on this 2-core machine, two threads each, idle otherwise; the
memory children take about 2 of them; ``--quick`` times fewer steps)::

    python3 benchmarks/bench_llama.py                 # everything, writes results + docs table
    python3 benchmarks/bench_llama.py --threads 1     # one thread each (robust on a busy machine)
    python3 benchmarks/bench_llama.py --profile       # + cProfile of one pedestrian step of each kind

Writes ``benchmarks/results/llama_smollm2_135m[_<n>thread].json`` and ``.md``; the default
run (no ``--threads``) also refreshes the table in ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HPARAMS = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
LORA_RANK, LORA_ALPHA = 8, 16.0            # PEFT's lora_alpha; pedestrian's α = lora_alpha / r
PROMPT_LEN = 8
KINDS = ["generate", "full", "recompute", "lean", "budget", "lora"]   # what is measured, in this order
#: pause before each generation turn: a side's idle threads spin for a while after its turn (the
#: second round's first run, right after the other side's, measured 70-76 % of the limit where the
#: rounds after a bandwidth reading measured 84-94 %, four runs of 2026-12-04; with the pause, three
#: runs: 79-90 %, the second round 79, 85 and 90 %)
SETTLE_S = 0.5
#: "budget": pedestrian --update-in-backward --recompute-blocks BUDGET_BLOCKS against transformers' plain
#: full step (what its users run by default): few recomputed blocks that keep pedestrian's peak memory
#: under 0.7 of the peer's with some 70 MiB to spare (about 15.5 MiB per block at this shape,
#: docs/performance.md)
BUDGET_BLOCKS = 12


def make_config(T: int, n_blocks: int = 30):
    from pedestrian.config import preset

    return preset("smollm2-135m", context_length=T, n_blocks=n_blocks)


def hf_llama_config(config):
    """The ``transformers.LlamaConfig`` of the same shape, written out field by field."""
    import transformers

    c = config
    return transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.d_mlp,
        num_hidden_layers=c.n_blocks, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
        head_dim=c.d_head, max_position_embeddings=c.context_length, rms_norm_eps=c.ln_eps,
        rope_theta=c.rope_base, tie_word_embeddings=c.tie_weights, attention_bias=False, mlp_bias=False,
        hidden_act="silu", bos_token_id=0, eos_token_id=0, pad_token_id=0)


def make_batches(config, B: int, T: int, n: int = 2, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, config.vocab_size, size=(B, T + 1)) for _ in range(n)]
    return [(s[:, :-1].astype(np.int64), s[:, 1:].astype(np.int64)) for s in seqs]


# ---------------------------------------------------------------------------------- the two sides
class PedestrianSide:
    """pedestrian as ``pedestrian finetune`` / ``train`` run it: the model's own loss, backward
    and :class:`~pedestrian.training.optim.AdamW`, the fast kernels on numba's threads."""

    def __init__(self, config, hf_dir: str | None):
        from pedestrian.model import GPT

        if hf_dir is None:                                  # (memory children: values do not matter)
            self.model = GPT(config, seed=0)
        else:
            from pedestrian.interop.hf import load_hf_model

            self.model = load_hf_model(hf_dir)
        self.opt = None

    def setup(self, mode: str) -> None:
        from pedestrian.training.optim import AdamW

        self.opt = None
        self.model.recompute = {"recompute": True, "lean": True, "budget": BUDGET_BLOCKS}.get(mode, False)
        self.lean = mode in ("lean", "budget")
        if mode == "lora":
            self.model.add_lora(SEVEN, rank=LORA_RANK, alpha=LORA_ALPHA / LORA_RANK, freeze_base=True)
        self.opt = AdamW(self.model, **HPARAMS)

    def step(self, x, y) -> float:
        if self.lean:                                # AdamW inside the backward (--update-in-backward)
            from pedestrian.training.blockwise import blockwise_step

            return float(blockwise_step(self.model, self.opt, [(x, y)], HPARAMS["lr"])[0])
        loss = self.model.loss(x, y)
        self.model.backward()
        self.opt.step()
        return float(loss)

    def generate(self, prompt: np.ndarray, n_new: int) -> tuple[list, np.ndarray]:
        from pedestrian.generation.generate import Sampling, generate

        stamps: list[tuple[float, float]] = []
        out = generate(self.model, prompt[None, :], n_new, Sampling(temperature=0.0), on_token=lambda ids: stamps.append((time.perf_counter(), time.process_time())))
        return stamps, np.asarray(out)[0, len(prompt):]

    def kv_cache_bytes(self) -> dict:
        """``KVCache.nbytes`` (its whole capacity, ``context_length`` positions) for this config's
        3 key/value heads and for 9 (every query head its own: multi-head)."""
        import dataclasses
        from types import SimpleNamespace

        from pedestrian.model.kv_cache import KVCache

        m = self.model
        out = {}
        for n_kv in (m.config.n_kv_heads, m.config.n_heads):
            stub = SimpleNamespace(config=dataclasses.replace(m.config, n_kv_heads=n_kv), xp=m.xp,
                                   dtype=m.dtype, device=m.device)
            out[str(n_kv)] = KVCache(stub).nbytes
        return out

    def gemv_pass(self, repeats: int = 3) -> dict:
        """The weights' share of a decoding step alone: one 1-row NumPy product ``x @ W`` with
        every weight matrix the decoding step multiplies by (a block's q, k, v one region, its
        gate and up one: the parameter buffer's regions; the tied table once, as the logits'
        ``Wᵀ``), best of ``repeats`` by the wall clock and by CPU time -- what a decoder built on
        these BLAS calls costs without anything else (norms, RoPE, attention, SwiGLU, skips, Python).
        ``by_kind``: the best pass's milliseconds and GB/s for each kind of matrix (its name
        without the block number: the 30 blocks' o_proj together, ...)."""
        R = self.model.parameters.base.regions
        named = [(k, R[k]) for k in R if R[k].ndim == 2 and k != "tok_emb.weight"]
        named.append(("logits (tok_emb.weight ᵀ)", R["tok_emb.weight"].T))
        kinds = [(re.sub(r"^blocks\.\d+\.", "", k), w) for k, w in named]
        xs = {n: np.ones((1, n), dtype=named[0][1].dtype) for n in {w.shape[0] for _, w in named}}
        best_w = best_c = float("inf")
        for _ in range(repeats + 1):
            spent: dict[str, float] = dict.fromkeys((k for k, _ in kinds), 0.0)
            w0, c0 = time.perf_counter(), time.process_time()
            for kind, w in kinds:
                t = time.perf_counter()
                xs[w.shape[0]] @ w
                spent[kind] += time.perf_counter() - t
            wall = time.perf_counter() - w0
            if wall < best_w:
                best_w, best_spent = wall, spent
            best_c = min(best_c, time.process_time() - c0)
        nbytes = sum(int(w.nbytes) for _, w in kinds)
        by_kind = {}
        for kind in best_spent:
            ws = [w for k, w in kinds if k == kind]
            kb = sum(int(w.nbytes) for w in ws)
            by_kind[kind] = {"shape": list(ws[0].shape), "count": len(ws), "ms": round(1e3 * best_spent[kind], 3),
                             "gbs": round(kb / best_spent[kind] / 1e9, 2)}
        return {"bytes": nbytes, "matrices": len(kinds), "wall_ms": round(1e3 * best_w, 2),
                "cpu_ms": round(1e3 * best_c / self.threads(), 2), "by_kind": by_kind}

    def threads(self) -> int:
        from pedestrian.kernels.jit import threads_used

        return threads_used()


class TransformersSide:
    """``LlamaForCausalLM`` (float32, transformers' default attention), AdamW(fused) for the full
    step; PEFT's ``get_peft_model`` for LoRA. ``use_cache=False`` in training (nothing to cache)."""

    def __init__(self, config, hf_dir: str | None, threads: int):
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        self.model = transformers.LlamaForCausalLM(hf_llama_config(config))
        if hf_dir is not None:
            self.model.save_pretrained(hf_dir)
        self.opt = None
        self.attention = self.model.config._attn_implementation

    def setup(self, mode: str) -> None:
        import torch

        self.opt = None
        for handle in getattr(self, "hooks", []):
            handle.remove()
        self.model.zero_grad(set_to_none=True)
        self.model.train()
        m, new = self.model, hasattr(self.model, "activation_checkpointing_enable")   # (its name from v5)
        if mode in ("recompute", "lean"):          # transformers' own recompute, like for like
            (m.activation_checkpointing_enable if new else m.gradient_checkpointing_enable)()
        elif hasattr(m, "gradient_checkpointing_disable"):
            (m.activation_checkpointing_disable if new else m.gradient_checkpointing_disable)()
        if mode == "lora":
            import peft

            self.model = peft.get_peft_model(self.model, peft.LoraConfig(
                r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=SEVEN, bias="none"))
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": HPARAMS["weight_decay"]},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=HPARAMS["lr"],
                                     betas=HPARAMS["betas"], eps=HPARAMS["eps"], fused=True)
        if mode == "lean":   # PyTorch's recipe: one AdamW per tensor, stepped as its gradient is ready
            each = {p: torch.optim.AdamW([p], lr=HPARAMS["lr"], betas=HPARAMS["betas"], eps=HPARAMS["eps"],
                                         weight_decay=HPARAMS["weight_decay"] if p.dim() >= 2 else 0.0, fused=True)
                    for p in params}

            def hook(p):
                each[p].step()
                each[p].zero_grad(set_to_none=True)

            self.opt, self.hooks = None, [p.register_post_accumulate_grad_hook(hook) for p in params]

    def step(self, x, y) -> float:
        import torch
        import torch.nn.functional as F

        if self.opt is not None:
            self.opt.zero_grad(set_to_none=True)
        logits = self.model(input_ids=torch.from_numpy(x), use_cache=False).logits
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), torch.from_numpy(y).view(-1))
        loss.backward()
        if self.opt is not None:
            self.opt.step()
        return float(loss.detach())

    def generate(self, prompt: np.ndarray, n_new: int) -> tuple[list, np.ndarray]:
        import torch
        from transformers.generation.streamers import BaseStreamer

        class Stamps(BaseStreamer):
            def __init__(self):
                self.t: list[tuple[float, float]] = []

            def put(self, value):
                self.t.append((time.perf_counter(), time.process_time()))

            def end(self):
                pass

        stamps = Stamps()
        ids = torch.as_tensor(prompt[None, :], dtype=torch.long)
        self.model.eval()
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                      min_new_tokens=n_new, do_sample=False, use_cache=True,
                                      pad_token_id=0, eos_token_id=None, streamer=stamps)
        self.model.train()
        return stamps.t[1:], out[0, len(prompt):].numpy()        # (the first put is the prompt)

    def threads(self) -> int:
        import torch

        return torch.get_num_threads()


def _serve(side: str, B: int, T: int, n_blocks: int, threads: int, hf_dir: str, conn) -> None:
    """The side's process: answers ``("generate", prompt, n)``, ``("setup", mode)``,
    ``("steps", n)`` -> ``[(wall s, cpu s, loss), …]``, ``("profile", n)``, ``("breakdown",)``,
    ``("exit",)``."""
    try:
        config = make_config(T, n_blocks)
        batches = make_batches(config, B, T)
        s = PedestrianSide(config, hf_dir) if side == "pedestrian" else TransformersSide(config, hf_dir, threads)
        info = {"attention": getattr(s, "attention", None)}
        if side == "pedestrian":
            info["kv_cache_bytes"] = s.kv_cache_bytes()
        conn.send(info)
        done = 0
        while True:
            command = conn.recv()
            if command[0] == "exit":
                return
            if command[0] == "generate":
                t0 = time.perf_counter()
                stamps, tokens = s.generate(command[1], command[2])
                conn.send({"total_s": time.perf_counter() - t0, "stamps": stamps, "tokens": tokens.tolist(),
                           "threads": s.threads()})
            elif command[0] == "gemv":
                conn.send(s.gemv_pass())
            elif command[0] == "setup":
                s.setup(command[1])
                conn.send(None)
            elif command[0] == "steps":
                out = []
                for _ in range(command[1]):
                    x, y = batches[done % len(batches)]
                    done += 1
                    w, c = time.perf_counter(), time.process_time()
                    loss = s.step(x, y)
                    out.append((time.perf_counter() - w, time.process_time() - c, loss))
                conn.send(out)
            elif command[0] == "profile":
                import cProfile
                import io
                import pstats

                pr, text = cProfile.Profile(), io.StringIO()
                pr.enable()
                for _ in range(command[1]):
                    s.step(*batches[done % len(batches)])
                    done += 1
                pr.disable()
                pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(30)
                conn.send(text.getvalue())
            elif command[0] == "breakdown":
                import bench_train

                conn.send(bench_train.layer_breakdown(s.model, s.opt, batches, steps=1))
    except BaseException as exc:  # reported by the parent
        import traceback

        conn.send(RuntimeError(f"{exc!r}\n{traceback.format_exc()}"))


class _Side(common.SpawnedSide):
    """One side in a process of its own (spawned), driven over a pipe (:class:`common.SpawnedSide`,
    as in bench_train.py)."""

    show = staticmethod(str)              # _serve's error already holds the repr and the traceback

    def __init__(self, side: str, B: int, T: int, n_blocks: int, threads: int, hf_dir: str):
        super().__init__(_serve, side, B, T, n_blocks, threads, hf_dir)


# ---------------------------------------------------------------------------------- measuring
def read_bandwidth_gbs(threads: int, n_bytes: int = 1 << 29, repeats: int = 5) -> dict:
    """Memory bandwidth in GB/s, measured here, two ways (best of ``repeats`` each):

    - ``read``: ``threads`` Python threads each summing its share of a 512 MiB float32 array
      (``np.add.reduce`` releases the GIL), bytes read ÷ time -- the access pattern of decoding,
      which reads every weight once per token;
    - ``copy``: one ``np.copyto`` of 256 MiB, bytes read plus written ÷ time (bench_generate_hf.py).

    Each by the wall clock and by CPU time (``read_cpu``, ``copy_cpu``: bytes ÷ the process's
    CPU seconds per thread; on a busy machine the wall clock also counts waits for a core). The
    limit uses ``read`` or the GEMV pass's rate (:meth:`PedestrianSide.gemv_pass`), the larger:
    both only read, as decoding does; ``copy`` (which also writes) is reported for reference.
    """
    a = np.ones(n_bytes // 4, dtype=np.float32)
    parts = np.array_split(a, threads)

    def read_once() -> tuple[float, float]:
        workers = [threading.Thread(target=np.add.reduce, args=(p,)) for p in parts]
        t0, c0 = time.perf_counter(), time.process_time()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - t0, (time.process_time() - c0) / threads

    half = a[: a.size // 2]
    b = np.empty_like(half)

    def copy_once() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        np.copyto(b, half)
        return time.perf_counter() - t0, time.process_time() - c0

    reads = [read_once() for _ in range(repeats)]
    copies = [copy_once() for _ in range(repeats)]
    out = {"threads": threads, "read_bytes": n_bytes}
    for name, runs, nbytes in (("read", reads, n_bytes), ("copy", copies, 2 * half.nbytes)):
        out[name] = round(nbytes / min(w for w, _ in runs) / 1e9, 2)
        out[f"{name}_cpu"] = round(nbytes / min(c for _, c in runs) / 1e9, 2)
    return out


def cpu_seconds() -> tuple[float, float] | None:
    """``(busy, own)``: the CPU seconds every core has been busy since boot (``/proc/stat``: all
    but idle and iowait, the hypervisor's steal included), and this process's with its waited-for
    children (``os.times``). The difference between two readings, over the wall clock and the
    cores, is the share of the machine other processes took meanwhile -- unlike the load average,
    which also counts the benchmark's own threads. ``None`` where ``/proc/stat`` is missing."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    return busy, sum(os.times()[:4])


def run_generation(sides: dict, n_new: int, repeats: int, vocab: int, threads: int) -> dict:
    prompt = np.random.default_rng(1).integers(0, vocab, PROMPT_LEN).astype(np.int64)
    for name in sides:                                          # warm-up: imports, first calls
        sides[name].ask("generate", prompt, 4)
    runs: dict[str, list] = {k: [] for k in sides}
    reads = []                                                  # the read bandwidth beside each round
    for r in range(repeats):
        reads.append(read_bandwidth_gbs(threads, repeats=3)["read"])
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            time.sleep(SETTLE_S)                                # the other side's threads go idle
            runs[name].append(sides[name].ask("generate", prompt, n_new))
    out: dict = {"new_tokens": n_new, "prompt_len": PROMPT_LEN, "repeats": repeats, "read_gbs_per_round": reads}
    for name, rs in runs.items():
        decode = [(len(x["stamps"]) - 1) / (x["stamps"][-1][0] - x["stamps"][0][0]) for x in rs]
        decode_cpu = [(len(x["stamps"]) - 1) / ((x["stamps"][-1][1] - x["stamps"][0][1]) / x["threads"]) for x in rs]
        out[name] = {"decode_tokens_per_s": round(statistics.median(decode), 2),
                     "decode_tokens_per_s_all": [round(d, 2) for d in decode],
                     "decode_tokens_per_cpu_s": round(statistics.median(decode_cpu), 2),
                     "total_tokens_per_s": round(statistics.median(n_new / x["total_s"] for x in rs), 2),
                     "threads": rs[0]["threads"]}
    out["gemv_pass"] = sides["pedestrian"].ask("gemv")
    ped, ref = np.array(runs["pedestrian"][-1]["tokens"]), np.array(runs["transformers"][-1]["tokens"])
    out["same_leading_tokens"] = int(np.argmax(ped != ref)) if np.any(ped != ref) else len(ref)
    return out


def run_steps(sides: dict, mode: str, rounds: int, per_turn: int, warmup: int) -> dict:
    for name in sides:
        sides[name].ask("setup", mode)
    first = {name: sides[name].ask("steps", warmup) for name in sides}
    steps: dict[str, list] = {k: [] for k in sides}
    turns: dict[str, list] = {k: [] for k in sides}
    order = ("pedestrian", "transformers")
    for r in range(rounds):
        for name in (order if r % 2 == 0 else order[::-1]):    # ABBA
            got = sides[name].ask("steps", per_turn)
            steps[name] += got
            turns[name].append(got)

    def turn_median(turn, k):
        return statistics.median(s[k] for s in turn)

    out: dict = {"mode": mode, "rounds": rounds, "steps_per_turn": per_turn, "warmup": warmup}
    for k, label in ((0, "wall"), (1, "cpu")):
        ratios = [turn_median(p, k) / turn_median(t, k) for p, t in zip(turns["pedestrian"], turns["transformers"])]
        out[f"ratio_{label}"] = round(statistics.median(ratios), 3)
        out[f"ratio_{label}_per_round"] = [round(x, 3) for x in ratios]
        for name in sides:
            out[f"{name}_{label}_s"] = round(statistics.median(s[k] for s in steps[name]), 3)
            out[f"{name}_{label}_s_min"] = round(min(s[k] for s in steps[name]), 3)
    losses = {name: [l for *_, l in first[name] + steps[name]] for name in sides}
    out["first_loss"] = {name: round(v[0], 5) for name, v in losses.items()}
    out["first_loss_difference"] = float(f"{abs(losses['pedestrian'][0] - losses['transformers'][0]):.3g}")
    if mode in ("full", "recompute", "lean"):        # the same weights, batches and AdamW: the losses follow each other
        out["max_loss_difference"] = float(f"{max(abs(a - b) for a, b in zip(*losses.values())):.3g}")
    return out


def child_memory(side: str, mode: str, B: int, T: int, n_blocks: int, threads: int) -> dict:
    """Peak RSS of two steps of one side alone (this runs in its own process)."""
    base = common.peak_rss_mib()
    config = make_config(T, n_blocks)
    s = PedestrianSide(config, None) if side == "pedestrian" else TransformersSide(config, None, threads)
    s.setup(mode)
    after_model = _rss_mib()
    for x, y in make_batches(config, B, T):
        s.step(x, y)
    return {"peak_rss_mib": round(common.peak_rss_mib(), 1), "rss_after_imports_mib": round(base, 1),
            "rss_after_model_mib": round(after_model, 1)}


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


# ---------------------------------------------------------------------------------- report
def markdown(res: dict, info: dict) -> str:
    g, bw, c = res["generation"], res["bandwidth_gbs"], res["model"]
    limit = res["bandwidth_limit_tokens_per_s"]
    load, others = info["load_average_1m"], res.get("others_cpu_share")
    # the end's load average counts the benchmark's own threads: other processes' CPU time where known
    loaded = others > 0.2 if others is not None else max(load, res["load_average_end"]) > 0.7 * info["logical_cores"]
    seen = (f"other processes took {100 * others:.0f} % of the cores' time over the run" if others is not None
            else f"1-minute load average {load} at the start, {res['load_average_end']} at the end")
    under_load = (f" **Measured under load** ({seen}, on {info['logical_cores']} cores): other processes shared "
                  f"the cores, so absolute times are inflated and noisy; the ratios compare neighbouring turns, "
                  f"and the CPU-time ratio (in bold) is the one to read: the wall clock also counts the "
                  f"seconds a side waited for a core." if loaded else
                  f" Other processes took {100 * others:.0f} % of the cores' time over the run." if others is not None
                  else "")
    lines = [f"### Llama family at SmolLM2-135M's shape, `backend=\"numpy\"`", "",
             common.machine_line(info) + under_load, "",
             f"Model: preset `smollm2-135m` at context {c['context_length']} ({c['n_params']:,} parameters, "
             f"{c['n_blocks']} blocks, d_model {c['d_model']}, {c['n_heads']} query / {c['n_kv_heads']} key-value "
             f"heads of width {c['d_head']}, SwiGLU {c['d_mlp']}, vocabulary {c['vocab_size']:,}, tied), float32, "
             f"random weights written by `LlamaForCausalLM.save_pretrained` and loaded by pedestrian. Peer: "
             f"transformers `LlamaForCausalLM` (attention `{res['transformers_attention']}`, transformers' "
             f"default), `torch.optim.AdamW(fused=True)`, PEFT LoRA. Both sides on {res['threads']} thread(s), "
             f"each in a process of its own. Batch {res['batch_size']} × {res['seq_len']} tokens.", "",
             "| step | pedestrian s (wall / CPU) | transformers s (wall / CPU) | time ratio wall / CPU "
             "| peak RSS MiB (ped / transformers) | memory ratio |", "|---|---|---|---|---|---|"]
    for mode, label in (("full", "full training step (AdamW on all weights)"),
                        ("recompute", "full step, recomputing each block in the backward (pedestrian "
                                      "`--recompute`; transformers `activation_checkpointing_enable()`)"),
                        ("lean", "full step, recomputing and with AdamW inside the backward (pedestrian "
                                 "`--recompute --update-in-backward`; transformers: the same recompute, one "
                                 "fused AdamW per tensor in `register_post_accumulate_grad_hook`)"),
                        ("budget", f"full step, pedestrian `--update-in-backward --recompute-blocks {BUDGET_BLOCKS}` "
                                   f"(the first {BUDGET_BLOCKS} of {c['n_blocks']} blocks recomputed) against transformers' plain step"),
                        ("lora", f"LoRA step (r {LORA_RANK}, all seven projections)")):
        r = res["steps"].get(mode)
        if r is None:
            continue
        mem = res.get("memory", {}).get(mode)
        mem_cols = ("not measured | –" if mem is None else
                    f"{mem['pedestrian']['peak_rss_mib']:.0f} / {mem['transformers']['peak_rss_mib']:.0f} "
                    f"| **{mem['ratio']:.2f}**")
        lines.append(f"| {label} | {r['pedestrian_wall_s']:.2f} / {r['pedestrian_cpu_s']:.2f} "
                     f"| {r['transformers_wall_s']:.2f} / {r['transformers_cpu_s']:.2f} "
                     + (f"| {r['ratio_wall']:.2f} / **{r['ratio_cpu']:.2f}** " if loaded else
                        f"| **{r['ratio_wall']:.2f}** / {r['ratio_cpu']:.2f} ") + f"| {mem_cols} |")
    steps, memory = res["steps"], res.get("memory", {})
    for mode, flags in (("recompute", "`--recompute`"), ("lean", "`--recompute --update-in-backward`")):
        if mode not in steps or "full" not in steps:   # against what a transformers user runs by default
            continue
        r, f = steps[mode], steps["full"]
        mem = (f", peak memory **{memory[mode]['pedestrian']['peak_rss_mib'] / memory['full']['transformers']['peak_rss_mib']:.2f}**"
               if mode in memory and "full" in memory else "")
        lines += ["", f"pedestrian {flags} against transformers' plain full step (the first row): time "
                  f"**{r['pedestrian_wall_s'] / f['transformers_wall_s']:.2f}** by the wall clock "
                  f"({r['pedestrian_cpu_s'] / f['transformers_cpu_s']:.2f} by CPU time; medians of different "
                  f"turns){mem}."]
    if steps:
        any_r = next(iter(steps.values()))
        lines += ["", f"Times: medians over {any_r['rounds']} rounds (ABBA) of {any_r['steps_per_turn']} steps "
                  f"back to back per side and turn, after {any_r['warmup']} untimed; the ratio is the median over "
                  "rounds of pedestrian's turn ÷ the neighbouring transformers turn (per-round ratios in the "
                  "JSON). Peak RSS: each side alone in a fresh process, two steps (`VmHWM`). Loss check: "
                  + "; ".join(f"{m} first-step |Δloss| {r['first_loss_difference']:.1e}"
                              + (f", max over the run {r['max_loss_difference']:.1e}" if "max_loss_difference" in r else "")
                              for m, r in steps.items()) + "."]
    if g:
        p, t, gp = g["pedestrian"], g["transformers"], g["gemv_pass"]
        kv = res["kv_cache_bytes"]
        climit = res["bandwidth_limit_tokens_per_cpu_s"]

        def bold(yes: bool, share: float) -> str:
            return f"**{100 * share:.0f} %**" if yes else f"{100 * share:.0f} %"

        lines += ["", "| generation (greedy, batch 1, KV cache) | decode tokens/s | share of the bandwidth limit "
                  "| tokens per CPU-second (per thread) | share (CPU time) |", "|---|---|---|---|---|",
                  f"| pedestrian `generate` | {p['decode_tokens_per_s']:.1f} | {bold(not loaded, p['share_of_limit'])} "
                  f"| {p['decode_tokens_per_cpu_s']:.1f} | {bold(loaded, p['share_of_limit_cpu'])} |",
                  f"| transformers `generate` | {t['decode_tokens_per_s']:.1f} | {100 * t['share_of_limit']:.0f} % "
                  f"| {t['decode_tokens_per_cpu_s']:.1f} | {100 * t['share_of_limit_cpu']:.0f} % |",
                  f"| bandwidth limit | {limit:.1f} | 100 % | {climit:.1f} | 100 % |", "",
                  f"Decode tokens/s: {g['new_tokens']} new tokens after an {g['prompt_len']}-token prompt, time stamps "
                  f"per token (prefill left out), median of {g['repeats']} alternating runs (tokens/s including "
                  f"the prefill: pedestrian {p['total_tokens_per_s']:.1f}, transformers {t['total_tokens_per_s']:.1f}). "
                  f"Identical leading greedy tokens: {g['same_leading_tokens']} / {g['new_tokens']}. "
                  f"Bandwidth limit = {res['bandwidth_used_gbs']:.1f} GB/s ÷ {res['weight_bytes'] / 1e6:.0f} MB "
                  f"(every float32 weight read once per token, the tied table once as the logits matrix). The "
                  f"bandwidth is a read bandwidth measured in this run, the larger of two readers: a 512 MiB "
                  f"float32 array summed by {bw['threads']} thread(s) ({bw['read']:.1f} GB/s, best of the start "
                  f"and the end) and the GEMV pass below ({bw.get('gemv', float('nan')):.1f} GB/s). For reference "
                  f"`np.copyto` moves {bw['copy']:.1f} GB/s (read + write, one thread; decoding writes nothing "
                  f"large, so the copy rate is not its limit). By CPU time (a thread's busy seconds, which leave "
                  f"out waits for a core on a busy machine): {bw['read_cpu']:.1f} and "
                  f"{bw.get('gemv_cpu', float('nan')):.1f} GB/s, and the decode rates per CPU-second of a thread. "
                  f"Paired round by round instead (the summing reader, best of 3, just before each round's two "
                  f"runs, or the GEMV pass where faster; {', '.join(f'{x:.1f}' for x in g['read_gbs_per_round'])} "
                  f"GB/s): pedestrian's runs reach "
                  f"{', '.join(f'{100 * x:.0f} %' for x in p['share_of_round_limit'])} of their round's limit "
                  f"(median {100 * statistics.median(p['share_of_round_limit']):.0f} %; the table's share, against "
                  f"the best reading of the whole run, is the lower bound).",
                  "",
                  f"GEMV pass: one 1-row NumPy product `x @ W` with each of the {gp['matrices']} weight matrices a "
                  f"decoding step multiplies by (a block's q, k, v one, its gate and up one; {gp['bytes'] / 1e6:.0f} MB) "
                  f"and nothing else takes {gp['wall_ms']:.1f} ms "
                  f"({gp['cpu_ms']:.1f} ms CPU); pedestrian's decode step takes {1e3 / p['decode_tokens_per_s']:.1f} ms "
                  f"({1e3 / p['decode_tokens_per_cpu_s']:.1f} ms CPU): the difference is the per-token work besides "
                  f"the weights ({res['model']['n_blocks']} blocks of norms, RoPE, cached attention, SwiGLU, skips, and the Python "
                  "around them). The pass by kind of matrix (ms for all blocks, GB/s): "
                  + "; ".join(f"{k} {v['shape'][0]}×{v['shape'][1]} ×{v['count']}: {v['ms']:.2f} ms, {v['gbs']:.1f} GB/s"
                              for k, v in gp.get("by_kind", {}).items())
                  + f". The pass alone reads at {100 * bw.get('gemv', float('nan')) / res['bandwidth_used_gbs']:.0f} % "
                  f"of the bandwidth used for the limit, a ceiling for any decoder on these products; the decode "
                  f"step is the pass × {(1e3 / p['decode_tokens_per_s']) / gp['wall_ms']:.2f}.",
                  "",
                  f"KV cache (pedestrian's `KVCache.nbytes`, {c['context_length']} positions, float32): "
                  f"{kv[str(c['n_kv_heads'])] / 2**20:.1f} MiB with {c['n_kv_heads']} key/value heads, "
                  f"{kv[str(c['n_heads'])] / 2**20:.1f} MiB with {c['n_heads']} (multi-head): "
                  f"{kv[str(c['n_heads'])] / kv[str(c['n_kv_heads'])]:.0f}× less memory, and as many fewer bytes "
                  f"read per token at a full context ({100 * kv[str(c['n_kv_heads'])] / res['weight_bytes']:.1f} % "
                  f"of the weights' bytes instead of {100 * kv[str(c['n_heads'])] / res['weight_bytes']:.1f} %)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--context-length", type=int, default=512)
    ap.add_argument("--n-blocks", type=int, default=30, help="fewer blocks for a quick try (default: 30, SmolLM2-135M's)")
    ap.add_argument("--rounds", type=int, default=3, help="ABBA rounds per step kind (default 3)")
    ap.add_argument("--steps-per-turn", type=int, default=2, help="steps back to back per side and turn")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--gen-repeats", type=int, default=3)
    ap.add_argument("--only", nargs="+", choices=KINDS, default=KINDS)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 1 step, 2 generation repeats")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--profile", action="store_true", help="cProfile one pedestrian step of each kind (stderr)")
    ap.add_argument("--breakdown", action="store_true", help="per-layer times of one pedestrian step (JSON)")
    ap.add_argument("--no-save", action="store_true", help="print only; write no result files")
    ap.add_argument("--threads", type=int, default=None,
                    help="run both sides with this many threads (re-executes with the thread variables set; "
                         "default: the machine's cores)")
    ap.add_argument("--child-memory", nargs=2, metavar=("SIDE", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads is not None and not args.child_memory:   # (children inherit the variables;
        common.reexec_with_threads(args.threads)             # re-executing would import torch there)
    threads = args.threads or int(os.environ.get("PEDESTRIAN_NUM_THREADS") or os.cpu_count() or 1)
    B, T = args.batch_size, args.context_length
    if args.child_memory:
        side, mode = args.child_memory
        print(json.dumps(child_memory(side, mode, B, T, args.n_blocks, threads)))
        return 0
    if args.quick:
        args.rounds, args.steps_per_turn, args.gen_repeats = 2, 1, 2

    info = common.machine_info()
    print(json.dumps({"machine": info}), file=sys.stderr)
    config = make_config(T, args.n_blocks)
    bandwidth = read_bandwidth_gbs(threads)
    from pedestrian.model.layout import param_specs

    n_params = sum(int(np.prod(s.shape)) for s in param_specs(config))
    res: dict = {"batch_size": B, "seq_len": T, "threads": threads, "hparams": HPARAMS,
                 "lora": {"r": LORA_RANK, "lora_alpha": LORA_ALPHA, "targets": SEVEN},
                 "model": {"n_params": n_params, "context_length": T, "n_blocks": config.n_blocks,
                           "d_model": config.d_model, "n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads,
                           "d_head": config.d_head, "d_mlp": config.d_mlp, "vocab_size": config.vocab_size},
                 "weight_bytes": 4 * n_params, "steps": {}, "generation": None}
    t_start, cpu_start = time.perf_counter(), cpu_seconds()
    with tempfile.TemporaryDirectory(prefix="bench_llama_") as hf_dir:
        sides = {"transformers": _Side("transformers", B, T, args.n_blocks, threads, hf_dir)}      # writes the folder
        sides["pedestrian"] = _Side("pedestrian", B, T, args.n_blocks, threads, hf_dir)            # reads it
        sides = {"pedestrian": sides["pedestrian"], "transformers": sides["transformers"]}
        res["transformers_attention"] = sides["transformers"].info["attention"]
        res["kv_cache_bytes"] = sides["pedestrian"].info["kv_cache_bytes"]
        print(f"[{time.perf_counter() - t_start:.0f} s] sides ready", file=sys.stderr)
        if "generate" in args.only:
            res["generation"] = run_generation(sides, args.new_tokens, args.gen_repeats, config.vocab_size, threads)
            print(f"[{time.perf_counter() - t_start:.0f} s] {json.dumps(res['generation'])}", file=sys.stderr)
        for mode in KINDS[1:]:
            if mode not in args.only:
                continue
            res["steps"][mode] = run_steps(sides, mode, args.rounds, args.steps_per_turn, args.warmup)
            print(f"[{time.perf_counter() - t_start:.0f} s] {json.dumps(res['steps'][mode])}", file=sys.stderr)
            if args.breakdown:
                res.setdefault("pedestrian_breakdown", {})[mode] = sides["pedestrian"].ask("breakdown")
            if args.profile:
                print(f"--- cProfile, one pedestrian {mode} step", file=sys.stderr)
                print(sides["pedestrian"].ask("profile", 1), file=sys.stderr)
        for s in sides.values():
            s.close()
    again = read_bandwidth_gbs(threads)
    for k in ("read", "copy", "read_cpu", "copy_cpu"):
        bandwidth[k] = max(bandwidth[k], again[k])
    if res["generation"]:                     # the GEMV pass reads the weights too: a read bandwidth
        gp = res["generation"]["gemv_pass"]
        bandwidth["gemv"] = round(gp["bytes"] / gp["wall_ms"] / 1e6, 2)
        bandwidth["gemv_cpu"] = round(gp["bytes"] / gp["cpu_ms"] / 1e6, 2)
    res["bandwidth_gbs"] = bandwidth
    res["bandwidth_used_gbs"] = max(bandwidth["read"], bandwidth.get("gemv", 0.0))
    res["bandwidth_limit_tokens_per_s"] = round(res["bandwidth_used_gbs"] * 1e9 / res["weight_bytes"], 2)
    res["bandwidth_used_cpu_gbs"] = max(bandwidth["read_cpu"], bandwidth.get("gemv_cpu", 0.0))
    res["bandwidth_limit_tokens_per_cpu_s"] = round(res["bandwidth_used_cpu_gbs"] * 1e9 / res["weight_bytes"], 2)
    if res["generation"]:
        for name in ("pedestrian", "transformers"):
            g = res["generation"][name]
            g["share_of_limit"] = round(g["decode_tokens_per_s"] / res["bandwidth_limit_tokens_per_s"], 3)
            g["share_of_limit_cpu"] = round(g["decode_tokens_per_cpu_s"] / res["bandwidth_limit_tokens_per_cpu_s"], 3)
            g["share_of_round_limit"] = [round(d * res["weight_bytes"] / (max(bw, bandwidth.get("gemv", 0.0)) * 1e9), 3)
                                         for d, bw in zip(g["decode_tokens_per_s_all"], res["generation"]["read_gbs_per_round"])]
    if not args.no_memory:
        res["memory"] = {}
        for mode in res["steps"]:
            m = {}
            for side in ("pedestrian", "transformers"):
                extra = [] if args.threads is None else ["--threads", str(args.threads)]
                m[side] = common.child_json([__file__, "--child-memory", side, mode, "--batch-size", str(B),
                                             "--context-length", str(T), "--n-blocks", str(args.n_blocks), *extra], timeout=900)
                print(f"[{time.perf_counter() - t_start:.0f} s] memory {mode} {side} {m[side]}", file=sys.stderr)
            m["ratio"] = round(m["pedestrian"]["peak_rss_mib"] / m["transformers"]["peak_rss_mib"], 3)
            res["memory"][mode] = m
    res["load_average_end"] = round(os.getloadavg()[0], 2)
    res["runtime_s"] = round(time.perf_counter() - t_start, 1)
    cpu_end = cpu_seconds()
    if cpu_start and cpu_end:             # other processes' share of the cores over the run
        others = (cpu_end[0] - cpu_start[0]) - (cpu_end[1] - cpu_start[1])
        res["others_cpu_share"] = round(max(0.0, others) / (res["runtime_s"] * (os.cpu_count() or 1)), 3)
    text = markdown(res, info)
    print(text)
    if not args.no_save:
        tag = "llama_smollm2_135m" + ("" if args.threads is None else f"_{args.threads}thread")
        common.write_json(tag, {"machine": info, **res})
        common.write_markdown(tag, text)
        if args.n_blocks != 30:
            tag += f"_{args.n_blocks}blocks"
        if args.threads is None and args.n_blocks == 30 and set(args.only) == set(KINDS):
            common.update_doc_section("llama_numpy", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
