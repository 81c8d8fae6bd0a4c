"""`pedestrian explain`: the paper's table of a_i / Δ_i, its FLOP and memory totals against a count
done by hand on a tiny config, and the command line (sources, errors)."""

from __future__ import annotations

import pytest

from pedestrian.cli import main as cli_main
from pedestrian.paper.explain import explain_rows, explain_table, matmul_flops, totals
from pedestrian.config import GPTConfig

TINY = dict(vocab_size=5, context_length=3, d_model=4, n_heads=2, n_blocks=1, mlp_ratio=4,
            activation="relu", bias=True, tie_weights=True)
B, T = 2, 3                                  # N = 6 tokens


def test_totals_match_a_hand_count_on_a_tiny_config():
    """Counted by hand, layer by layer (d=4, H=2, d_qk=d_h=2, d_mlp=16, V=5, N=6):

    matrix products, forward: qkv 2·6·4·12 = 576, q kᵀ 2·2·2·3·3·2 = 144, P v 144, projection
    2·6·4·4 = 192, expand 2·6·4·16 = 768, contract 768, logits 2·6·4·5 = 240 -> 2,832; the
    backward computes two products for each -> 5,664.
    elementwise, forward: position add 24; three layer norms (7 + 1 per element, 3 per row)
    3·(6·4·8 + 3·6) = 630; biases 72 + 4·6 + 16·6 + 4·6 = 216; scores (÷√d_qk and a 5-op softmax)
    36·6 = 216; two residual adds 48; ReLU 96; cross-entropy 30·9 = 270 -> 1,500.
    elementwise, backward: embedding + position 48; layer norms 3·6·4·11 = 792; bias sums 216;
    softmax 36·5 = 180; adds 48; ReLU 96; cross-entropy 30·3 = 90 -> 1,470.
    """
    config = GPTConfig(**TINY)
    rows = explain_rows(config, B, T, fused_head=False)
    tot = totals(config, rows, B, T)
    assert matmul_flops(config, B, T) == tot["matmul_step"] == 3 * 2832
    assert tot["fwd"] == 2832 + 1500
    assert tot["bwd"] == 5664 + 1470
    assert tot["step"] == 11466
    # parameters: tok 20, pos 12, ln1 8, qkv 48+12, proj 16+4, ln2 8, expand 64+16, contract 64+4, ln_f 8
    assert tot["n_params"] == 284 and tot["six_n"] == 6 * 284 * 6
    # memory, float32 (a0 int64): 48; a1 … a6, a9 … a11 (nine N·d arrays) 96 each; qkv 288; P 144;
    # a7, a8 384 each; a12 and the softmax of the loss 120 each (kept whole: fused_head=False)
    assert tot["memory"] == 48 + 96 * 9 + 288 + 144 + 2 * 384 + 2 * 120
    assert tot["params_memory"] == 4 * 284 * 4
    assert [r.name for r in rows] == ["a0", "a1", "a2", "qkv", "P", "a3", "a4", "a5", "a6", "a7", "a8",
                                      "a9", "a10", "a11", "a12", "loss"]


def test_rope_adds_its_row_and_drops_the_table():
    """RoPE: 2·N·H·r rotated q/k elements at 3 operations each way (r = d_qk = 2): 144; the
    rotated copy of qkv is kept instead of qkv; no position add, no table (12 parameters less)."""
    learned = GPTConfig(**TINY)
    rope = GPTConfig(**TINY, position_encoding="rope")
    t_l, t_r = (totals(c, explain_rows(c, B, T), B, T) for c in (learned, rope))
    row = {r.name: r for r in explain_rows(rope, B, T)}["rope"]
    assert row.fwd_flops == row.bwd_flops == 2 * 6 * 2 * 2 * 3
    assert t_r["fwd"] == t_l["fwd"] - 24 + 144 and t_r["bwd"] == t_l["bwd"] - 24 + 144
    assert t_r["memory"] == t_l["memory"]
    assert t_l["n_params"] - t_r["n_params"] == 12


