"""The paper's table for a model: every activation a_i and error signal Δ_i of one training step,
with its shape, formula, the parameters it touches, forward and backward FLOPs and the memory the
forward keeps for it (:func:`explain_rows`), and the step's totals beside the 6·N·tokens rule
(:func:`totals`), laid out as text by :func:`explain_table`. Nothing is allocated; ``pedestrian
explain`` prints it.

FLOPs: every matrix product exactly, 2 per multiply-add (forward; the backward computes two
products per fully connected layer, Δ_in = Δ Wᵀ and dW = xᵀ Δ, and four in the attention).
Elementwise work is counted at the costs of :data:`ELEMENTWISE`: the arithmetic operations per
element of the reference layers (src/pedestrian/layers), each +, −, ×, ÷, exp, tanh, erf, sqrt,
cos, sin and each summed element of a reduction counted once; comparisons, gathers and copies
count 0. One block's rows are given once for the blocks alike (per kind of block where they differ:
a mixture of experts or a dense MLP, a window or full attention); totals count them once per
block. Memory: the array the forward keeps for the backward, in the model's dtype (a0: int64);
totals add the parameters, their gradients and the two AdamW moments. The step is
``model.loss``'s, whose output head is fused with its loss (:mod:`pedestrian.model.head`): the
logits ``a12`` and the loss's softmax / ``Δ12`` are not kept (0 bytes in their rows; the fused
forward keeps ``Δ11`` and the head's ``dW`` instead), which a note under the table says with their
sizes; ``fused_head=False`` (``pedestrian explain --unfused-head``) counts them kept whole.

Llama-style configs (docs/EQUATIONS.md, "The same chain, Llama-style") get their own rows: RMS
norms (``RMS1``, ``RMS2``, ``RMS_final``: weight only), the SwiGLU MLP's ``a7_gate``, ``a7_up``
and ``a8 = silu(a7_gate) ∘ a7_up`` in place of ``a7``, ``a8``, and grouped-query attention's
narrower fused ``qkv`` (``n_heads·d_qk + n_kv_heads·(d_qk + d_head)`` columns); their elementwise
costs (:data:`LLAMA_ELEMENTWISE`) are printed only for a config that uses them.

Plugged layers (:mod:`pedestrian.model.slots`; a checkpoint records them): a plugged slot's rows
name its file and parameters and count no FLOPs (its code is the user's own), a plugged MLP has
no ``a7``, ``a8`` rows and its products leave the matrix-product total; the parameter count is
the model's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..config import GPTConfig
from ..model.layout import count_params


#: arithmetic operations per element of the reference layers (see the module docstring);
#: ``"fwd"`` per output element, ``"bwd"`` per element of the incoming signal
ELEMENTWISE = {
    "layernorm": {"fwd": 7, "bwd": 10, "bias": 1, "per_row_fwd": 3},   # +1 each way with a bias
    "bias": {"fwd": 1, "bwd": 1},                 # y + b; db = Σ_tokens Δ
    "add": {"fwd": 1, "bwd": 1},                  # a5 = x + a4 (backward: the skip's sum)
    "position": {"fwd": 1, "bwd": 1},             # + W_pos[t]; dW_pos += Δ1
    "embedding": {"fwd": 0, "bwd": 1},            # gather; dW_tok scatter-add
    "rope": {"fwd": 3, "bwd": 3},                 # per rotated q/k element: 2 ×, 1 ±
    "scores": {"fwd": 6, "bwd": 5},               # ÷√d_qk, softmax (max, −, exp, Σ, ÷); bwd: 4 + ÷√d_qk
    "relu": {"fwd": 1, "bwd": 1},
    "gelu": {"fwd": 5, "bwd": 11},
    "gelu_tanh": {"fwd": 9, "bwd": 19},
    "cross_entropy": {"fwd": 9, "bwd": 3},         # per logit
    # the Llama layers (printed only for a config that uses them)
    "silu": {"fwd": 5, "bwd": 8},                 # σ pair (exp, +, ÷, ×), x σ; bwd: pair, x(1−σ), 1+, σ·, Δ·
    "swiglu": {"fwd": 6, "bwd": 15},              # silu(g) ∘ u; bwd: Δ8∘silu(g) (6), Δ8∘u∘silu'(g) (9)
    "rmsnorm": {"fwd": 4, "bwd": 8, "per_row_fwd": 4},   # x², Σ, x·(1/r), ·w; per row ÷d, +ε, √, 1/
    # Gemma's (printed only for a config that uses them)
    "geglu": {"fwd": 10, "bwd": 29},              # gelu_tanh(g) ∘ u; bwd: Δ8∘gelu(g) (10), Δ8∘u∘gelu'(g) (19)
    "scale": {"fwd": 1, "bwd": 1},                # a1 = s · W_tok[a0]; s · Δ1
    "softcap": {"fwd": 3, "bwd": 4},              # ÷c, tanh, ×c; bwd: tanh again, t², 1 −, Δ·
}
#: the keys above that only a Llama-style config uses
LLAMA_ELEMENTWISE = ("silu", "swiglu", "rmsnorm")


@dataclass
class Row:
    """One line of the table: activation ``name`` (and its error signal)."""

    name: str
    shape: tuple
    forward: str
    params: str
    fwd_flops: int
    backward: str
    bwd_flops: int
    memory: int                                   # bytes the forward keeps
    blocks: tuple = ()                            # the blocks whose row this is (() : not a block's)

    @property
    def per_block(self) -> bool:
        """Whether this is a block's row (counted once per block of :attr:`blocks`)."""
        return bool(self.blocks)


