"""Generation benchmark: pedestrian's KV-cache sampler against Hugging Face ``generate``.

One tiny random GPT-2 is built with ``transformers`` (``GPT2LMHeadModel``, 4 blocks, d_model
128, 4 heads, 1024 positions, a 300-id byte-level BPE trained here), saved with
``save_pretrained`` and loaded into pedestrian through ``pedestrian.interop.hf.load_pretrained``,
so both sides hold identical weights. Both decode greedily (``temperature=0`` /
``do_sample=False``) from the same prompt, batch 1, for 200 and 1000 new tokens; runs alternate
and every figure is a median. The tokens of both sides are compared (greedy decoding of the same
weights should give the same text; float32 rounding may flip a near-tie late in a long run).

Run (about a minute)::

    python3 benchmarks/bench_generate_hf.py                    # NumPy backend
    python3 benchmarks/bench_generate_hf.py --backend torch    # torch tensors as plain arrays

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

MODEL = dict(n_layer=4, n_head=4, n_embd=128, n_positions=1024)
VOCAB = 300
PROMPT_LEN = 8


def _training_text() -> str:
    """Some fixed English text for the tokenizer (the package's own docstrings)."""
    import pedestrian.generate
    import pedestrian.model

    return (pedestrian.model.__doc__ or "") + (pedestrian.generate.__doc__ or "")


def build_hf_dir(directory: Path, seed: int = 0):
    """Save a random GPT-2 and its tokenizer in ``directory``; return the HF model (eval)."""
    import torch
    import transformers

    from pedestrian.tokenizer import BPETokenizer

    transformers.logging.set_verbosity_error()
    tok = BPETokenizer.train(_training_text(), vocab_size=VOCAB)
    fast = transformers.GPT2TokenizerFast(tokenizer_object=tok.hf, bos_token="<|endoftext|>",
                                          eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.save_pretrained(str(directory))
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=tok.vocab_size, bos_token_id=0, eos_token_id=0,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, **MODEL)
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


def run(backend: str, lengths: list[int], repeats: int, hf_no_cache: bool) -> dict:
    import torch

    from pedestrian.generate import generate
    from pedestrian.interop.hf import load_pretrained

    with tempfile.TemporaryDirectory() as tmp:
        hf_model, tok = build_hf_dir(Path(tmp))
        model, _ = load_pretrained(tmp, backend=backend)
    n_params = model.num_params()
    prompt = np.asarray(tok.encode("The GPT: parameters, forward")[:PROMPT_LEN], dtype=np.int64)
    threads = pick_torch_threads(hf_model, prompt)
    rows = []
    for n_new in lengths:
        sides = {"pedestrian": lambda: generate(model, prompt, n_new, temperature=0.0),
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
    return {"backend": backend, "n_params": n_params, "model": {**MODEL, "vocab_size": VOCAB},
            "prompt_len": PROMPT_LEN, "batch_size": 1, "decoding": "greedy", "repeats": repeats,
            "torch_threads": threads, "results": rows}


def markdown(res: dict, info: dict) -> str:
    m = res["model"]
    lines = [f"### Generation, `backend=\"{res['backend']}\"`", "", common.machine_line(info), "",
             f"Tiny random GPT-2 ({res['n_params']:,} parameters: {m['n_layer']} blocks, d_model "
             f"{m['n_embd']}, {m['n_head']} heads, {m['n_positions']} positions, vocabulary "
             f"{m['vocab_size']}), greedy, batch 1, prompt of {res['prompt_len']} tokens; median "
             f"of {res['repeats']} alternating runs. PyTorch threads: {res['torch_threads']['chosen']} "
             f"(the faster for HF generate of 1 and the default; seconds for 50 tokens: "
             f"{res['torch_threads']['hf_seconds_for_50_tokens']}).", "",
             "| new tokens | pedestrian tokens/s | HF generate (KV cache) tokens/s | speed-up "
             "| HF without cache tokens/s | identical leading tokens |",
             "|---|---|---|---|---|---|"]
    for r in res["results"]:
        nc = f"{r['hf_no_cache_tokens_per_s']:.0f}" if "hf_no_cache_tokens_per_s" in r else "–"
        lines.append(f"| {r['new_tokens']} | {r['pedestrian_tokens_per_s']:.0f} | "
                     f"{r['hf_cache_tokens_per_s']:.0f} | **{r['speedup_vs_hf_cache']:.1f}×** | {nc} | "
                     f"{r['same_leading_tokens']} / {r['new_tokens']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="numpy", choices=["numpy", "torch"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[200, 1000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-hf-no-cache", action="store_true", help="skip HF generate without cache")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    if max(args.lengths) + PROMPT_LEN > MODEL["n_positions"]:
        ap.error(f"--lengths must stay below {MODEL['n_positions'] - PROMPT_LEN} (HF GPT-2 has no "
                 "sliding window)")
    info = common.machine_info()
    res = run(args.backend, args.lengths, args.repeats, not args.no_hf_no_cache)
    text = markdown(res, info)
    print(text)
    if not args.no_save:
        tag = f"generate_{args.backend}"
        common.write_json(tag, {"machine": info, **res})
        common.write_markdown(tag, text)
        common.update_doc_section(tag, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
