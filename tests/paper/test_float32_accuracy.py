"""Float32: the fast path at least as accurate as PyTorch's own float32 (issue 22, part 3).

For every case of the gradient grid (``test_model.CASES``) and, where the layer norm has the
paper's ``eps = 0``, twice more with the token embedding shifted by :data:`SHIFTS` (every layer
norm input then has ``|μ| ≫ σ``: the ill-conditioned case, where ``x − μ`` cancels and float32
loses ``ε·|μ|/σ``), the same float32 weights go through

- pedestrian's fast path in float32,
- the independent PyTorch model (``tests/oracles/torch_reference.py``, autograd) in float32,
- the same PyTorch model in float64: the exact answer to compare both with.

Per tensor (the logits and every parameter gradient) the fast path's largest error must be at
most twice PyTorch's, plus :data:`FLOOR_ROUNDINGS` roundings of the tensor's scale (the largest
logit, or the largest gradient entry of the model): where both are within an ulp or two of
the exact value, the ratio of two rounding errors is noise (measured: up to 3.7 on errors of
0.2 ε·scale), not accuracy. A fast path that lost accuracy (as the one that took the row mean
as a product with a rounded ``1/d`` and no correction of the mean: up to 3.2x PyTorch's error at
``d = 12``) fails: 5 of these cases failed on it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradcheck import build_model, token_batch
from test_model import CASES, LORA_ALPHA, lora_spec
from torch_reference import default_cfg, random_params, reference_loss_and_grads

EPS32 = float(np.finfo(np.float32).eps)
FLOOR_ROUNDINGS = 4
#: added to every token embedding in the ill-conditioned cases (weights are O(1), so every layer
#: norm's first input has |μ|/σ of about 10^2 and 10^3)
SHIFTS = (100.0, 1000.0)

GRID = [pytest.param(cid, shift, id=f"{cid}-shift{int(shift)}")
        for cid, (_, _, over, _, _) in CASES.items()
        for shift in ((0.0, *SHIFTS) if over.get("ln_eps", 1e-5) == 0.0 else (0.0,))]


@pytest.mark.parametrize("case_id,shift", GRID)
def test_fast_float32_within_twice_pytorch_float32(case_id, shift):
    B, T, over, n_ignored, lora = CASES[case_id]
    cfg = default_cfg(**over)
    spec = None if lora is None else lora_spec(cfg, lora[0])
    params = random_params(cfg, seed=3, lora=spec)
    params["tok_emb.weight"] = params["tok_emb.weight"] + shift
    p32 = {k: v.astype(np.float32) for k, v in params.items()}
    p64 = {k: v.astype(np.float64) for k, v in p32.items()}           # the same numbers, exactly
    tokens, targets = token_batch(cfg, B, T, n_ignored=n_ignored)
    kw = dict(lora_alpha=LORA_ALPHA) if spec else {}
    _, logits64, grads64, _ = reference_loss_and_grads(p64, cfg, tokens, targets, dtype=torch.float64, **kw)
    _, logits_t, grads_t, _ = reference_loss_and_grads(p32, cfg, tokens, targets, dtype=torch.float32, **kw)
    model = build_model(cfg, p32, dtype="float32", lora=spec, lora_alpha=LORA_ALPHA,
                        freeze_base=bool(lora and lora[1]), kernels="fast")
    model.loss(tokens, targets)
    logits_f = np.asarray(model.activations()["a12"], dtype=np.float64)
    grads_f = {k: np.asarray(v, dtype=np.float64) for k, v in model.backward().items()}

    grad_scale = max(float(np.max(np.abs(g))) for g in grads64.values())
    checks = [("logits", logits64, logits_t, logits_f, float(np.max(np.abs(logits64))))]
    checks += [(f"∂L/∂{k}", grads64[k], grads_t[k], grads_f[k], grad_scale) for k in grads_f]
    for name, exact, ours_t, ours_f, scale in checks:
        err_torch = float(np.max(np.abs(np.asarray(ours_t, np.float64) - exact), initial=0.0))
        err_fast = float(np.max(np.abs(ours_f - exact), initial=0.0))
        bound = 2 * err_torch + FLOOR_ROUNDINGS * EPS32 * scale
        assert err_fast <= bound, (f"{name}: fast float32 errs by {err_fast:.3e}, PyTorch float32 by "
                                   f"{err_torch:.3e} (bound {bound:.3e})")