def explain_rows(config: GPTConfig, batch_size: int, seq_len: int, itemsize: int = 4,
                 fused_head: bool = True) -> list[Row]:
    """The table's rows for one training step of ``batch_size`` sequences of ``seq_len`` tokens.

    ``fused_head``: the step is ``model.loss`` with the output head fused with its loss (the
    default, :mod:`pedestrian.model.head`): the logits ``a12`` and ``Δ12`` are made a chunk of rows
    at a time and not kept (their rows keep 0 bytes); the fused forward keeps ``Δ11`` and the
    head's ``dW`` (and ``db``) for the backward. ``False``: ``model.fused_head = False`` (or
    ``model.forward``, the demos): ``a12`` and the softmax of the loss kept whole.

    Raises:
        ValueError: ``batch_size < 1`` or ``seq_len`` outside ``[1, context_length]``.
    """
    c = config
    B, T = batch_size, seq_len
    if B < 1:
        raise ValueError(f"--batch-size must be a positive integer, got {B}")
    if not 1 <= T <= c.context_length:
        raise ValueError(f"--seq-len must be in [1, context_length={c.context_length}], got {T}")
    d, H, dqk, dh, V, dm = c.d_model, c.n_heads, c.d_qk, c.d_head, c.vocab_size, c.d_mlp
    Hkv = c.n_kv_heads                            # grouped-query attention: k, v have Hkv heads
    N = B * T
    w_qkv = H * dqk + Hkv * (dqk + dh)
    bias = 1 if c.bias else 0
    E = ELEMENTWISE
    rms = c.norm == "rmsnorm"                     # no mean, no bias
    ln = E[c.norm]
    ln_bias = 0 if rms else bias * ln["bias"]
    ln_fwd = N * d * (ln["fwd"] + ln_bias) + N * ln["per_row_fwd"]
    ln_bwd = N * d * (ln["bwd"] + ln_bias)
    ln_params = "γ, β" if c.bias and not rms else ("γ (scale 1 + γ)" if c.norm_offset == 1.0 else "γ")
    LN = "RMS" if rms else "LN"

    def fc(f_in, f_out):                          # forward, backward FLOPs of y = x W + b
        fwd = 2 * N * f_in * f_out + bias * N * f_out
        bwd = 4 * N * f_in * f_out + bias * N * f_out   # Δ_in = Δ Wᵀ and dW = xᵀ Δ (every layer
        return fwd, bwd                                 # needs Δ_in: Δ1 feeds the embedding)

    rows = [Row("a0", (B, T), "token ids", "-", 0, "-", 0, N * 8)]
    learned = c.learned_positions
    s = c.embedding_scale is not None                                       # Gemma: a1 = √d · W_tok[a0]
    rows.append(Row("a1", (B, T, d), ("s·" if s else "") + ("W_tok[a0] + W_pos[t]" if learned else "W_tok[a0]"),
                    "tok_emb, pos_emb" if learned else "tok_emb",
                    N * d * (E["embedding"]["fwd"] + learned * E["position"]["fwd"] + s * E["scale"]["fwd"]),
                    ("dW_tok += ohe(a0)ᵀ (s Δ1)" if s else "dW_tok += ohe(a0)ᵀ Δ1")
                    + ("; dW_pos += Σ_b Δ1" if learned else ""),
                    N * d * (E["embedding"]["bwd"] + learned * E["position"]["bwd"] + s * E["scale"]["bwd"]),
                    N * d * itemsize))
    dgb = "dγ" if rms else "dγ, dβ"

    def block_rows(moe: bool, window, blocks: tuple) -> None:       # the rows of blocks of one kind
        pre, post = c.norm_placement != "post", c.norm_placement != "pre"    # where the block's norms sit
        if pre:
            rows.append(Row("a2", (B, T, d), f"{LN}1(x)", ln_params, ln_fwd, f"Δx += {LN}1ᵀ(Δ2); {dgb}",
                            ln_bwd, N * d * itemsize, blocks))
        else:
            rows.append(Row("a2", (B, T, d), "x (norm_placement='post': no norm here)", "-", 0, "Δx += Δ2", 0, 0, blocks))
        qkv_bias = 1 if c.qkv_bias else 0
        fwd = 2 * N * d * w_qkv + qkv_bias * N * w_qkv
        bwd = 4 * N * d * w_qkv + qkv_bias * N * w_qkv
        rope = c.position_encoding == "rope"          # then the rotated copy is kept, not this one
        qkv_formula = "a2 [Wq|Wk|Wv]" + (" + [bq|bk|bv]" if qkv_bias or not rms else "")
        if Hkv != H:
            qkv_formula += f" (k, v: {Hkv} heads)"
        rows.append(Row("qkv", (B, T, w_qkv), qkv_formula, "attn.q, attn.k, attn.v",
                        fwd, "Δ2 = Δqkv Wᵀ; dW = a2ᵀ Δqkv", bwd, 0 if rope else N * w_qkv * itemsize, blocks))
        if c.qk_norm is not None:                     # the prelude's q/k RMS norms (model/prelude.py)
            n_qk = N * (H + Hkv) * dqk
            per_row = N * (H + Hkv) if c.qk_norm == "head" else 2 * N
            rn = E["rmsnorm"]
            rows.append(Row("qk_norm", (B, T, w_qkv), "q, k ← RMS(q; w_q), RMS(k; w_k)" + (" per head" if c.qk_norm == "head"
                            else " over the projection"), "attn.q_norm, attn.k_norm", n_qk * rn["fwd"] + per_row * rn["per_row_fwd"],
                            "Δq, Δk ← RMSᵀ(Δ); dw_q, dw_k", n_qk * rn["bwd"], 0 if rope else N * w_qkv * itemsize, blocks))
        if rope:
            r = c.rope_dims
            per = N * (H + Hkv) * r                   # rotated q and k elements
            some = "" if c.rope_layers is None else f"; blocks {sum(c.rope_layers)} of {c.n_blocks} (rope_layers)"
            rows.append(Row("rope", (B, T, w_qkv), f"q, k ← R(tθ) (first {r} of {dqk} per head{some})", "-",
                            per * E["rope"]["fwd"], "Δq, Δk ← R(−tθ) Δ", per * E["rope"]["bwd"],
                            N * w_qkv * itemsize, blocks))
        scores = B * H * T * T
        mask = (f" + causal mask, window {window}" if window else " + causal mask") if c.causal else ""
        rows.append(Row("P", (B, H, T, T), f"softmax(q kᵀ/√d_qk{mask})", "-",
                        2 * scores * dqk + scores * E["scores"]["fwd"],
                        "Δcausal = P∘(dP − rowsum(dP∘P))", scores * E["scores"]["bwd"],
                        scores * itemsize, blocks))
        g = H // Hkv
        rows.append(Row("a3", (B, T, H * dh), "P v, heads side by side" if g == 1 else
                        f"P_h v_(h//{g}), heads side by side", "-", 2 * scores * dh,
                        "dv = PᵀΔ3, dP = Δ3 vᵀ; dq = Δraw k, dk = Δrawᵀ q" if g == 1 else
                        f"dq = Δraw k; dK_j, dV_j: Σ over {g} heads",
                        2 * scores * dh * 2 + 2 * scores * dqk * 2, N * H * dh * itemsize, blocks))
        fwd, bwd = fc(H * dh, d)
        b_ = " + b" if bias or not rms else ""        # GPT-2's rows name b whatever the config
        rows.append(Row("a4", (B, T, d), "a3 W_proj" + b_, "attn_proj", fwd, "Δ3 = Δ4 Wᵀ; dW = a3ᵀ Δ4", bwd,
                        N * d * itemsize, blocks))
        if post:                                      # the norm after the attention (model/placement.py)
            rows.append(Row("a4_post", (B, T, d), f"{LN}1post(a4)", ln_params, ln_fwd, f"Δ4 = {LN}1postᵀ(Δ4_post); {dgb}",
                            ln_bwd, N * d * itemsize, blocks))
        rows.append(Row("a5", (B, T, d), "x + a4_post" if post else "x + a4", "-", N * d * E["add"]["fwd"],
                        "Δx += Δ5; Δ4_post = Δ5" if post else "Δx += Δ5; Δ4 = Δ5",
                        N * d * E["add"]["bwd"], N * d * itemsize, blocks))
        if pre:
            rows.append(Row("a6", (B, T, d), f"{LN}2(a5)", ln_params, ln_fwd, f"Δ5 += {LN}2ᵀ(Δ6); {dgb}", ln_bwd,
                            N * d * itemsize, blocks))
        else:
            rows.append(Row("a6", (B, T, d), "a5 (norm_placement='post': no norm here)", "-", 0, "Δ5 += Δ6", 0, 0, blocks))
        k, mm, rows_of = 1, dm, (B, T)                # a mixture of experts: each token's k experts' rows
        if moe:
            k, mm, Ex = c.n_experts_per_token, c.d_expert, c.n_experts
            rows_of = (N * k,)
            fwd, bwd = fc(d, Ex)
            rows.append(Row("r", (B, T, Ex), f"a6 W_r; top-{k} of softmax(r) → g (N, {k})", "router",
                            fwd + N * Ex * E["cross_entropy"]["fwd"], "Δr = π∘(∂π − ⟨π, ∂π⟩); Δ6 = Δr W_rᵀ",
                            bwd + N * Ex * E["cross_entropy"]["bwd"], N * (Ex + 2 * k) * itemsize, blocks))
        fwd, bwd = (k * f for f in fc(d, mm))
        if c.mlp == "swiglu":                         # two FC layers of a6, then the gated product
            x6 = "a6 (its rows per expert) " if moe else "a6 "
            rows.append(Row("a7_gate", (*rows_of, mm), x6 + "W_gate" + b_, "mlp_gate", fwd,
                            "Δ6 = Δ7_gate W_gateᵀ; dW = a6ᵀ Δ7_gate", bwd, N * k * mm * itemsize, blocks))
            rows.append(Row("a7_up", (*rows_of, mm), x6 + "W_up" + b_, "mlp_expand", fwd,
                            "Δ6 += Δ7_up W_upᵀ; dW = a6ᵀ Δ7_up", bwd, N * k * mm * itemsize, blocks))
            gate = "gelu" if c.activation == "gelu_tanh" else "silu"            # GeGLU (Gemma) or SwiGLU
            sw = E["geglu" if gate == "gelu" else "swiglu"]
            rows.append(Row("a8", (*rows_of, mm), f"{gate}(a7_gate) ∘ a7_up", "-", N * k * mm * sw["fwd"],
                            f"Δ7_up = Δ8∘{gate}(a7_gate); Δ7_gate = Δ8∘a7_up∘{gate}'", N * k * mm * sw["bwd"],
                            N * k * mm * itemsize, blocks))
        else:
            rows.append(Row("a7", (B, T, dm), "a6 W_expand + b", "mlp_expand", fwd, "Δ6 = Δ7 Wᵀ; dW = a6ᵀ Δ7", bwd,
                            N * dm * itemsize, blocks))
            g = E[c.activation]
            rows.append(Row("a8", (B, T, dm), f"g(a7), g = {c.activation}", "-", N * dm * g["fwd"],
                            "Δ7 = g'(a7) ∘ Δ8", N * dm * g["bwd"], N * dm * itemsize, blocks))
        fwd, bwd = (k * f for f in fc(mm, d))
        if moe:                               # the experts' outputs weighted and added per token
            rows.append(Row("a9", (B, T, d), "Σ_K g_e (a8_e W_contract,e)", "mlp_contract", fwd + 2 * N * k * d,
                            "Δ8_e = g_e Δ9 Wᵀ; ∂g_e = ⟨Δ9, ·⟩; dW = a8ᵀ (g Δ9)", bwd + 3 * N * k * d,
                            N * k * d * itemsize, blocks))
        else:
            rows.append(Row("a9", (B, T, d), "a8 W_contract" + b_,
                            "mlp_contract", fwd, "Δ8 = Δ9 Wᵀ; dW = a8ᵀ Δ9", bwd, N * d * itemsize, blocks))
        if post:                                      # the norm after the MLP
            rows.append(Row("a9_post", (B, T, d), f"{LN}2post(a9)", ln_params, ln_fwd, f"Δ9 = {LN}2postᵀ(Δ9_post); {dgb}",
                            ln_bwd, N * d * itemsize, blocks))
        rows.append(Row("a10", (B, T, d), "a5 + a9_post" if post else "a5 + a9", "-", N * d * E["add"]["fwd"],
                        "Δ5 += Δ10; Δ9_post = Δ10" if post else "Δ5 += Δ10; Δ9 = Δ10",
                        N * d * E["add"]["bwd"], N * d * itemsize, blocks))

    kinds: dict = {}                              # (mixture of experts, window) -> its blocks
    for i in range(c.n_blocks):
        kinds.setdefault((c.is_moe(i), c.window(i)), []).append(i)
    for (moe, window), blocks in kinds.items():
        block_rows(moe, window, tuple(blocks))
    rows.append(Row("a11", (B, T, d), f"{LN}_final(a10)", ln_params, ln_fwd, f"Δ10 = {LN}ᵀ(Δ11); {dgb}", ln_bwd,
                    N * d * itemsize))
    tied = c.tie_weights
    lb = 1 if c.logits_bias else 0
    fused = " (fused: not kept)" if fused_head else ""
    cap = c.logit_softcap is not None                                        # Gemma 2: c tanh(z / c)
    z = "a11 W_tokᵀ (tied)" if tied else "a11 W_logits" + (" + b" if lb else "")
    dz = "Δz = Δ12∘(1 − tanh²); " if cap else ""
    capped = "c·tanh(a11 W_tokᵀ/c)" if tied else "c·tanh((a11 W" + (" + b" if lb else "") + ")/c)"
    rows.append(Row("a12", (B, T, V), (capped if cap else z) + fused,
                    "tok_emb" if tied else "logits", 2 * N * d * V + lb * N * V + cap * N * V * E["softcap"]["fwd"],
                    dz + ("Δ11 = Δz W; dW_tok += Δzᵀ a11" if cap else "Δ11 = Δ12 W; dW_tok += Δ12ᵀ a11") if tied
                    else dz + ("Δ11 = Δz Wᵀ; dW = a11ᵀ Δz" if cap else "Δ11 = Δ12 Wᵀ; dW = a11ᵀ Δ12"),
                    4 * N * d * V + lb * N * V + cap * N * V * E["softcap"]["bwd"], 0 if fused_head else N * V * itemsize))
    ce = E["cross_entropy"]
    kept = (N * d + d * V + lb * V) * itemsize if fused_head else N * V * itemsize   # Δ11, dW, db / the softmax
    rows.append(Row("loss", (), "mean −log softmax(a12)[y]", "-", N * V * ce["fwd"],
                    "Δ12 = (softmax(a12) − ohe(y)) / N" + ("; Δ11, dW made here" if fused_head else ""),
                    N * V * ce["bwd"], kept))
    return rows


