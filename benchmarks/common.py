"""Shared helpers for the side-by-side benchmarks (run by hand, never as timed tests).

- :func:`machine_info`: date, CPU, core count, library versions, thread settings, load.
- :func:`matmul_peak_gflops`: float32 matmul throughput measured in the same run (the MFU
  denominator), for NumPy and for PyTorch.
- :func:`training_flops`: matmul FLOPs of one training step of a GPT config.
- :func:`child_json`: run this script again in a subprocess (for per-side peak memory) and
  read the JSON it prints on its last line.
- :func:`update_doc_section`: replace a marked section of ``docs/performance.md``.
- :class:`SpawnedSide`: one side of a comparison in a spawned process, driven over a pipe.

Timing is by ``time.perf_counter``; every figure we report is a median.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "performance.md"


def peak_rss_mib(pid: int | str = "self") -> float:
    """Peak resident set size of this process (or of process ``pid``) so far, in MiB.

    Linux: ``VmHWM`` of ``/proc/<pid>/status`` (the high-water mark of that address space).
    ``ru_maxrss`` is not used there: it survives fork + exec, so a child would report its
    parent's peak if that was higher.
    """
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _blas_name() -> str:
    try:
        cfg = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"{cfg.get('name')} {cfg.get('version')}"
    except Exception:  # older NumPy: no dict mode
        return "unknown"


def machine_info() -> dict:
    """What the numbers were measured on (goes into every JSON result)."""
    info = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numpy_blas": _blas_name(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "env": {k: os.environ.get(k) for k in (*THREAD_VARS, "OPENBLAS_CORETYPE",
                                                 "OPENBLAS_THREAD_TIMEOUT")},
    }
    try:
        import threadpoolctl

        info["threadpools"] = [{k: p.get(k) for k in ("internal_api", "num_threads", "version",
                                                      "architecture")}
                               for p in threadpoolctl.threadpool_info()]
    except ImportError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PEDESTRIAN_NUM_THREADS")


def reexec_with_threads(n: int) -> None:
    """Restart this script with every thread-count variable set to ``n`` (BLAS libraries read
    them once, when loaded, so they cannot be changed in a running process)."""
    if n < 1:
        raise SystemExit(f"--threads must be >= 1, got {n}")
    if all(os.environ.get(k) == str(n) for k in THREAD_VARS):
        try:
            import torch

            torch.set_num_threads(n)
        except ImportError:
            pass
        return
    env = {**os.environ, **{k: str(n) for k in THREAD_VARS}}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def median_ms(seconds: list[float]) -> float:
    return 1e3 * statistics.median(seconds)


def matmul_peak_gflops(backend: str, n: int = 1536, repeats: int = 7) -> dict:
    """Float32 matmul throughput: a square ``n``-matmul (the peak) and the attention shape.

    Returns ``{"square": GFLOP/s of (n,n)@(n,n) (best of repeats), "batched_48x64": GFLOP/s of a
    (48,64,64)@(48,64,64) batch (median)}``. Best-of for the peak: it is the ceiling we compare
    against, and on a shared machine the best run is the least disturbed one.
    """
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    qa = rng.standard_normal((48, 64, 64), dtype=np.float32)
    qb = rng.standard_normal((48, 64, 64), dtype=np.float32)
    if backend == "torch":
        import torch

        a, b, qa, qb = (torch.from_numpy(x) for x in (a, b, qa, qb))
        mm = torch.matmul
    else:
        mm = np.matmul
    out = mm(a, b)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm(a, b)
        times.append(time.perf_counter() - t0)
    square = 2.0 * n ** 3 / min(times) / 1e9
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(50):
            mm(qa, qb)
        times.append((time.perf_counter() - t0) / 50)
    del out
    batched = 2.0 * 48 * 64 ** 3 / statistics.median(times) / 1e9
    return {"square_n": n, "square": round(square, 1), "batched_48x64": round(batched, 1)}


def training_flops(config, batch_size: int, seq_len: int) -> dict:
    """Matmul FLOPs of one training step (forward + backward = 3 x forward).

    Counts every matrix product the model computes: the fused q/k/v (``n_kv_heads`` key/value
    heads), attention scores and ``P v`` (full ``T x T``, as both implementations compute it), the
    projection, the MLP (three matrices for SwiGLU) and the logits layer. Elementwise work, the
    embedding gather and the optimizer are not counted (the usual convention, e.g. nanoGPT's
    ``estimate_mfu``; they are small next to the matmuls).
    """
    c = config
    N = batch_size * seq_len
    hq, hv = c.n_heads * c.d_qk, c.n_heads * c.d_head
    n_kv = getattr(c, "n_kv_heads", None) or c.n_heads               # grouped-query: fewer k, v heads
    n_mlp = 3 if getattr(c, "mlp", "standard") == "swiglu" else 2   # SwiGLU: gate, up, down
    per_block = 2 * N * (c.d_model * (hq + n_kv * (c.d_qk + c.d_head)) + hv * c.d_model
                         + n_mlp * c.d_model * c.d_mlp)
    attention = 2 * batch_size * c.n_heads * seq_len * seq_len * (c.d_qk + c.d_head)
    logits = 2 * N * c.d_model * c.vocab_size
    forward = c.n_blocks * (per_block + attention) + logits
    return {"forward": forward, "step": 3 * forward}


def child_json(args: list[str], timeout: float = 600.0) -> dict:
    """Run ``python3 <args>`` and parse the JSON object printed on its last stdout line."""
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"child {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_json(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def write_markdown(name: str, text: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.md"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def update_doc_section(key: str, text: str, doc: Path = DOC) -> bool:
    """Replace the text between ``<!-- bench:KEY:start -->`` and ``<!-- bench:KEY:end -->``.

    Returns False (and changes nothing) when the markers are not in the document.
    """
    if not doc.exists():
        return False
    start, end = f"<!-- bench:{key}:start -->", f"<!-- bench:{key}:end -->"
    body = doc.read_text()
    if start not in body or end not in body:
        return False
    head, rest = body.split(start, 1)
    _, tail = rest.split(end, 1)
    tmp = doc.with_suffix(".md.tmp")
    tmp.write_text(f"{head}{start}\n{text.rstrip()}\n{end}{tail}")
    os.replace(tmp, doc)
    return True


def machine_line(info: dict) -> str:
    """One Markdown line naming the date and the machine."""
    threads = f"torch threads {info.get('torch_threads', '-')}"
    return (f"Measured {info['date']} on {info['cpu']} ({info['logical_cores']} logical cores), "
            f"Python {info['python']}, NumPy {info['numpy']} ({info['numpy_blas']}), "
            f"PyTorch {info.get('torch', '-')} ({threads}), float32; "
            f"1-minute load average at start {info['load_average_1m']}.")


class SpawnedSide:
    """One side of a comparison in a process of its own (spawned: nothing inherited), driven over
    a pipe. ``target(*args, conn)`` runs there: it sends its ``info`` first, then answers each
    command tuple it receives until ``("exit",)``; an exception it sends instead is raised here as
    a ``RuntimeError`` whose message holds ``show(exception)`` (``repr`` unless a subclass says)."""

    show = staticmethod(repr)

    def __init__(self, target, *args):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(*args, child), daemon=True)
        self.proc.start()
        self.info = self._recv()

    def _recv(self):
        reply = self.conn.recv()
        if isinstance(reply, BaseException):
            raise RuntimeError(f"benchmark side failed: {self.show(reply)}")
        return reply

    def ask(self, *command):
        self.conn.send(command)
        return self._recv()

    def close(self) -> None:
        self.conn.send(("exit",))
        self.proc.join(timeout=60)
