"""Data parallel over ranks (pedestrian.training.distributed): 2 ranks == 1 rank, exact resume, a killed
rank, one writer, and the pieces that make it so (row-keyed dropout, the agreed stop)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import pedestrian
from pedestrian.generation.sampling import Sampling
from pedestrian.checkpoint import load_checkpoint
from pedestrian.cli import main
from pedestrian.config import GPTConfig
from pedestrian.training.distributed import RowKeyedRNG, SingleProcess, process_group
from pedestrian.training.loop import Batches, Optimization, StopRules, Trainer
from pedestrian.model import GPT
from pedestrian.training.optim import AdamW
from pedestrian.training import TrainingError, TrainSettings, read_log, train

torch = pytest.importorskip("torch")
SRC = str(Path(pedestrian.__file__).resolve().parents[1])
HELPERS = Path(__file__).resolve().parents[1] / "helpers"
TINY = ["--context-length", "16", "--d-model", "16", "--n-heads", "2", "--n-blocks", "1", "--batch-size", "4",
        "--warmup-steps", "2", "--eval-batches", "2", "--no-progress", "--no-sample", "--no-plot"]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "PEDESTRIAN_LAUNCHED", "TORCHELASTIC_ERROR_FILE"):
        env.pop(k, None)
    return env


def _run(args: list, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], env=_env(), capture_output=True, text=True,
                          timeout=timeout)


TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum".split()
    path = tmp_path_factory.mktemp("corpus") / "c.txt"
    path.write_text("\n".join(" ".join(rng.choice(words, 10)) for _ in range(600)), encoding="utf-8")
    return path


def _losses(out: Path) -> dict:
    return {r["step"]: r["loss"] for r in read_log(out / "log.jsonl") if "loss" in r}


# ---------------------------------------------------------------------------------------- the pieces
def test_row_keyed_masks_do_not_depend_on_the_split():
    """Row b of a draw depends only on (key, call, first_row + b): any split of the rows (and
    rows_from for the later slices) gives the rows of the whole draw, call after call."""
    whole = RowKeyedRNG((3, 9, 0))
    a = [whole.random((6, 4, 5)) for _ in range(3)]
    for bounds in ((0, 2, 6), (0, 1, 3, 6), (0, 6)):
        parts = [RowKeyedRNG((3, 9, 0), first_row=lo) for lo in bounds[:-1]]
        for call in range(3):
            got = np.concatenate([p.random((hi - lo, 4, 5)) for p, lo, hi in zip(parts, bounds, bounds[1:])])
            np.testing.assert_array_equal(got, a[call])
    later = RowKeyedRNG((3, 9, 0))
    later.random((6, 4, 5))
    np.testing.assert_array_equal(later.rows_from(4).random((2, 4, 5)), a[1][4:])
    assert not np.array_equal(a[0], a[1])                                 # each call draws anew
    assert not np.array_equal(RowKeyedRNG((3, 10, 0)).random((6, 4, 5)), a[0])   # another step
    assert 0.0 <= a[0].min() and a[0].max() < 1.0
    with pytest.raises(ValueError, match=">= 0"):
        RowKeyedRNG((-1,))


def test_single_process_group_is_the_identity():
    g = process_group()
    assert isinstance(g, SingleProcess) and (g.rank, g.world_size, g.is_writer) == (0, 1, True)
    assert g.rows(7) == slice(0, 7)
    buf = np.arange(4.0)
    g.sum_buffers([buf])
    np.testing.assert_array_equal(buf, np.arange(4.0))
    assert g.sum([1.5, 2]) == [1.5, 2.0] and g.max(3) == 3 and g.broadcast({"a": 1}) == {"a": 1}


def test_rows_of_each_rank_cover_the_batch_once():
    for W in (1, 2, 3, 5):
        for B in (W, 7, 16):
            ranks = []
            for r in range(W):
                g = SingleProcess()
                g.rank, g.world_size = r, W
                ranks.append(g.rows(B))
            assert [i for s in ranks for i in range(B)[s]] == list(range(B))
            assert all(s.stop - s.start in (B // W, -(-B // W)) for s in ranks)


class _OtherRanks(SingleProcess):
    """Rank 0 of 2 whose other rank answers ``code`` to every stop exchange."""

    world_size = 2

    def __init__(self, code: int):
        super().__init__()
        self.code = code

    def max(self, value, what=""):
        return max(value, self.code)


def test_the_most_urgent_stop_reason_of_any_rank_wins():
    from pedestrian.training.loop import STOP_REASONS

    model = GPT(GPTConfig(vocab_size=5, context_length=4, d_model=4, n_heads=1, n_blocks=1))
    opt = AdamW(model, lr=1e-3)
    parts = Optimization(opt, lambda s: 1e-3), Batches(lambda: []), StopRules(end=10)
    trainer = Trainer(model, *parts, group=_OtherRanks(STOP_REASONS.index("interrupted") + 1))
    assert trainer.should_stop() == "interrupted" and trainer.interrupted_by == "another rank"
    trainer = Trainer(model, *parts, group=_OtherRanks(STOP_REASONS.index("max_minutes") + 1)).resume(10)
    assert trainer.should_stop() == "max_minutes"                 # rank 0's time guard ran out
    trainer = Trainer(model, *parts, group=_OtherRanks(0)).resume(3)
    assert trainer.should_stop() is None


def test_batch_smaller_than_the_ranks_is_refused_before_anything_is_written(corpus, tmp_path):
    settings = TrainSettings(data=str(corpus), out=str(tmp_path / "run"), batch_size=1, progress=False,
                             model=dict(context_length=8, d_model=8, n_heads=2, n_blocks=1))
    with pytest.raises(TrainingError, match="--batch-size 1 is smaller than the 2 ranks"):
        train(settings, group=_OtherRanks(0))
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------- 2 ranks == 1
def test_two_ranks_give_the_losses_of_one_rank_at_every_step(tmp_path):
    """20 AdamW steps of the same global batches (5 rows, ignored targets in one rank's rows), with
    dropout off and on and with 3 micro-batches per step: the two ranks hold the same parameters
    bit for bit, and their losses equal one process's at every step. Same arithmetic except the
    order of the gradient sums (two partial sums added instead of one): ~1 ulp per step, grown by
    20 AdamW steps -- measured 2e-16 (float64) and 1.4e-7 (float32) relative at worst. And the
    accumulation of micro-batches that count different numbers of targets, on each rank and on
    one process, equals the step of one batch made of them (dist_scenarios.accumulation)."""
    sys.path.insert(0, str(HELPERS))
    import dist_scenarios

    done = _run([*TORCHRUN, HELPERS / "dist_scenarios.py", tmp_path / "out"])
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"out.rank{r}").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["results"] == ranks[1]["results"]             # same losses, same parameter bits
    one = dist_scenarios.run(SingleProcess())
    assert one.keys() == ranks[0]["results"].keys() and len(one) == 6
    for name, want in one.items():
        got = ranks[0]["results"][name]["losses"]
        assert len(got) == len(want["losses"]) == dist_scenarios.STEPS
        tol = 1e-12 if name.startswith("float64") else 1e-5
        worst = max(abs(g - w) / abs(w) for g, w in zip(got, want["losses"]))
        assert worst <= tol, (name, worst)
    # one step of 3 micro-batches whose ignored targets differ per micro-batch and per rank (one
    # counts nothing, rank 0 nothing in another) is the step of their concatenation: loss,
    # gradient norm, clipped AdamW update. The same formulas with the float sums in other orders
    # (per rank, per micro-batch partial sums of at most 120 positions): 1e-12 relative in
    # float64 (test_accumulation.py's bound); measured 1.5e-16 or less. The old mean of the
    # micro-batch means gave 0.67x the loss, 0.70x the norm, weights 0.13 relative apart (one process).
    accum = ranks[0]["accumulation"]
    assert accum == ranks[1]["accumulation"]
    for got in (accum, dist_scenarios.accumulation(SingleProcess())):
        (loss, norm), (loss1, norm1) = got["micro"], got["one"]
        assert abs(loss - loss1) <= 1e-12 * loss1 and abs(norm - norm1) <= 1e-12 * norm1, got
        assert got["weights_rel"] <= 1e-12 and norm1 > 0.1, got    # the update was clipped


# ---------------------------------------------------------------------------------------- resume
def test_two_rank_run_stopped_and_resumed_equals_an_uninterrupted_one(corpus, tmp_path):
    """--nproc 2 (PyTorch's launcher in-process), float32, dropout and 2 micro-batches per step:
    8 steps == 4 + resume + 4, bit for bit; the checkpoint records 2 ranks; resuming on 1 rank
    continues the same run up to the order of float additions, with a warning."""
    common = ["--data", corpus, *TINY, "--dropout", "0.1", "--grad-accum", "2", "--max-steps", "8",
              "--eval-interval", "4", "--max-minutes", "0"]
    one, two = tmp_path / "one", tmp_path / "two"
    for args in (["--out", one], ["--out", two, "--stop-step", "4"], ["--out", two, "--resume"]):
        done = _run(["-m", "pedestrian", "train", "--nproc", "2", *common, *args])
        assert done.returncode == 0, done.stderr[-3000:]
    a, b = _losses(one), _losses(two)
    assert list(a) == list(range(1, 9)) and a == b                # exact float equality (JSON round-trips)
    ckpt = load_checkpoint(two)
    assert ckpt.meta["world_size"] == 2 and ckpt.step == 8
    assert ckpt.state["dropout_rng"] is None                       # masks are keyed by (seed, step, row)
    # one rank takes over from step 4 of the 2-rank run
    three = tmp_path / "three"
    done = _run(["-m", "pedestrian", "train", "--nproc", "2", *common, "--out", three, "--stop-step", "4"])
    assert done.returncode == 0, done.stderr[-3000:]
    done = _run(["-m", "pedestrian", "train", *common, "--out", three, "--resume"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ran on 2 rank(s)" in done.stderr and "not bit for bit" in done.stderr
    c = _losses(three)
    assert list(c) == list(a)
    # float32 sums in another order, ~1e-7 relative a step, over 4 AdamW steps of a 3-nat loss
    assert max(abs(a[s] - c[s]) / a[s] for s in a) <= 1e-5


# ---------------------------------------------------------------------------------------- faults
def _rank_pids(parent: int) -> dict:
    """``{rank: pid}`` of the launcher's children (their environment names their RANK)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (d / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent:
            for item in env:
                if item.startswith(b"RANK="):
                    out[int(item[5:])] = int(d.name)
    return out


def _start_long_run(corpus, out: Path, launcher: list) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *map(str, launcher), "--data", str(corpus), "--out", str(out), *TINY,
                             "--max-steps", "100000", "--eval-interval", "20", "--max-minutes", "0"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_checkpoint(proc, out: Path, step: int = 40, timeout: float = 120) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        state = out / "latest" / "state.json"
        if state.is_file() and json.loads(state.read_text())["step"] >= step:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("no checkpoint in time")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks through /proc")
def test_killing_a_rank_ends_the_run_with_one_error_and_resume_continues(corpus, tmp_path):
    out = tmp_path / "run"
    proc = _start_long_run(corpus, out, ["-m", "pedestrian", "train", "--nproc", "2"])
    try:
        _wait_for_checkpoint(proc, out)
        pids = _rank_pids(proc.pid)
        assert sorted(pids) == [0, 1]
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        seconds = time.monotonic() - t0
    finally:
        proc.kill()
    lines = err.strip().splitlines()
    kept = load_checkpoint(out)                                   # the last checkpoint loads
    assert proc.returncode == 2 and seconds < 60
    assert lines == [f"error: rank 1 of 2 was killed by SIGKILL and the run stopped; the checkpoint of step "
                     f"{kept.step} in {out / 'latest'} is kept; continue with: pedestrian train --out {out} "
                     f"--resume --nproc 2 --no-progress --no-plot --no-sample"], err
    assert not list(out.glob(".latest*"))                         # nothing half-written
    done = _run(["-m", "pedestrian", "train", "--nproc", "2", "--out", out, "--resume", "--max-steps",
                 kept.step + 3, "--no-progress", "--no-sample", "--no-plot"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(_losses(out))[-1] == kept.step + 3


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks through /proc")
def test_under_torchrun_rank_0_names_the_last_checkpoint_when_another_rank_dies(corpus, tmp_path):
    # torchrun's agent SIGTERMs rank 0 as soon as it sees rank 1 die; once in the clean-clone run
    # of 2026-12-03 rank 0 ended by that signal (exit -15) before its own error line (two full
    # runs of the same code passed): a race with the agent, tried a second time, not hidden
    for attempt in range(2):
        out = tmp_path / f"run{attempt}"
        proc = _start_long_run(corpus, out, [*TORCHRUN, "-m", "pedestrian", "train"])
        try:
            _wait_for_checkpoint(proc, out)
            agent = proc.pid                                      # torchrun's agent is the ranks' parent
            pids = _rank_pids(agent)
            os.kill(pids[1], signal.SIGKILL)
            _, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        if any(line.startswith("error: ") for line in err.splitlines()) or "exitcode  : -15" not in err:
            break
    kept = load_checkpoint(out)
    ours = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and "rank 0 of 2 lost contact with the other ranks" in ours[0], err[-3000:]
    assert f"the checkpoint of step {kept.step} in {out / 'latest'} is kept" in ours[0]
    assert "continue with: torchrun <the same options> -m pedestrian train --out" in ours[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks through /proc")
def test_sigterm_to_one_rank_stops_every_rank_with_a_checkpoint(corpus, tmp_path):
    out = tmp_path / "run"
    proc = _start_long_run(corpus, out, ["-m", "pedestrian", "train", "--nproc", "2"])
    try:
        _wait_for_checkpoint(proc, out, step=20)
        os.kill(_rank_pids(proc.pid)[1], signal.SIGTERM)          # rank 1 alone gets it; rank 0 follows
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    last = list(_losses(out))[-1]
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines() == [f"interrupted: every rank stopped on a signal; the checkpoint of step {last} "
                                        f"in {out / 'latest'} is kept; continue with: pedestrian train --out {out} "
                                        "--resume --nproc 2 --no-progress --no-plot --no-sample"]
    assert load_checkpoint(out).step == last


def _launch_failing_with(monkeypatch, exitcodes: dict):
    """``launch`` whose ranks end with ``exitcodes`` (``{rank: code}``, negative: killed by a signal)."""
    import torch.distributed.launcher.api as api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from pedestrian.training.distributed import LaunchFailure, launch

    def fake(config, entrypoint):
        def run(*args):
            raise ChildFailedError("pedestrian", {r: ProcessFailure(local_rank=r, pid=1, exitcode=c, error_file="<N/A>")
                                                  for r, c in exitcodes.items()})
        return run

    monkeypatch.setattr(api, "elastic_launch", fake)
    with pytest.raises(LaunchFailure) as info:
        launch(2, ["train"], lambda: "the checkpoint of step 7 is kept")
    return info.value


def test_a_rank_stopped_by_the_launcher_after_the_others_saved_is_an_interrupt(monkeypatch):
    """SIGTERM to rank 1: it saves with rank 0 and exits 130 first; the launcher then sends SIGTERM
    to rank 0, which may have left its training loop (its handlers restored) -- killed by SIGTERM
    after the save. The run was interrupted, not broken (seen in CI: exit 2, 'rank 0 ... was
    killed by SIGTERM')."""
    for codes in ({0: -signal.SIGTERM, 1: 130}, {0: 130, 1: 130}, {0: 130, 1: -signal.SIGTERM}):
        exc = _launch_failing_with(monkeypatch, codes)
        assert exc.interrupted and str(exc) == "every rank stopped on a signal; the checkpoint of step 7 is kept"
    for codes in ({0: -signal.SIGTERM, 1: -signal.SIGTERM}, {0: 130, 1: -signal.SIGKILL}, {0: 130, 1: 1}):
        exc = _launch_failing_with(monkeypatch, codes)
        assert not exc.interrupted and "the checkpoint of step 7 is kept" in str(exc), codes


def _failure(tmp_path, rank: int, exitcode: int, record: tuple | None = None):
    """A launcher's exit record of ``rank``; ``record``: ``(kind, message, timestamp)`` of the
    error file the rank wrote (:func:`pedestrian.training.distributed.record_error`), ``None``: none."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = "<N/A>"
    if record is not None:
        kind, message, timestamp = record
        error_file = str(tmp_path / f"error{rank}.json")
        Path(error_file).write_text(json.dumps({"message": {"message": message, "extraInfo": {
            "timestamp": str(timestamp), "pedestrian": kind}}}))
    return ProcessFailure(local_rank=rank, pid=1, exitcode=exitcode, error_file=error_file)


def test_the_failure_report_names_the_rank_that_failed_first_not_the_ones_stopped_after_it(tmp_path):
    """The launcher's records come in the order it saw the ranks end (dict order); the ranks it
    stopped afterwards (SIGTERM) and those that lost contact are consequences. Seen about 1 run in
    7 when rank 1 raised: rank 0 lost contact and exited first, the launcher sent SIGTERM to rank
    1 while it was still exiting, and the run was reported as 'rank 1 of 2 was killed by
    SIGTERM'. The rank that raises now records its exception first (next test), and the report
    prefers a rank's own error, then a rank that ended on its own, the earliest first."""
    from pedestrian.training.distributed import _failure_line

    kept = "the checkpoint of step 7 is kept"
    crash = ("crash", "rank 1 of 2 raised RuntimeError: boom (its traceback is printed above)", 100)
    lost = ("lost_contact", "rank 0 of 2 lost contact with the other ranks while exchanging the gradients", 100)
    cases = [
        # the race seen: rank 0 lost contact first, rank 1 killed by SIGTERM while exiting
        ({0: (2, lost), 1: (-signal.SIGTERM, crash)}, f"{crash[1]} and the run stopped; {kept}"),
        # rank 1 raised, the launcher stopped rank 0 before it noticed (no record of its own)
        ({1: (1, crash), 0: (-signal.SIGTERM, None)}, f"{crash[1]} and the run stopped; {kept}"),
        ({1: (1, None), 0: (-signal.SIGTERM, None)}, f"rank 1 of 2 ended with exit code 1 and the run stopped; {kept}"),
        ({1: (-signal.SIGKILL, None), 0: (-signal.SIGTERM, None)},
         f"rank 1 of 2 was killed by SIGKILL and the run stopped; {kept}"),
        ({0: (2, lost), 1: (-signal.SIGKILL, None)}, f"rank 1 of 2 was killed by SIGKILL and the run stopped; {kept}"),
        # rank 1 hung: rank 0 timed out first, then the launcher stopped rank 1
        ({0: (2, lost), 1: (-signal.SIGTERM, None)}, lost[1]),
        # rank 1 stopped from outside before its training loop, then rank 0 lost contact
        ({1: (-signal.SIGTERM, None), 0: (2, lost)}, f"rank 1 of 2 was killed by SIGTERM and the run stopped; {kept}"),
        # two errors of their own: the earlier one
        ({0: (2, ("error", "B", 101)), 1: (2, ("error", "A", 100))}, "A"),
    ]
    for records, want in cases:
        failures = {r: _failure(tmp_path, r, code, record) for r, (code, record) in records.items()}
        assert _failure_line(failures, 2, lambda: kept) == (want, False), records


def test_a_rank_that_raises_records_its_exception_for_the_launcher(tmp_path, monkeypatch, capsys):
    """An unexpected exception in a launched rank is written to the launcher's error file before
    the traceback is printed (so a SIGTERM during the rank's exit cannot hide it), and re-raised."""
    import pedestrian.commands.train as train_command
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    def boom(args):
        raise RuntimeError("boom\nsecond line")

    error_file = tmp_path / "error.json"
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_ERROR_FILE": str(error_file)}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(train_command, "run", boom)
    with pytest.raises(RuntimeError, match="boom"):
        main(["train"])
    failure = ProcessFailure(local_rank=1, pid=1, exitcode=-signal.SIGTERM, error_file=str(error_file))
    assert failure.error_file_data["message"]["extraInfo"]["pedestrian"] == "crash"
    assert failure.message["message"] == "rank 1 of 2 raised RuntimeError: boom (its traceback is printed above)"


# ---------------------------------------------------------------------------------------- starting
def test_nproc_without_torch_says_what_to_install(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.distributed", None)   # `import torch.distributed` fails
    code = main(["train", "--nproc", "2", "--data", str(corpus), "--out", str(tmp_path / "r"), *TINY])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("error: --nproc 2 needs PyTorch") and 'pip install -e ".[torch]"' in err[0]
    assert not (tmp_path / "r").exists()


def test_nproc_that_contradicts_the_launcher_is_refused(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    code = main(["train", "--nproc", "3", "--data", str(corpus), "--out", str(tmp_path / "r"), *TINY])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["error: --nproc 3, but the launcher started 2 ranks on this machine; leave "
                                 "--nproc out under torchrun (--nproc-per-node sets it)"]


# ---------------------------------------------------------------------------------------- devices
def test_device_settings_are_checked():
    with pytest.raises(TrainingError, match="--device cuda needs --backend torch"):
        TrainSettings(device="cuda").validate()
    with pytest.raises(ValueError, match="needs backend='torch'"):
        GPT(GPTConfig(vocab_size=5, context_length=4, d_model=4, n_heads=1, n_blocks=1), device="cuda")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="PyTorch sees no CUDA GPU here"):
            process_group("cuda")


def test_torch_model_keeps_every_array_on_its_device():
    """GPT(backend="torch", device=...): parameters, gradients, AdamW moments, activations and the
    KV cache are made on the device (here the CPU; the same code on a GPU: test below)."""
    from pedestrian.generation.generate import generate

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = GPTConfig(vocab_size=11, context_length=8, d_model=8, n_heads=2, n_blocks=1, dropout=0.1)
    model = GPT(cfg, backend="torch", device=dev)
    model.add_lora(["q"], rank=2, freeze_base=False, dropout=0.1)
    x = np.random.default_rng(0).integers(0, 11, (2, 8))
    opt = AdamW(model, lr=1e-3)
    model.loss(x, x)
    model.backward()
    opt.step(1e-3)
    arrays = [*model.params.values(), *model.grads.values(), *opt.m, *opt.v, *model.activations().values()]
    assert {a.device.type for a in arrays} == {torch.device(dev).type}
    model.training = False
    assert generate(model, x[:, :2], 3, Sampling(temperature=0)).shape == (2, 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here: the GPU path is unmeasured)")
def test_the_same_numbers_on_the_gpu():
    cfg = GPTConfig(vocab_size=11, context_length=8, d_model=8, n_heads=2, n_blocks=2)
    x = np.random.default_rng(0).integers(0, 11, (3, 8))
    cpu, gpu = (GPT(cfg, seed=1, dtype="float64", backend="torch", device=d) for d in ("cpu", "cuda"))
    assert abs(cpu.loss(x, x) - gpu.loss(x, x)) <= 1e-12 * abs(cpu.loss(x, x))
    g_cpu, g_gpu = cpu.backward(), gpu.backward()
    for k, g in g_cpu.items():
        assert float((g_gpu[k].cpu() - g).abs().max()) <= 1e-10 * max(float(g.abs().max()), 1e-3), k


def test_finetune_refuses_to_run_as_one_of_several_ranks(tmp_path, monkeypatch):
    """N copies of a fine-tuning run would all write the same files: it runs in one process."""
    from pedestrian.training.finetune import FinetuneSettings, finetune

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="pedestrian finetune runs in one process"):
        finetune(FinetuneSettings(hf_dir=str(tmp_path), data=str(tmp_path / "d.txt"), out=str(tmp_path / "o")))
    assert not (tmp_path / "o").exists()
