"""Parameter counts: the ``pedestrian params`` command, ``model.layout.count_params`` and
``GPT.num_params`` against the table of /work/shared/EQUATIONS.md ("Parameter counts to
reproduce", GPT-2 small widths d = 768, context 1,024, V = 50,257) and against a closed-form
count written out here.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from pedestrian import cli
from pedestrian.config import GPTConfig, preset
from pedestrian.model.layout import count_params, lora_specs, param_specs
from pedestrian.model import GPT

# Expected numbers: the table "Parameter counts to reproduce" in /work/shared/EQUATIONS.md.
ONE_BLOCK = 7_087_872
PAPER_MINIMAL = 85_120_849          # one block + embeddings + final LN + FC_logits with bias
GPT2_UNTIED = 163_087_441           # twelve blocks, untied, FC_logits with bias
GPT2 = 124_439_808                  # twelve blocks, tied, no logits bias (released GPT-2 small)
LORA_R16_LOGITS = 816_400           # LoRA r = 16 on FC_logits only
LORA_R16_ALL = 3_470_608            # LoRA r = 16 on q, k, v, attProj, expand, contract x 12 + logits


def run_params(capsys, *argv: str) -> str:
    status = cli.main(["params", *argv])
    out = capsys.readouterr().out
    assert status == 0, out
    return out


def number_on_line(out: str, label: str) -> int:
    """The integer (with thousands separators) after ``label`` at the start of a line."""
    m = re.search(rf"^{re.escape(label)}\s+([\d,]+)", out, flags=re.MULTILINE)
    assert m, f"no line starting with {label!r} in:\n{out}"
    return int(m.group(1).replace(",", ""))


@pytest.mark.parametrize("preset_name,total", [("paper-minimal", PAPER_MINIMAL), ("gpt2-untied", GPT2_UNTIED),
                                               ("gpt2", GPT2)])
def test_cli_reproduces_the_paper_counts(capsys, preset_name, total):
    out = run_params(capsys, "--preset", preset_name)
    assert number_on_line(out, "one transformer block") == ONE_BLOCK
    assert number_on_line(out, "total") == total
    assert count_params(preset(preset_name)) == total


@pytest.mark.parametrize("targets,expected", [(["logits"], LORA_R16_LOGITS), (["all"], LORA_R16_ALL),
                                              (["q", "k", "v", "attn_proj", "mlp_expand", "mlp_contract",
                                                "logits"], LORA_R16_ALL)],
                         ids=["logits", "all", "every-kind"])
def test_cli_reproduces_the_lora_counts(capsys, targets, expected):
    out = run_params(capsys, "--preset", "gpt2", "--lora-rank", "16", "--lora-targets", *targets)
    assert number_on_line(out, "total") == GPT2
    assert number_on_line(out, f"LoRA r=16 on {','.join(targets)}") == expected
    assert count_params(preset("gpt2"), lora_targets=targets, lora_rank=16) == expected


def test_cli_with_explicit_widths(capsys):
    out = run_params(capsys, "--vocab-size", "11", "--context-length", "8", "--d-model", "12",
                     "--n-heads", "3", "--n-blocks", "2", "--d-qk", "5", "--untied", "--per-block")
    cfg = GPTConfig(vocab_size=11, context_length=8, d_model=12, n_heads=3, n_blocks=2, d_qk=5, tie_weights=False)
    assert number_on_line(out, "total") == closed_form_count(cfg) == count_params(cfg)
    assert "blocks.1.mlp_contract.weight" in out        # --per-block lists every block


def test_cli_bad_config_is_a_one_line_error(capsys):
    status = cli.main(["params", "--vocab-size", "11", "--context-length", "8", "--d-model", "10",
                       "--n-heads", "3", "--n-blocks", "1"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("error: d_model=10 is not divisible by n_heads=3") and err.count("\n") == 1


def test_cli_missing_widths_are_named(capsys):
    status = cli.main(["params", "--vocab-size", "11", "--d-model", "12"])
    err = capsys.readouterr().err
    assert status == 2
    assert "missing model settings: --context-length, --n-heads, --n-blocks" in err


def closed_form_count(c: GPTConfig) -> int:
    """Parameters written out layer by layer (EQUATIONS.md, "The minimal GPT"), independent of
    ``param_specs``: LN (w, b), fused q/k/v, attProj, expand (d -> d_mlp), contract, logits."""
    d, H, b = c.d_model, c.n_heads, int(c.bias)
    d_mlp = c.mlp_ratio * d
    ln = d * (1 + b)
    block = (2 * ln
             + 2 * (d * H * c.d_qk + b * H * c.d_qk) + d * H * c.d_head + b * H * c.d_head
             + H * c.d_head * d + b * d
             + d * d_mlp + b * d_mlp + d_mlp * d + b * d)
    logits_bias = bool(getattr(c, "logits_bias", c.bias and not c.tie_weights))
    logits = 0 if c.tie_weights else d * c.vocab_size + logits_bias * c.vocab_size
    return c.vocab_size * d + c.context_length * d + c.n_blocks * block + ln + logits


def test_closed_form_matches_the_paper_block():
    assert closed_form_count(preset("gpt2")) == GPT2
    c1 = preset("paper-minimal")
    assert closed_form_count(c1) == PAPER_MINIMAL
    # one block = the difference between a 2-block and a 1-block model
    c2 = preset("paper-minimal", n_blocks=2)
    assert closed_form_count(c2) - closed_form_count(c1) == ONE_BLOCK


SMALL_CONFIGS = {
    "tied": GPTConfig(vocab_size=11, context_length=8, d_model=12, n_heads=3, n_blocks=2),
    "untied": GPTConfig(vocab_size=11, context_length=8, d_model=12, n_heads=3, n_blocks=2, tie_weights=False),
    "nobias-dqk-dhead": GPTConfig(vocab_size=13, context_length=5, d_model=8, n_heads=2, n_blocks=1,
                                  d_qk=3, d_head=5, bias=False, tie_weights=False),
    "mlp2-1head": GPTConfig(vocab_size=7, context_length=6, d_model=6, n_heads=1, n_blocks=3, mlp_ratio=2),
}


@pytest.mark.parametrize("name", list(SMALL_CONFIGS))
def test_count_params_agrees_with_allocated_model(name):
    cfg = SMALL_CONFIGS[name]
    model = GPT(cfg, dtype="float64")
    n = count_params(cfg)
    assert n == closed_form_count(cfg)
    assert model.num_params() == n == model.flat.shape[0]
    assert sum(int(np.prod(v.shape)) for v in model.params.values()) == n
    assert {s.name: s.shape for s in param_specs(cfg)} == {k: tuple(v.shape) for k, v in model.params.items()}

    # LoRA r=2 on q, v and logits: count_params(lora_rank=...) is the adapter count alone
    n_lora = count_params(cfg, lora_targets=["q", "v", "logits"], lora_rank=2)
    f_in_out = [(cfg.d_model, cfg.n_heads * cfg.d_qk), (cfg.d_model, cfg.n_heads * cfg.d_head)] * cfg.n_blocks
    assert n_lora == sum(2 * (fi + fo) for fi, fo in f_in_out) + 2 * (cfg.d_model + cfg.vocab_size)
    assert n_lora == sum(s.size for s in lora_specs(cfg, ["q", "v", "logits"], 2))
    model.add_lora(["q", "v", "logits"], rank=2, freeze_base=True)
    assert model.num_params() == n + n_lora
    assert model.num_params(trainable_only=True) == n_lora
    model.remove_lora()
    model.add_lora(["q", "v", "logits"], rank=2, freeze_base=False)
    assert model.num_params(trainable_only=True) == n + n_lora