def head_note(config: GPTConfig, batch_size: int, seq_len: int, itemsize: int = 4) -> str:
    """The lines under the table on the fused head: what ``model.loss`` no longer keeps, what
    it keeps instead, its chunk, and what ``model.fused_head = False`` (or ``keep_activations``
    demos, ``model.forward``) would keep."""
    from ..layers.head_loss import HEAD_CHUNK_BYTES, head_chunk_rows

    c, N = config, batch_size * seq_len
    V, d = c.vocab_size, c.d_model
    logits = N * V * itemsize
    rows = min(N, head_chunk_rows(V, itemsize))
    instead = (N * d + d * V + (V if c.logits_bias else 0)) * itemsize
    return (f"not kept: a12 (the logits, {_mib(logits)}) and the loss's softmax / Δ12 ({_mib(logits)}): model.loss "
            f"fuses the head with its loss,\n    {rows} rows at a time (one chunk of {_mib(rows * V * itemsize)}, "
            f"budget {HEAD_CHUNK_BYTES >> 20} MiB), and keeps Δ11 and the head's dW instead ({_mib(instead)}); "
            f"model.fused_head = False\n    (or model.forward, the demos' keep_activations) keeps both whole: "
            f"{_mib(2 * logits - instead)} more")


def totals(config: GPTConfig, rows: list[Row], batch_size: int, seq_len: int, itemsize: int = 4,
           slots=None) -> dict:
    """Sums over one step (block rows counted ``n_blocks`` times), the matrix-product part alone,
    and the 6·N·tokens estimate (N = every parameter; of ``slots.specs()`` for a model with
    plugged layers, a :class:`~pedestrian.model.slots.Slots`)."""
    mult = [len(r.blocks) or 1 for r in rows]
    fwd = sum(m * r.fwd_flops for m, r in zip(mult, rows))
    bwd = sum(m * r.bwd_flops for m, r in zip(mult, rows))
    memory = sum(m * r.memory for m, r in zip(mult, rows))
    n_params = count_params(config) if slots is None else sum(s.size for s in slots.specs())
    tokens = batch_size * seq_len
    matmul = matmul_flops(config, batch_size, seq_len, mlp=slots is None or "mlp" not in slots.plugged)
    return dict(fwd=fwd, bwd=bwd, step=fwd + bwd, memory=memory, n_params=n_params, tokens=tokens,
                six_n=6 * active_params(config, n_params) * tokens, matmul_step=matmul,
                params_memory=4 * n_params * itemsize)


