"""Llama as raytp knows it (Llama 2/3, Mistral without sliding window, Qwen and SmolLM shapes): one
ModelSpec (raytp.models.spec) from this folder's modules and its facts for a job (facts.py)."""
from __future__ import annotations

from raytp.models.llama import hf, plan
from raytp.models.llama.facts import FACTS
from raytp.models.llama.model import Llama
from raytp.models.spec import HFAdapter, ModelSpec

SPEC = ModelSpec(
    facts=FACTS,
    model=Llama, sharding=plan.SHARDING, parallelize=plan.swap_parallel, tag=plan.tag,
    hf=HFAdapter(model_types=hf.MODEL_TYPES, config_to_hf=hf.hf_config, config_from_hf=hf.config_from_hf,
                 to_hf=hf.to_hf, from_hf=hf.from_hf, block_size=hf.block_size),
)
