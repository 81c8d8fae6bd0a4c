"""Hugging Face Mixtral, Qwen3-MoE and OLMoE folders in and out (interop/families_moe.py): tiny
random models written by transformers' ``save_pretrained`` (one tensor per expert), loaded by
pedestrian in float64; logits, the loss -- the load-balancing loss included when the folder says
``output_router_logits`` -- and every gradient against transformers' own model; greedy generation
against its ``generate``; the export read back by transformers; PEFT adapters on the attention;
the refusals.

The oracle is transformers' model in float64 with its float32 steps replaced by their formulas in
float64 (as tests/system/test_hf_llama_dirs.py does for Llama): the rotary table, the RMS norms
(family_oracles.float64_throughout), and here also the router's softmax (``router_logits.float()``
/ ``softmax(..., dtype=torch.float)``) and ``load_balancing_loss_func``'s float32 sums."""

from __future__ import annotations

import json

import numpy as np
import pytest
from family_oracles import float64_throughout, torch, transformers

from pedestrian.generation.generate import generate
from pedestrian.generation.sampling import Sampling
from pedestrian.interop.hf import load_hf_model, save_pretrained
from pedestrian.interop.hf_llama_config import config_from_hf
from pedestrian.interop.hf_llama_tensors import llama_state_to_hf

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

V = 64
TINY = dict(vocab_size=V, hidden_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, rms_norm_eps=1e-5, num_experts_per_tok=2, output_router_logits=True,
            router_aux_loss_coef=0.05, bos_token_id=0, eos_token_id=0, pad_token_id=0)
CLASSES = {"mixtral": ("MixtralConfig", "MixtralForCausalLM", "modeling_mixtral"),
           "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "modeling_qwen3_moe"),
           "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", "modeling_olmoe")}
CASES = {
    "mixtral": ("mixtral", dict(num_local_experts=4, intermediate_size=12)),
    "qwen3_moe-renorm-dense-layer": ("qwen3_moe", dict(num_experts=5, moe_intermediate_size=6, intermediate_size=20,
                                                       norm_topk_prob=True, mlp_only_layers=[1], head_dim=6)),
    "olmoe-probs": ("olmoe", dict(num_experts=4, intermediate_size=10, norm_topk_prob=False, num_experts_per_tok=3)),
}
X = np.random.default_rng(7).integers(1, V, size=(2, 11))
# float64 compares the same sums in other orders: 1e-10 of the scale is far above the rounding of
# a 3-block model (~1e-15) and far below any wrong term
REL = 1e-10


def hf_model(case: str, seed: int = 0):
    family, kw = CASES[case]
    torch.manual_seed(seed)
    cfg = getattr(transformers, CLASSES[family][0])(**{**TINY, **kw})
    model = getattr(transformers, CLASSES[family][1])(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))      # routers far from uniform: no near-ties
    return model


def _router_forward(self, hidden_states):
    """transformers' TopKRouter with the softmax in the model's dtype (it casts to float32)."""
    h = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(h, self.weight)
    probs = torch.softmax(logits, dim=-1)
    top, index = torch.topk(probs, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):           # (Mixtral's router always renormalises)
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, index


def _aux64(gate_logits, num_experts=None, top_k=2, attention_mask=None):
    """``load_balancing_loss_func`` without an attention mask, its sums in float64."""
    assert attention_mask is None
    counts, probs, rows = 0, 0, 0
    for layer in gate_logits:
        p = torch.softmax(layer, dim=-1)
        _, chosen = torch.topk(p, top_k, dim=-1)
        counts = counts + torch.nn.functional.one_hot(chosen, num_experts).sum((0, 1)).double()
        probs, rows = probs + p.sum(0), rows + p.shape[0]
    return num_experts * torch.sum((counts / rows) * (probs / rows))


def oracle(model):
    """``model`` in float64 throughout (module docstring)."""
    import importlib

    family = (model.get_base_model() if hasattr(model, "get_base_model") else model).config.model_type
    float64_throughout(model)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner.set_experts_implementation("eager")            # (torch's grouped_mm takes no float64)
    for module in model.modules():
        if type(module).__name__.endswith("TopKRouter"):
            module.forward = _router_forward.__get__(module)
    mod = importlib.import_module(f"transformers.models.{family}.{CLASSES[family][2]}")
    mod.load_balancing_loss_func = _aux64
    return model.double()