def test_two_blocks_count_the_block_rows_twice():
    one, two = GPTConfig(**TINY), GPTConfig(**{**TINY, "n_blocks": 2})
    r1 = explain_rows(one, B, T)
    per_block = sum(r.fwd_flops for r in r1 if r.per_block)
    assert totals(two, explain_rows(two, B, T), B, T)["fwd"] - totals(one, r1, B, T)["fwd"] == per_block


def test_command_line(tmp_path, capsys):
    assert cli_main(["explain"]) == 0                        # the default model of `pedestrian train`
    out = capsys.readouterr().out
    assert "6·N·tokens rule: 6 × 812,288 parameters × 1,024 tokens" in out
    for name in ("a0", "a1", "a2", "a12", "loss"):
        assert f"\n{name} " in out
    assert cli_main(["explain", "--preset", "gpt2", "--position-encoding", "rope", "--batch-size", "2",
                     "--seq-len", "128"]) == 0
    assert "rope " in capsys.readouterr().out
    toml = tmp_path / "run.toml"
    toml.write_text("[model]\nd_model = 64\nn_heads = 2\nposition_encoding = \"none\"\n[optim]\nbatch_size = 4\n")
    assert cli_main(["explain", "--config", str(toml)]) == 0
    out = capsys.readouterr().out
    assert "B=4 T=64 d=64" in out and "positions: none" in out
    assert cli_main(["explain", "--preset", "gpt2", "--config", str(toml)]) == 2
    assert "at most one of" in capsys.readouterr().err
    assert cli_main(["explain", "--config", str(toml), "--d-model", "32"]) == 2
    assert "--d-model changes a preset's model" in capsys.readouterr().err
    assert cli_main(["explain", "--seq-len", "65"]) == 2
    assert "--seq-len must be in [1, context_length=64]" in capsys.readouterr().err