def active_params(config: GPTConfig, n_params: int) -> int:
    """What the 6·N rule counts: every parameter, less the experts a token is not routed to."""
    from ..model.layout import count_active_params, count_params

    return n_params - (count_params(config) - count_active_params(config)) if config.n_experts else n_params


def matmul_flops(config: GPTConfig, batch_size: int, seq_len: int, mlp: bool = True) -> int:
    """Matrix-product FLOPs of one step (forward + backward): the part the 6·N·tokens rule models.
    The first layer (qkv of block 0) still needs Δ_in: the embedding gradient depends on it.
    ``mlp=False``: without the MLP's (a plugged MLP's are not counted)."""
    c = config
    N = batch_size * seq_len
    H = c.n_heads
    n_mlp = (3 if c.mlp == "swiglu" else 2) if mlp else 0     # SwiGLU: gate, up, down
    moe = (c.n_experts_per_token * n_mlp * c.d_expert + c.n_experts) if c.n_experts else 0   # k experts + router
    attn = 2 * N * (c.d_model * (H * c.d_qk + c.n_kv_heads * (c.d_qk + c.d_head)) + H * c.d_head * c.d_model)
    attention = 2 * batch_size * H * seq_len * seq_len * (c.d_qk + c.d_head)
    mlps = sum(2 * N * c.d_model * (moe if c.is_moe(i) else n_mlp * c.d_mlp) for i in range(c.n_blocks))
    forward = c.n_blocks * (attn + attention) + mlps + 2 * N * c.d_model * c.vocab_size
    return 3 * forward