def hf_file_grads(model) -> dict:
    """transformers' gradients under the names its files use (the fused experts split per expert)."""
    family = model.config.model_type
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().numpy()
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            stem = name.rsplit(".experts.", 1)[0].replace(".mlp", ".block_sparse_moe" if family == "mixtral" else ".mlp")
            m = g.shape[1] // 2
            for e in range(g.shape[0]):
                if name.endswith("gate_up_proj"):
                    parts = {"w1": g[e, :m], "w3": g[e, m:]} if family == "mixtral" else \
                        {"gate_proj": g[e, :m], "up_proj": g[e, m:]}
                else:
                    parts = {"w2" if family == "mixtral" else "down_proj": g[e]}
                for k, v in parts.items():
                    out[f"{stem}.experts.{e}.{k}.weight"] = v
        elif family == "mixtral" and ".mlp.gate." in name:
            out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = g
        else:
            out[name] = g
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_dirs")
    out = {}
    for case in CASES:
        model = hf_model(case)
        model.save_pretrained(str(tmp / case))
        out[case] = (tmp / case, model)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_config(case, folders):
    path, model = folders[case]
    hf = json.loads((path / "config.json").read_text())
    c = config_from_hf(hf)
    family, kw = CASES[case]
    assert c.n_experts == kw.get("num_experts", kw.get("num_local_experts"))
    assert c.n_experts_per_token == kw.get("num_experts_per_tok", 2)
    assert c.norm_topk_prob == (True if family == "mixtral" else kw["norm_topk_prob"])
    assert (c.router_aux_loss_coef, c.output_router_logits) == (0.05, True)
    assert c.qk_norm == {"mixtral": None, "qwen3_moe": "head", "olmoe": "proj"}[family]
    assert c.moe_layers == ((0, 2) if family == "qwen3_moe" else None)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_loss_and_every_gradient(case, folders):
    path, hf = folders[case]
    ours = load_hf_model(path, dtype="float64")
    ours.training = True                                  # (loaded in inference mode; no dropout either way)
    ref = oracle(hf)
    x = torch.as_tensor(X)
    out = ref(x, labels=x)                                # transformers' loss: its CE in float32 (logits.float())
    loss64 = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1)) \
        + ref.config.router_aux_loss_coef * out.aux_loss  # the same formula in float64
    assert abs(float(out.loss) - float(loss64)) <= 1e-6 * float(loss64)
    targets = np.concatenate([X[:, 1:], np.full((X.shape[0], 1), -100)], axis=1)
    loss = ours.loss(X, targets)
    logits = np.asarray(ours.forward(X))
    scale = np.max(np.abs(out.logits.detach().numpy()))
    assert np.max(np.abs(logits - out.logits.detach().numpy())) <= REL * scale
    assert abs(ours.loss_parts["aux"] - float(out.aux_loss)) <= 1e-13 * float(out.aux_loss)
    assert abs(loss - float(loss64)) <= 1e-12 * float(loss64)
    ref.zero_grad()
    loss64.backward()
    ours.loss(X, targets)
    grads = llama_state_to_hf(ours.backward(), ours.config)
    want = hf_file_grads(ref)
    assert set(grads) == set(want) - ({"lm_head.weight"} if ours.config.tie_weights else set())
    for name, g in grads.items():
        w = want[name]
        assert np.max(np.abs(g - w)) <= 1e-9 * max(np.max(np.abs(w)), 1e-12), name


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_generation_and_export(case, folders, tmp_path):
    path, hf = folders[case]
    ours = load_hf_model(path, dtype="float64")
    ref = oracle(hf)
    prompt = X[:1, :5]
    want = ref.generate(torch.as_tensor(prompt), max_new_tokens=8, do_sample=False, eos_token_id=None,
                        pad_token_id=0).numpy()
    got = generate(ours, prompt, 8, Sampling(temperature=0))
    assert np.array_equal(np.asarray(got), want)
    save_pretrained(ours, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float64).eval()
    oracle(back)
    with torch.no_grad():
        again = back(torch.as_tensor(X)).logits.numpy()
    assert np.max(np.abs(again - np.asarray(ours.forward(X)))) <= REL * np.max(np.abs(again))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == CASES[case][0]


def test_peft_attention_adapters_and_expert_refusal(folders, tmp_path):
    from pedestrian.interop.peft import load_peft_adapter, save_peft_adapter

    path, _ = folders["mixtral"]
    ours = load_hf_model(path, dtype="float64")
    ours.add_lora(["q", "v"], rank=2, alpha=2.0)
    rng = np.random.default_rng(1)
    for k in ours.lora_state_dict():
        ours.params[k][...] = 0.2 * rng.standard_normal(ours.params[k].shape)
    save_peft_adapter(ours, tmp_path / "adapter")
    peft = pytest.importorskip("peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()
    wrapped = oracle(peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval())
    with torch.no_grad():
        want = wrapped(torch.as_tensor(X)).logits.numpy()
    ours.training = False
    assert np.max(np.abs(np.asarray(ours.forward(X)) - want)) <= REL * np.max(np.abs(want))
    again = load_hf_model(path, dtype="float64")
    load_peft_adapter(again, tmp_path / "adapter")
    assert np.max(np.abs(np.asarray(again.forward(X)) - want)) <= REL * np.max(np.abs(want))
    experts = load_hf_model(path)
    experts.add_lora(["mlp_gate"], rank=2)
    with pytest.raises(ValueError, match="experts") as err:
        save_peft_adapter(experts, tmp_path / "no")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family, key, value", [
    ("mixtral", "router_jitter_noise", 0.1), ("mixtral", "sliding_window", 8), ("olmoe", "clip_qkv", 8.0),
    ("qwen3_moe", "use_sliding_window", True), ("olmoe", "attention_bias", True),
])
def test_refusals(family, key, value, folders):
    case = next(c for c, (f, _) in CASES.items() if f == family)
    hf = json.loads((folders[case][0] / "config.json").read_text())
    hf[key] = value
    if key == "use_sliding_window":
        hf["sliding_window"] = 8
    with pytest.raises(ValueError, match=key) as err:
        config_from_hf(hf)
    assert "\n" not in str(err.value)


def test_dense_families_refuse_experts(folders):
    from pedestrian.interop.families import export_family

    ours = load_hf_model(folders["mixtral"][0])
    assert export_family(ours.config) == "mixtral"
    hf = json.loads((folders["mixtral"][0] / "config.json").read_text())
    hf["model_type"], hf["architectures"] = "llama", ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="num_local_experts"):
        config_from_hf(hf)