def test_checkpoint_source(tmp_path, capsys):
    from pedestrian.checkpoint import save_checkpoint
    from pedestrian.model import GPT

    config = GPTConfig(**{**TINY, "position_encoding": "rope"})
    save_checkpoint(tmp_path / "ck", GPT(config, dtype="float64"))
    assert cli_main(["explain", "--checkpoint", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "float64, positions: rope" in out and "B=1 T=3" in out


LLAMA_TINY = dict(vocab_size=5, context_length=3, d_model=4, n_heads=2, n_kv_heads=1, n_blocks=1, d_mlp=6,
                  norm="rmsnorm", mlp="swiglu", position_encoding="rope", bias=False, tie_weights=True)


def test_llama_totals_match_a_hand_count():
    """Llama-style, counted by hand (d=4, H=2, H_kv=1, d_qk=d_h=2, m=6, V=5, N=6, no biases):

    matrix products, forward: qkv 2·6·4·(2·2 + 1·(2+2)) = 384, q kᵀ per query head
    2·2·2·3·3·2 = 144, P v 144, projection 2·6·4·4 = 192, gate, up, down 2·6·4·6 = 288 each,
    logits 240 -> 1,968; backward two products each -> 3,936.
    elementwise, forward: three RMS norms (4 per element, 4 per row) 3·(6·4·4 + 6·4) = 360; RoPE
    on 6·(2 + 1)·2 = 36 q and k elements at 3 each = 108; scores 216; adds 48; SwiGLU 6·36 = 216;
    cross-entropy 270 -> 1,218. backward: embedding 24; RMS norms 3·6·4·8 = 576; RoPE 108;
    softmax 180; adds 48; SwiGLU 15·36 = 540; cross-entropy 90 -> 1,566.
    """
    config = GPTConfig(**LLAMA_TINY)
    rows = explain_rows(config, B, T)
    tot = totals(config, rows, B, T)
    assert matmul_flops(config, B, T) == tot["matmul_step"] == 3 * 1968
    assert tot["fwd"] == 1968 + 1218
    assert tot["bwd"] == 3936 + 1566
    # parameters: tok 20, ln1 4, q 4·4 = 16, k, v 4·2 = 8 each, proj 16, ln2 4, gate, up, down 24 each, ln_f 4
    assert tot["n_params"] == 152
    assert [r.name for r in rows] == ["a0", "a1", "a2", "qkv", "rope", "P", "a3", "a4", "a5", "a6",
                                      "a7_gate", "a7_up", "a8", "a9", "a10", "a11", "a12", "loss"]
    row = {r.name: r for r in rows}
    assert row["qkv"].shape == (B, T, 8) and row["rope"].memory == 6 * 8 * 4      # k, v: one head
    assert row["a7_gate"].memory == row["a7_up"].memory == row["a8"].memory == 6 * 6 * 4
    assert row["a8"].forward == "silu(a7_gate) ∘ a7_up" and row["a2"].forward == "RMS1(x)"


def test_a_finetune_checkpoint_gives_its_batch_window_and_adapters(tmp_path, capsys):
    """A ``pedestrian finetune`` checkpoint records its settings under ``meta["finetune"]``, not
    ``meta["settings"]``: explain took B = 1 and the model's whole context, and said nothing of
    the adapters (found by a fresh user's trial). Now: its micro-batch, its training window, and
    one line on the LoRA run (the adapters' count: r·(f_in + f_out) per adapted layer)."""
    from pedestrian.checkpoint import save_checkpoint
    from pedestrian import GPT

    config = GPTConfig(**{**TINY, "context_length": 8})
    model = GPT(config, dtype="float64")
    model.add_lora(["q", "v"], rank=2, alpha=1.0)
    meta = {"finetune": {"batch_size": 3, "context_length": 5, "lora_rank": 2, "lora_targets": ["q", "v"]}}
    save_checkpoint(tmp_path / "ck", model, meta=meta, params="lora", base={"hf_dir": "x"})
    assert cli_main(["explain", "--checkpoint", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "B=3 T=5" in out
    assert "r=2 on q v, 32 trainable parameters" in out          # q and v, 4 -> 4 each: 2 · r(4 + 4)
    assert cli_main(["explain", "--checkpoint", str(tmp_path / "ck"), "--seq-len", "7"]) == 0
    assert "B=3 T=7" in capsys.readouterr().out


def test_explain_llama_presets(capsys):
    assert cli_main(["explain", "--preset", "llama-char"]) == 0
    out = capsys.readouterr().out
    assert "Traceback" not in out and "H=4 H_kv=2" in out
    for name in ("a7_gate", "a7_up", "a8", "a9"):
        assert f"\n{name} " in out
    assert "\na7 " not in out
    assert "(1, 64, 256)" in out                   # qkv: 4·32 + 2·(32 + 32) columns
    assert "silu(a7_gate) ∘ a7_up" in out and "RMS1(x)" in out and "Llama layers: swiglu" in out
    assert cli_main(["explain", "--preset", "smollm2-135m", "--seq-len", "512"]) == 0
    assert "6 × 134,515,008 parameters × 512 tokens" in capsys.readouterr().out
    assert cli_main(["explain", "--preset", "char-small", "--arch", "llama"]) == 0
    assert "a7_gate" in capsys.readouterr().out


def test_the_fused_head_keeps_no_logits_and_says_so(capsys):
    """model.loss fuses the head with its loss: a12 and the softmax (120 B each on TINY, N·V·4)
    are not kept; Δ11 (N·d·4 = 96) and the head's dW (d·V·4 = 80; tied: no bias) are, until the
    backward. The FLOPs do not change. The table names what is not kept and what
    fused_head=False keeps; --unfused-head counts that."""
    config = GPTConfig(**TINY)
    fused, whole = explain_rows(config, B, T), explain_rows(config, B, T, fused_head=False)
    t_f, t_w = totals(config, fused, B, T), totals(config, whole, B, T)
    assert t_w["memory"] - t_f["memory"] == 2 * 120 - (96 + 80)
    assert (t_f["fwd"], t_f["bwd"]) == (t_w["fwd"], t_w["bwd"])
    rows = {r.name: r for r in fused}
    assert rows["a12"].memory == 0 and "not kept" in rows["a12"].forward and rows["loss"].memory == 96 + 80
    assert cli_main(["explain", "--preset", "smollm2-135m", "--seq-len", "2048"]) == 0
    out = capsys.readouterr().out
    logits = 2048 * 49152 * 4 / 2**20                             # 384 MiB of float32 logits
    assert f"not kept: a12 (the logits, {logits:.2f} MiB) and the loss's softmax / Δ12 ({logits:.2f} MiB)" in out
    assert "model.fused_head = False" in out and "keeps both whole" in out
    assert cli_main(["explain", "--preset", "smollm2-135m", "--seq-len", "2048", "--unfused-head"]) == 0
    out_whole = capsys.readouterr().out
    assert "not kept" not in out_whole and "kept whole (model.fused_head = False" in out_whole


def test_mixture_of_experts_rows():
    """LLAMA_TINY with 3 experts of width 5, 2 per token: the MLP's products run on the N·k = 12
    routed rows (gate, up, down 2·12·4·5 = 480 each, forward) and the router is one more product
    (2·6·4·3 = 144) where the dense model had gate, up, down of width 6 (288 each): the matrix
    products are the dense count − 3·288 + 3·480 + 144; the 6·N rule counts the active parameters."""
    dense = GPTConfig(**LLAMA_TINY)
    moe = GPTConfig(**{**LLAMA_TINY, "n_experts": 3, "n_experts_per_token": 2, "d_expert": 5})
    rows = {r.name: r for r in explain_rows(moe, B, T)}
    assert rows["r"].shape == (B, T, 3) and rows["a7_gate"].shape == (12, 5) and rows["a9"].shape == (B, T, 4)
    assert matmul_flops(moe, B, T) == matmul_flops(dense, B, T) + 3 * (-3 * 288 + 3 * 480 + 144)
    tot = totals(moe, explain_rows(moe, B, T), B, T)
    assert tot["six_n"] == 6 * (tot["n_params"] - 3 * 4 * 5) * B * T       # one expert of 3 unused per token


def test_blocks_of_other_kinds_get_rows_of_their_own():
    """A mixture whose middle block is dense, and a window on the outer blocks (a fresh user's find:
    the table gave every block the first one's rows): the outer blocks' rows (experts, window) and
    the middle one's (dense MLP, full attention), each counted for its own blocks; the products add
    up as two mixture blocks and one dense block do."""
    kw = {**LLAMA_TINY, "n_experts": 3, "n_experts_per_token": 2, "d_expert": 5, "n_blocks": 3}
    mixed = GPTConfig(**kw, moe_layers=(0, 2), sliding_window=2,
                      layer_types=("sliding_attention", "full_attention", "sliding_attention"))
    rows = explain_rows(mixed, B, T)
    kinds = {r.blocks for r in rows if r.blocks}
    assert kinds == {(0, 2), (1,)}
    by = {(r.blocks, r.name): r for r in rows}
    assert by[(0, 2), "a7_gate"].shape == (B * T * 2, 5) and by[(1,), "a7_gate"].shape == (B, T, mixed.d_mlp)
    assert ((0, 2), "r") in by and ((1,), "r") not in by
    assert "window 2" in by[(0, 2), "P"].forward and "window" not in by[(1,), "P"].forward
    tot = totals(mixed, rows, B, T)
    assert tot["fwd"] == sum(r.fwd_flops * (len(r.blocks) or 1) for r in rows)
    every = GPTConfig(**kw)
    dense = GPTConfig(**{**LLAMA_TINY, "n_blocks": 3})
    assert 3 * matmul_flops(mixed, B, T) == 2 * matmul_flops(every, B, T) + matmul_flops(dense, B, T)
    out = explain_table(mixed, B, T)
    assert "block i, for i in 0, 2 (a mixture of experts, window 2)" in out
    assert "block i, for i = 1 (a dense MLP, full attention)" in out