def _human(n: float, unit: str = "") -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= factor:
            return f"{n / factor:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**14 else f"{n} B"


def explain_table(config: GPTConfig, batch_size: int, seq_len: int, dtype: str = "float32",
                  layers: list | None = None, fused_head: bool = True) -> str:
    """The table ``pedestrian explain`` prints: a header with the config, one line per row of
    :func:`explain_rows` (one block's rows once), and the :func:`totals` (FLOPs beside the
    6·N·tokens rule, the memory kept, the elementwise costs). ``dtype``: ``"float32"`` or
    ``"float64"``, the memory column's. ``layers``: a checkpoint's records of plugged layers
    (``state["layers"]``: slot, path, source; their ``init`` runs to learn their shapes).
    ``fused_head``: as :func:`explain_rows` (and a note on what is not kept, :func:`head_note`).

    Raises:
        ValueError: a recorded layer that no longer runs (:func:`pedestrian.model.slots.layer_from_source`).
    """
    B, T = batch_size, seq_len
    itemsize = 8 if dtype == "float64" else 4
    lines = []
    say = lines.append
    slots = plugged_slots(config, layers)
    rows = plugged_rows(explain_rows(config, B, T, itemsize, fused_head), slots)
    tot = totals(config, rows, B, T, itemsize, slots)
    c = config
    say(f"config: {c}")
    for slot, layer in (slots.plugged if slots else {}).items():
        say(f"plugged: {slot} slot <- {layer.path} (parameters per instance: "
            f"{', '.join(f'{n} {tuple(sh)}' for n, sh in layer.shapes.items()) or 'none'}; FLOPs not counted)")
    kv = f" H_kv={c.n_kv_heads}" if c.n_kv_heads != c.n_heads else ""
    say(f"B={B} T={T} d={c.d_model} H={c.n_heads}{kv} d_qk={c.d_qk} d_h={c.d_head} d_mlp={c.d_mlp} V={c.vocab_size} "
        f"n_blocks={c.n_blocks}, {dtype}, positions: {c.position_encoding}")
    w = max(5, 1 + max(len(r.name) for r in rows))    # a7_gate: wider than GPT-2's names
    header = (f"{'a_i':<{w}}{'shape':<18}{'forward':<40}{'parameters':<24}{'fwd FLOPs':>12}  "
              f"{'Δ_i (backward)':<48}{'bwd FLOPs':>12}{'memory':>12}")
    say("\n" + header + "\n" + "-" * len(header))
    blocks = ()
    mixed_mlp = len({c.is_moe(i) for i in range(c.n_blocks)}) > 1       # what tells the kinds of blocks apart
    mixed_window = len({c.window(i) for i in range(c.n_blocks)}) > 1
    for r in rows:
        if r.blocks and r.blocks != blocks:                 # the rows of blocks of another kind
            which = (f"for i = 0 … {c.n_blocks - 1}" if len(r.blocks) == c.n_blocks else f"for i = {r.blocks[0]}"
                     if len(r.blocks) == 1 else "for i in " + ", ".join(map(str, r.blocks)))
            i = r.blocks[0]
            kind = ([("a mixture of experts" if c.is_moe(i) else "a dense MLP")] if mixed_mlp else []) + (
                [f"window {c.window(i)}" if c.window(i) else "full attention"] if mixed_window else [])
            say(f"  block i, {which}{' (' + ', '.join(kind) + ')' if kind else ''} (x = a1, then the previous "
                "block's a10):")
        blocks = r.blocks
        shape = "()" if not r.shape else "(" + ", ".join(str(s) for s in r.shape) + ")"
        say(f"{r.name:<{w}}{shape + ' ':<18}{r.forward + ' ':<40}{r.params + ' ':<24}{_human(r.fwd_flops):>12}  "
            f"{r.backward + ' ':<48}{_human(r.bwd_flops):>12}{_mib(r.memory):>12}")
    say("-" * len(header))
    say(f"one step: forward {_human(tot['fwd'], 'FLOP')}, backward {_human(tot['bwd'], 'FLOP')}, "
        f"total {tot['step']:,} FLOPs ({_human(tot['step'], 'FLOP')}); block rows × their blocks")
    say(f"  matrix products alone: {tot['matmul_step']:,} ({_human(tot['matmul_step'], 'FLOP')}, "
        f"{100 * tot['matmul_step'] / tot['step']:.1f}% of the total)")
    say(f"  6·N·tokens rule: 6 × {active_params(c, tot['n_params']):,} parameters"
        f"{' (active per token)' if c.n_experts else ''} × {tot['tokens']:,} tokens = "
        f"{tot['six_n']:,} ({_human(tot['six_n'], 'FLOP')}); exact / rule = {tot['step'] / tot['six_n']:.3f}")
    say("    (the rule is 2 FLOPs per parameter per token forward and 4 backward: it leaves out the attention's\n"
        "    q kᵀ and P v and the elementwise work, and counts the embedding tables as if they were products)")
    say(f"memory kept by the forward: {_mib(tot['memory'])}; parameters, gradients and the two AdamW "
        f"moments: {_mib(tot['params_memory'])} ({tot['n_params']:,} parameters, {itemsize} bytes each)")
    if fused_head:
        say("  " + head_note(config, B, T, itemsize))
    else:
        say("  a12 and the loss's softmax are kept whole (model.fused_head = False; model.loss fuses them by default)")
    say("elementwise costs (operations per element, forward / backward): "
        + ", ".join(f"{k} {v['fwd']}/{v['bwd']}" for k, v in ELEMENTWISE.items()
                    if k != "layernorm" and k not in LLAMA_ELEMENTWISE)
        + f", layernorm {ELEMENTWISE['layernorm']['fwd']}/{ELEMENTWISE['layernorm']['bwd']} (+1/+1 with β, "
        f"+{ELEMENTWISE['layernorm']['per_row_fwd']} per row forward)")
    used = [k for k in LLAMA_ELEMENTWISE if k in (c.norm, c.mlp) or (k == c.activation and c.mlp != "swiglu")]
    if used:
        say("  Llama layers: " + ", ".join(f"{k} {ELEMENTWISE[k]['fwd']}/{ELEMENTWISE[k]['bwd']}" for k in used)
            + (f" (rmsnorm: +{ELEMENTWISE['rmsnorm']['per_row_fwd']} per row forward)" if "rmsnorm" in used else ""))
    if c.dropout > 0:
        say(f"dropout {c.dropout}: its masks (three per block and one after the embedding) are not in the table")
    return "\n".join(lines)


