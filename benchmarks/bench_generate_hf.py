"""Generation benchmark: pedestrian's KV-cache sampler against Hugging Face ``generate``.

One tiny random GPT-2 is built with ``transformers`` (``GPT2LMHeadModel``, 4 blocks, d_model
128, 4 heads, 1024 positions, a 300-id byte-level BPE trained here), saved with
``save_pretrained`` and loaded into pedestrian through ``pedestrian.interop.hf.load_pretrained``,
so both sides hold identical weights. Both decode greedily (``temperature=0`` /
``do_sample=False``) from the same prompt, batch 1, for 200 and 1000 new tokens; runs alternate
and every figure is a median. The tokens of both sides are compared (greedy decoding of the same
weights should give the same text; float32 rounding may flip a near-tie late in a long run).

``--size gpt2``: a random GPT-2 of gpt2-124M's size (12 blocks of 768, 12 heads, GPT-2's
vocabulary of 50,257 ids; the prompt uses the small tokenizer's ids), 50 new tokens, also
against the memory-bandwidth limit: every weight is read once per token, so no decoder can
beat ``copy bandwidth ÷ weight bytes`` tokens/s (the bandwidth measured here, a large
``np.copyto``, bytes read plus written).

Run (about a minute)::

    python3 benchmarks/bench_generate_hf.py                    # NumPy backend
    python3 benchmarks/bench_generate_hf.py --backend torch    # torch tensors as plain arrays
    python3 benchmarks/bench_generate_hf.py --size gpt2        # gpt2-124M-sized

Writes ``benchmarks/results/generate_<backend>.json`` and ``.md`` and refreshes the matching
table in ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SIZES = {"tiny": dict(n_layer=4, n_head=4, n_embd=128, n_positions=1024),
         "gpt2": dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024)}
MODEL = SIZES["tiny"]
VOCAB = 300                       # the tokenizer's ids (and the tiny model's vocabulary)
GPT2_VOCAB = 50257
PROMPT_LEN = 8


def _training_text() -> str:
    """Some fixed English text for the tokenizer (the package's own docstrings)."""
    import pedestrian.generation.generate
    import pedestrian.model.gpt

    return (pedestrian.model.gpt.__doc__ or "") + (pedestrian.generation.generate.__doc__ or "")


def build_hf_dir(directory: Path, seed: int = 0, size: str = "tiny"):
    """Save a random GPT-2 and its tokenizer in ``directory``; return the HF model (eval)."""
    import torch
    import transformers

    from pedestrian.text.tokenizer import BPETokenizer

    transformers.logging.set_verbosity_error()
    tok = BPETokenizer.train(_training_text(), vocab_size=VOCAB)
    fast = transformers.GPT2TokenizerFast(tokenizer_object=tok.hf, bos_token="<|endoftext|>",
                                          eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.save_pretrained(str(directory))
    torch.manual_seed(seed)
    vocab = tok.vocab_size if size == "tiny" else GPT2_VOCAB
    config = transformers.GPT2Config(vocab_size=vocab, bos_token_id=0, eos_token_id=0,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, **SIZES[size])
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(str(directory))
    return model, tok


def hf_generate(model, prompt: np.ndarray, n_new: int, use_cache: bool) -> np.ndarray:
    import torch

    ids = torch.as_tensor(prompt[None, :], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                             min_new_tokens=n_new, do_sample=False, use_cache=use_cache,
                             pad_token_id=0, eos_token_id=None)
    return out[0].numpy()


def pick_torch_threads(hf_model, prompt, n_new: int = 50) -> dict:
    """HF's fastest eager setting here: 1 or the default number of torch threads (at batch 1
    a tiny model's operations are too small to gain from threads, and waking them costs)."""
    import torch

    default = torch.get_num_threads()
    times = {}
    for n in sorted({1, default}) * 2:
        torch.set_num_threads(n)
        t0 = time.perf_counter()
        hf_generate(hf_model, prompt, n_new, True)
        times.setdefault(n, []).append(time.perf_counter() - t0)
    best = min(times, key=lambda n: min(times[n]))
    torch.set_num_threads(best)
    return {"chosen": best, "hf_seconds_for_50_tokens": {n: round(min(v), 4) for n, v in times.items()}}


def copy_bandwidth_gbs(n_bytes: int = 1 << 28, repeats: int = 5) -> float:
    """Memory bandwidth in GB/s: the best of ``repeats`` copies of ``n_bytes`` (bytes read plus
    bytes written, over the time)."""
    a = np.ones(n_bytes // 4, dtype=np.float32)
    b = np.empty_like(a)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(repeats))
    return 2 * n_bytes / best / 1e9


def _timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def run(backend: str, lengths: list[int], repeats: int, hf_no_cache: bool, size: str = "tiny") -> dict:
    import torch

    from pedestrian.generation.generate import Sampling, generate
    from pedestrian.interop.hf import load_pretrained

    with tempfile.TemporaryDirectory() as tmp:
        hf_model, tok = build_hf_dir(Path(tmp), size=size)
        model, _ = load_pretrained(tmp, backend=backend)
    n_params = model.num_params()
    prompt = np.asarray(tok.encode("The GPT: parameters, forward")[:PROMPT_LEN], dtype=np.int64)
    threads = pick_torch_threads(hf_model, prompt)
    rows = []
    for n_new in lengths:
        sides = {"pedestrian": lambda: generate(model, prompt, n_new, Sampling(temperature=0.0)),
                 "hf_cache": lambda: hf_generate(hf_model, prompt, n_new, True)}
        if hf_no_cache and n_new <= 200:
            sides["hf_no_cache"] = lambda: hf_generate(hf_model, prompt, n_new, False)
        sides["pedestrian"]()                               # warm-up (imports, caches)
        sides["hf_cache"]()
        times: dict[str, list[float]] = {k: [] for k in sides}
        outputs = {}
        for r in range(repeats):
            order = list(sides) if r % 2 == 0 else list(sides)[::-1]
            for name in order:
                t0 = time.perf_counter()
                outputs[name] = np.asarray(sides[name]())
                times[name].append(time.perf_counter() - t0)
        ped, ref = outputs["pedestrian"][PROMPT_LEN:], outputs["hf_cache"][PROMPT_LEN:]
        same = int(np.argmax(ped != ref)) if np.any(ped != ref) else len(ref)
        row = {"new_tokens": n_new, "same_leading_tokens": same}
        for name, ts in times.items():
            med = float(np.median(ts))
            row[f"{name}_s"] = round(med, 4)
            row[f"{name}_tokens_per_s"] = round(n_new / med, 1)
        row["speedup_vs_hf_cache"] = round(row["pedestrian_tokens_per_s"] / row["hf_cache_tokens_per_s"], 2)
        rows.append(row)
        print(row, file=sys.stderr)
    bandwidth = copy_bandwidth_gbs()
    limit = bandwidth * 1e9 / (4 * n_params)                # float32 weights, each read once per token
    for row in rows:
        row["bandwidth_limit_tokens_per_s"] = round(limit, 1)
        row["pedestrian_of_limit"] = round(row["pedestrian_tokens_per_s"] / limit, 3)
    return {"backend": backend, "size": size, "n_params": n_params, "copy_bandwidth_gbs": round(bandwidth, 1),
            "model": {**SIZES[size], "vocab_size": VOCAB if size == "tiny" else GPT2_VOCAB},
            "prompt_len": PROMPT_LEN, "batch_size": 1, "decoding": "greedy", "repeats": repeats,
            "torch_threads": threads, "results": rows}


def markdown(res: dict, info: dict) -> str:
    m = res["model"]
    title = "Generation" + ("" if res["size"] == "tiny" else ", gpt2-124M-sized")
    lines = [f"### {title}, `backend=\"{res['backend']}\"`", "", common.machine_line(info), "",
             f"{'Tiny random' if res['size'] == 'tiny' else 'Random'} GPT-2 ({res['n_params']:,} parameters: {m['n_layer']} blocks, d_model "
             f"{m['n_embd']}, {m['n_head']} heads, {m['n_positions']} positions, vocabulary "
             f"{m['vocab_size']}), greedy, batch 1, prompt of {res['prompt_len']} tokens; median "
             f"of {res['repeats']} alternating runs. PyTorch threads: {res['torch_threads']['chosen']} "
             f"(the faster for HF generate of 1 and the default; seconds for 50 tokens: "
             f"{res['torch_threads']['hf_seconds_for_50_tokens']}). Memory-bandwidth limit: copy bandwidth "
             f"{res['copy_bandwidth_gbs']} GB/s ÷ {4 * res['n_params'] / 1e6:.0f} MB of float32 weights per token.", "",
             "| new tokens | pedestrian tokens/s | HF generate (KV cache) tokens/s | speed-up "
             "| HF without cache tokens/s | bandwidth limit tokens/s (pedestrian's share) | identical leading tokens |",
             "|---|---|---|---|---|---|---|"]
    for r in res["results"]:
        nc = f"{r['hf_no_cache_tokens_per_s']:.0f}" if "hf_no_cache_tokens_per_s" in r else "–"
        lines.append(f"| {r['new_tokens']} | {r['pedestrian_tokens_per_s']:.0f} | "
                     f"{r['hf_cache_tokens_per_s']:.0f} | **{r['speedup_vs_hf_cache']:.1f}×** | {nc} | "
                     f"{r['bandwidth_limit_tokens_per_s']:.0f} ({100 * r['pedestrian_of_limit']:.0f} %) | "
                     f"{r['same_leading_tokens']} / {r['new_tokens']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="numpy", choices=["numpy", "torch"])
    ap.add_argument("--size", default="tiny", choices=list(SIZES))
    ap.add_argument("--lengths", type=int, nargs="+", default=None, help="default 200 1000 (gpt2: 50)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-hf-no-cache", action="store_true", help="skip HF generate without cache")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    args.lengths = args.lengths or ([200, 1000] if args.size == "tiny" else [50])
    if max(args.lengths) + PROMPT_LEN > MODEL["n_positions"]:
        ap.error(f"--lengths must stay below {MODEL['n_positions'] - PROMPT_LEN} (HF GPT-2 has no "
                 "sliding window)")
    info = common.machine_info()
    res = run(args.backend, args.lengths, args.repeats, not args.no_hf_no_cache and args.size == "tiny", args.size)
    text = markdown(res, info)
    print(text)
    if not args.no_save:
        tag = f"generate_{args.backend}" + ("" if args.size == "tiny" else f"_{args.size}")
        common.write_json(tag, {"machine": info, **res})
        common.write_markdown(tag, text)
        common.update_doc_section(tag, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
