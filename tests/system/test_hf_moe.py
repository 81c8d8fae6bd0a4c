"""Hugging Face Mixtral, Qwen3-MoE and OLMoE folders in and out (interop/families_moe.py): tiny
random models written by transformers' ``save_pretrained`` (one tensor per expert), loaded by
pedestrian in float64; logits, the loss -- the load-balancing loss included when the folder says
``output_router_logits`` -- and every gradient against transformers' own model; greedy generation
against its ``generate``; the export read back by transformers; PEFT files of adapters on the attention
and on the experts both ways;
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
from pedestrian.model.layout import resolve_lora_targets

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
    "qwen3_moe-renorm-dense-layer-window": ("qwen3_moe", dict(
        num_experts=5, moe_intermediate_size=6, intermediate_size=20, norm_topk_prob=True, mlp_only_layers=[1],
        head_dim=6, use_sliding_window=True, sliding_window=5)),               # (X has 11 tokens: the window bites)
    "mixtral-window-4": ("mixtral", dict(num_local_experts=4, intermediate_size=12, sliding_window=4)),
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
    assert (c.sliding_window, c.layer_types) == (kw.get("sliding_window"), None)     # (every layer slides)


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


def _random_adapters(model, seed):
    rng = np.random.default_rng(seed)
    for k in model.lora_state_dict():
        model.params[k][...] = 0.2 * rng.standard_normal(model.params[k].shape)


# (layers, rank_pattern, alpha_pattern): every expert layer (gate and up of other ranks: a block-diagonal
# gate_up_proj adapter), the down projection alone (no nesting), the gate alone beside the attention
PEFT_CASES = {
    "all": (["q", "v", "mlp_gate", "mlp_expand", "mlp_contract"], {"mlp_expand": 3}, {"mlp_contract": 0.5}),
    "down": (["mlp_contract"], None, None),
    "gate": (["k", "mlp_gate"], None, {"mlp_gate": 1.5}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("adapted", list(PEFT_CASES))
def test_peft_files_with_experts_both_ways(case, adapted, folders, tmp_path):
    """PEFT files of adapters on experts (interop/peft_experts.py: ``target_parameters``): PEFT's model
    with them gives pedestrian's logits; read back, the very same adapters; a file PEFT wrote itself
    gives PEFT's logits too."""
    from pedestrian.interop.peft import load_peft_adapter, save_peft_adapter

    peft = pytest.importorskip("peft")
    path, _ = folders[case]
    layers, ranks, alphas = PEFT_CASES[adapted]
    ours = load_hf_model(path, dtype="float64")
    c = ours.config                                   # (a dense block's MLP adapters: test_peft_expert_refusals)
    ours.add_lora([fc for fc in resolve_lora_targets(c, layers) if c.is_moe(int(fc.split(".")[1])) or "mlp_" not in fc],
                  rank=2, alpha=2.0, rank_pattern=ranks, alpha_pattern=alphas)
    _random_adapters(ours, 1)
    save_peft_adapter(ours, tmp_path / "adapter")
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert bool(written["target_parameters"]) == any(layer.startswith("mlp_") for layer in layers)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()
    wrapped = oracle(peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval())
    with torch.no_grad():
        want = wrapped(torch.as_tensor(X)).logits.numpy()
    ours.training = False
    assert np.max(np.abs(np.asarray(ours.forward(X)) - want)) <= REL * np.max(np.abs(want))
    again = load_hf_model(path, dtype="float64")
    load_peft_adapter(again, tmp_path / "adapter")
    assert again.lora_ranks == ours.lora_ranks and again.lora_alphas == ours.lora_alphas
    for k, v in ours.lora_state_dict().items():                  # the same numbers: a copy both ways
        assert np.array_equal(np.asarray(again.params[k]), np.asarray(v)), k
    # a file PEFT wrote (its own random adapters): pedestrian reads its logits
    theirs = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64),
                                 peft.LoraConfig(r=2, lora_alpha=3, target_modules=["q_proj"], init_lora_weights=False,
                                                 target_parameters=["mlp.experts.gate_up_proj", "down_proj"],
                                                 rank_pattern={"down_proj": 3}))
    theirs.save_pretrained(str(tmp_path / "theirs"))
    with torch.no_grad():
        want = oracle(theirs.eval())(torch.as_tensor(X)).logits.numpy()
    read = load_hf_model(path, dtype="float64")
    load_peft_adapter(read, tmp_path / "theirs")
    assert np.max(np.abs(np.asarray(read.forward(X)) - want)) <= REL * np.max(np.abs(want))