def plugged_slots(config: GPTConfig, records: list | None):
    """The :class:`~pedestrian.model.slots.Slots` of a checkpoint's plugged-layer records (``None``: none)."""
    if not records:
        return None
    from ..model.slots import Slots, layer_from_source

    return Slots(config, None, "float64", {r["slot"]: layer_from_source(r["source"], r["path"]) for r in records})


def plugged_rows(rows: list[Row], slots) -> list[Row]:
    """``rows`` with the plugged slots' rows in place of the built-in ones (module docstring)."""
    if slots is None:
        return rows
    out, P = [], slots.plugged

    def plugged(r, slot, what, delta):                    # e.g. dyt(a5) [plugged], Δ5 += dytᵀ(Δ6)
        layer = P[slot]
        name = layer.path.rsplit("/", 1)[-1].removesuffix(".py")
        return replace(r, forward=f"{name}({what}) [plugged]", params=", ".join(layer.shapes) or "-", fwd_flops=0,
                       backward=delta.format(name), bwd_flops=0)

    norm = {"a2": ("x", "Δx += {}ᵀ(Δ2)"), "a6": ("a5", "Δ5 += {}ᵀ(Δ6)"), "a11": ("a10", "Δ10 = {}ᵀ(Δ11)")}
    for r in rows:
        if "norm" in P and r.name in norm:
            r = plugged(r, "norm", *norm[r.name])
        elif "activation" in P and r.name == "a8":
            r = plugged(r, "activation", "a7", "Δ7 = {}ᵀ(Δ8)")
        elif "mlp" in P and r.name in ("a7", "a7_gate", "a7_up", "a8"):
            continue
        elif "mlp" in P and r.name == "a9":
            r = plugged(r, "mlp", "a6", "Δ6 = {}ᵀ(Δ9)")
        out.append(r)
    return out


