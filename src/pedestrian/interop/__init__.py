"""Reading and writing other tools' formats: Hugging Face GPT-2 directories
(:mod:`pedestrian.interop.hf`) and PEFT LoRA adapters (:mod:`pedestrian.interop.peft`).

Neither needs ``transformers`` or ``peft`` at run time; those libraries are only the test
oracles that prove the files interoperate.
"""

from . import families_moe  # noqa: F401  (registers Mixtral, Qwen3-MoE, OLMoE in families.FAMILIES)
from .hf import load_pretrained, save_pretrained

__all__ = ["load_pretrained", "save_pretrained"]
