"""DPO against TRL's own ``DPOTrainer`` (1.16; skipped where ``trl`` is not installed): the same
tokens for TRL's plain-text records (EOS appended, prompt and answers from their common prefix),
and the same loss and LoRA gradients for the same batch -- TRL's ``compute_loss`` (its default
``loss_type="sigmoid"``, the reference by disabling the PEFT adapter) against pedestrian's.

The model is the float64 Llama of tests/oracles/dpo_oracles.py (transformers' RMS norm and rotary
angles made float64). TRL's own log-probability kernel (``_ChunkedLogProbFunction``, its fused LM
head) keeps its softmax statistics in float32 whatever the model's dtype: as it is, its loss agrees
to float32 rounding (bound 1e-5: a few hundred float32 roundings of O(1) numbers, ε = 6e-8);
with that one function replaced by its formula in float64 (log_softmax, gather: what the kernel
computes), TRL's whole pipeline -- masks, sums, the reference through the disabled adapter, the
sigmoid loss, the mean -- agrees to float64 rounding: ~1e-14, bound 1e-12 on the loss and 1e-9
of the largest entry on the gradients (as tests/system/test_dpo.py derives).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

from dpo_oracles import MODULES, hf_llama, pedestrian_llama  # noqa: E402
from hf_fixtures import tiny_tokenizer, transformers  # noqa: E402

from pedestrian.interop.peft import load_peft_adapter  # noqa: E402
from pedestrian.model.head import sequence_logprobs, weigh_sequences  # noqa: E402
from pedestrian.training.dpo import dpo_loss, reference_logprobs  # noqa: E402
from pedestrian.training.preference import encode_record, pair_batch  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

RECORDS = [{"prompt": "the quick brown", "chosen": " fox jumps", "rejected": " dog sleeps over the lazy"},
           {"prompt": "pack my box", "chosen": " with five dozen", "rejected": " now"},
           {"prompt": "Sphinx of black", "chosen": " quartz, judge my vow.", "rejected": "quartz"}]
BETA, WINDOW = 0.2, 40


class _LogProbsFloat64:
    """``_ChunkedLogProbFunction``'s formula in float64, autograd's backward: per row
    ``log_softmax(h Wᵀ + b)[label]`` and the detached statistics DPO logs (entropy, mean logit,
    whether the label is the top logit)."""

    @staticmethod
    def apply(hidden, weight, bias, labels, temperature, chunk_size, softcap, logit_scale, outputs):
        assert softcap is None
        z = hidden @ weight.T if bias is None else hidden @ weight.T + bias
        z = z * logit_scale / temperature
        lp = torch.log_softmax(z, dim=-1)
        log_probs = lp.gather(-1, labels.clamp(min=0)[:, None])[:, 0]
        entropy = -(lp.exp() * lp).sum(-1).detach()
        is_top1 = (z.argmax(-1) == labels).detach()
        return log_probs, entropy, None, z.mean(-1).detach(), is_top1


@pytest.fixture(scope="module")
def trl_run(tmp_path_factory):
    """TRL's trainer on the float64 Llama with a LoRA adapter (``B`` drawn non-zero), its batch of
    every record, loss and gradients; the pedestrian model with the same base and adapter."""
    tmp = tmp_path_factory.mktemp("trl")
    tok = tiny_tokenizer()
    fast = transformers.GPT2TokenizerFast(tokenizer_object=tok.hf, bos_token="<|endoftext|>",
                                          eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    hf, config = hf_llama(tied=True, vocab_size=tok.vocab_size, max_position_embeddings=64)
    model = pedestrian_llama(hf, config, "fast", lora=False)        # the base, before PEFT wraps hf
    args = trl.DPOConfig(output_dir=str(tmp / "out"), report_to=[], beta=BETA, per_device_train_batch_size=3,
                         max_length=WINDOW + 1, use_cpu=True, bf16=False, fp16=False)
    trainer = trl.DPOTrainer(model=hf, args=args, train_dataset=datasets.Dataset.from_list(RECORDS),
                             processing_class=fast,
                             peft_config=peft.LoraConfig(r=2, lora_alpha=3, lora_dropout=0.0,
                                                         target_modules=["q_proj", "v_proj", "down_proj"]))
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(RECORDS))])
    trainer.model.train()
    with torch.no_grad():
        loss32 = trainer.compute_loss(trainer.model, batch).item()         # TRL's kernel: float32 statistics
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", _LogProbsFloat64)
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
    grads = {}
    for name, p in trainer.model.named_parameters():
        if "lora_" in name:
            i, module = name.split(".layers.")[1].split(".", 1)
            kind = next(k for k, m in MODULES.items() if module.startswith(m + "."))
            which = "lora_D" if ".lora_A." in name else "lora_U"
            grads[f"blocks.{i}.{kind}.{which}"] = p.grad.numpy().T     # D = Aᵀ, U = Bᵀ
    trainer.model.save_pretrained(str(tmp / "adapter"))
    load_peft_adapter(model, tmp / "adapter")
    return trainer, batch, (loss.item(), loss32), grads, model, tok


def test_the_pairs_tokens_are_trls(trl_run):
    trainer, batch, _, _, model, tok = trl_run
    pairs = [encode_record(r, tok, eos_token="<|endoftext|>") for r in RECORDS]
    for pair, row in zip(pairs, trainer.train_dataset):
        assert (list(pair.prompt), list(pair.chosen), list(pair.rejected)) == \
            (row["prompt_ids"], row["chosen_ids"], row["rejected_ids"])
    tokens, targets = pair_batch(pairs, WINDOW)
    ids, keep, answer = (batch[k].numpy() for k in ("input_ids", "attention_mask", "completion_mask"))
    assert tokens.shape == (ids.shape[0], ids.shape[1] - 1)
    np.testing.assert_array_equal(np.where(keep[:, :-1] == 1, ids[:, :-1], 0), np.where(keep[:, :-1] == 1, tokens, 0))
    np.testing.assert_array_equal(targets, np.where(answer[:, 1:] == 1, ids[:, 1:], -100))


def test_loss_and_lora_gradients_equal_trls(trl_run):
    _, _, (trl_loss, trl_loss32), trl_grads, model, tok = trl_run
    tokens, targets = pair_batch([encode_record(r, tok, eos_token="<|endoftext|>") for r in RECORDS], WINDOW)
    ref = reference_logprobs(model, tokens, targets)
    out = dpo_loss(sequence_logprobs(model, tokens, targets), ref, BETA)
    weigh_sequences(model, out.dlogp)
    grads = model.backward()
    assert abs(float(out.loss) - trl_loss32) < 1e-5                # TRL's float32 kernel as it is
    assert abs(float(out.loss) - trl_loss) < 1e-12                 # its formula in float64
    assert abs(trl_loss - np.log(2)) > 1e-3                       # (the adapters move the policy off the reference)
    assert set(grads) == set(trl_grads)
    scale = max(float(np.max(np.abs(g))) for g in trl_grads.values())
    for name, g in grads.items():
        np.testing.assert_allclose(g, trl_grads[name], rtol=0, atol=1e-9 * scale, err_msg=name)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_tokens_of_message_records_are_trls(tmp_path):
    """TRL's conversational records (prompt, chosen, rejected as message lists) rendered with a
    ChatML template: pedestrian's common-prefix rule, with the template rendered by
    transformers (the ``render`` pedestrian.text.chat gives ``finetune``), makes TRL's ids."""
    tok = tiny_tokenizer()
    fast = transformers.GPT2TokenizerFast(tokenizer_object=tok.hf, bos_token="<|endoftext|>",
                                          eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    records = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": r["prompt"]}],
                "chosen": [{"role": "assistant", "content": r["chosen"]}],
                "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in RECORDS]
    hf, _ = hf_llama(tied=True, vocab_size=tok.vocab_size, max_position_embeddings=64)
    args = trl.DPOConfig(output_dir=str(tmp_path), report_to=[], max_length=None, use_cpu=True)
    trainer = trl.DPOTrainer(model=hf, args=args, train_dataset=datasets.Dataset.from_list(records),
                             processing_class=fast, peft_config=peft.LoraConfig(r=2, target_modules=["q_proj"]))

    def render(messages, add_generation_prompt):
        return fast.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        return_dict=True)["input_ids"]

    for record, row in zip(records, trainer.train_dataset):
        pair = encode_record(record, tok, eos_token="<|endoftext|>", render=render)
        assert (list(pair.prompt), list(pair.chosen), list(pair.rejected)) == \
            (row["prompt_ids"], row["chosen_ids"], row["rejected_ids"])