def params_table(config: GPTConfig, per_block: bool = False, lora: tuple | None = None) -> str:
    """The parameter table ``pedestrian params`` prints: one row per parameter (name, shape,
    count; block 0 only unless ``per_block``), then one block's count, the count per kind
    (:func:`pedestrian.model.layout.param_specs`) and the total; with ``lora = (rank, targets)``, the
    adapters :func:`pedestrian.model.layout.lora_specs` adds and their share of the base. Nothing is
    allocated.

    Raises:
        ValueError: LoRA targets or rank :func:`pedestrian.model.layout.lora_specs` refuses.
    """
    from ..model.layout import lora_specs, param_specs

    specs = param_specs(config)
    adapters = None if lora is None else lora_specs(config, lora[1], lora[0])   # refuse before any line
    rows = [s for s in specs if per_block or not s.name.startswith("blocks.") or s.name.startswith("blocks.0.")]
    width = max(len(s.name) for s in rows) + 2
    last_block0 = [s.name for s in rows if s.name.startswith("blocks.0.")][-1]
    lines = [f"config: {config}", f"{'parameter':<{width}}{'shape':>18}{'count':>16}"]
    for s in rows:
        lines.append(f"{s.name:<{width}}{str(s.shape):>18}{s.size:>16,}")
        if not per_block and s.name == last_block0 and config.n_blocks > 1:
            lines.append(f"{'... blocks.1 - blocks.' + str(config.n_blocks - 1) + ' identical':<{width}}")
    by_kind: dict[str, int] = {}
    for s in specs:
        by_kind[s.kind] = by_kind.get(s.kind, 0) + s.size
    block = sum(s.size for s in specs if s.name.startswith("blocks.0."))
    lines += ["", f"{'one transformer block':<32}{block:>16,}"]
    lines += [f"{'kind: ' + kind:<32}{n:>16,}" for kind, n in by_kind.items()]
    total = sum(s.size for s in specs)
    lines.append(f"{'total':<32}{total:>16,}")
    if config.n_experts:                                # what one token's forward uses
        from ..model.layout import count_active_params

        lines.append(f"{'active per token':<32}{count_active_params(config):>16,}"
                     f"   ({config.n_experts_per_token} of {config.n_experts} experts)")
    if adapters is not None:
        n = sum(s.size for s in adapters)
        lines.append(f"{'LoRA r=' + str(lora[0]) + ' on ' + ','.join(lora[1]):<32}{n:>16,}"
                     f"   ({100 * n / total:.2f}% of the base; {len(adapters) // 2} adapted layers)")
    return "\n".join(lines)


def lora_run_note(config: GPTConfig, rank: int, targets) -> str:
    """One line for :func:`explain_table`'s reader on a ``pedestrian finetune`` run: its
    adapters (``rank``, ``targets``, the trainable count of
    :func:`pedestrian.model.layout.lora_specs`), and that the table counts a step training every
    parameter while the run keeps gradients and moments for the adapters only.

    Raises:
        ValueError: targets or rank :func:`pedestrian.model.layout.lora_specs` refuses.
    """
    from ..model.layout import lora_specs

    n = sum(math.prod(s.shape) for s in lora_specs(config, targets, rank))
    return (f"A LoRA run (pedestrian finetune: r={rank} on {' '.join(targets)}, {n:,} trainable parameters). "
            "The table counts a step that trains every parameter; this run keeps gradients and AdamW "
            "moments for the adapters only, and computes no gradient of the frozen base's weights.")
