"""GPT-2 as raytp knows it: one ModelSpec (raytp.models.spec) from this folder's modules and its facts for a
job (facts.py)."""
from __future__ import annotations

from raytp.models.gpt2 import hf, plan
from raytp.models.gpt2.facts import FACTS
from raytp.models.gpt2.model import GPT
from raytp.models.spec import HFAdapter, ModelSpec

SPEC = ModelSpec(
    facts=FACTS,
    model=GPT, sharding=plan.SHARDING, parallelize=plan.swap_parallel, tag=plan.tag,
    hf=HFAdapter(model_types=hf.MODEL_TYPES, config_to_hf=hf.hf_config, config_from_hf=hf.config_from_hf,
                 to_hf=hf.to_hf, from_hf=hf.from_hf, bin_state=hf.from_hf_state),
)