def test_peft_expert_refusals(folders, tmp_path):
    from pedestrian.interop.peft import load_peft_adapter, save_peft_adapter

    path, _ = folders["mixtral"]
    dropout = load_hf_model(path)
    dropout.add_lora(["mlp_gate"], rank=2, dropout=0.1)
    uneven = load_hf_model(path)
    uneven.add_lora(["mlp_gate"], rank=2, rank_pattern={"blocks.0.experts.1.mlp_gate": 3})
    mixed = load_hf_model(folders["qwen3_moe-renorm-dense-layer-window"][0])      # (block 1 is dense)
    mixed.add_lora(["q", "mlp_contract"], rank=2)
    for model, match in ((dropout, "lora_dropout=0.1"), (uneven, "block 0's expert adapters"),
                         (mixed, r"dense MLP blocks \(blocks.1.mlp_contract")):
        with pytest.raises(ValueError, match=match) as err:
            save_peft_adapter(model, tmp_path / "no")
        assert "\n" not in str(err.value) and not (tmp_path / "no").exists()
    ok = load_hf_model(path)
    ok.add_lora(["mlp_contract"], rank=2)
    save_peft_adapter(ok, tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    for edit, match in ((dict(target_parameters=["mlp.experts.w9"]), "names 'mlp.experts.w9'"),
                        (dict(r=3), r"needs lora_A \(12, 12\)")):
        (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**cfg, **edit}))
        fresh = load_hf_model(path)
        with pytest.raises(ValueError, match=match) as err:
            load_peft_adapter(fresh, tmp_path / "adapter")
        assert "\n" not in str(err.value) and not fresh.lora_targets


@pytest.mark.parametrize("family, key, value", [
    ("mixtral", "router_jitter_noise", 0.1), ("mixtral", "sliding_window", 0), ("olmoe", "clip_qkv", 8.0),
    ("qwen3_moe", "sliding_window", 2.5), ("olmoe", "attention_bias", True),
])
def test_refusals(family, key, value, folders):
    case = next(c for c, (f, _) in CASES.items() if f == family)
    hf = json.loads((folders[case][0] / "config.json").read_text())
    hf[key] = value
    if family == "qwen3_moe" and key == "sliding_window":
        hf["use_sliding_window"] = True                 # (the window is read only then)
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


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe-renorm-dense-layer-window"])
def test_cli_finetune_writes_expert_adapters_as_peft_files(case, tmp_path, capsys):
    """``finetune`` with LoRA on the attention and every expert projection writes PEFT files that
    PEFT's model reads with the fine-tune's logits; a Qwen3-MoE whose dense block is adapted too gets
    none, and the run says why in one line (test_peft_expert_refusals)."""
    from hf_fixtures import TEXT, tiny_tokenizer

    from pedestrian import cli
    from pedestrian.training.finetune import load_finetuned

    family, kw = CASES[case]
    torch.manual_seed(0)
    hf = getattr(transformers, CLASSES[family][1])(getattr(transformers, CLASSES[family][0])(
        **{**TINY, **kw, "vocab_size": tiny_tokenizer().vocab_size}))
    d = tmp_path / "base"
    hf.save_pretrained(str(d))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer().hf,
                                         eos_token="<|endoftext|>").save_pretrained(str(d))
    (tmp_path / "data.txt").write_text(TEXT * 2, encoding="utf-8")
    run = tmp_path / "run"
    code = cli.main(["finetune", "--hf-dir", str(d), "--data", str(tmp_path / "data.txt"), "--max-steps", "2",
                     "--context-length", "16", "--batch-size", "2", "--eval-interval", "2", "--eval-batches", "1",
                     "--lora-rank", "2", "--lora-targets", "q_proj", "v_proj", "gate_proj", "up_proj", "down_proj",
                     "--out", str(run), "--no-progress", "--no-plot"])
    out, err = capsys.readouterr()
    assert code == 0
    if case != "mixtral":
        assert not (run / "peft").exists()
        assert [line for line in (out + err).splitlines() if "no PEFT files: " in line and "dense MLP" in line]
        return
    model, _ = load_finetuned(run, dtype="float64")
    model.training = False
    peft = pytest.importorskip("peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float64).eval()
    with torch.no_grad():
        want = oracle(peft.PeftModel.from_pretrained(base, str(run / "peft")).eval())(torch.as_tensor(X)).logits
    want = want.numpy()
    assert np.max(np.abs(np.asarray(model.forward(X)) - want)) <= REL * np.max(np.abs(want))


def test_explain_and_params_read_a_folder(folders, capsys):
    """``explain --hf-dir`` and ``params --hf-dir`` read the folder's config.json (no weights): the
    dense block of the Qwen3-MoE folder gets its own rows, the window its mask; a field flag beside
    the folder is refused in one line."""
    from pedestrian import cli

    d = str(folders["qwen3_moe-renorm-dense-layer-window"][0])
    assert cli.main(["explain", "--hf-dir", d, "--seq-len", "8"]) == 0
    out, _ = capsys.readouterr()
    assert "block i, for i in 0, 2 (a mixture of experts)" in out and "block i, for i = 1 (a dense MLP)" in out
    assert "causal mask, window 5" in out
    assert cli.main(["params", "--hf-dir", d, "--lora-rank", "2", "--lora-targets", "q", "v"]) == 0
    out, _ = capsys.readouterr()
    assert "active per token" in out and "LoRA r=2 on q,v" in out
    assert cli.main(["params", "--hf-dir", d, "--d-model", "32"]) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1 and "--d-model changes a preset's model" in err and "--hf-dir bring" in err
