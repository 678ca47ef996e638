"""Llama's facts for a job (raytp.models.arch), with the job checks only a Llama needs: no torch here."""
from __future__ import annotations

from raytp.models.facts import ArchFacts, divisors

JOB_RULES = (
    (("model.n_kv_head", "model.n_head"),
     lambda v: v["model.n_kv_head"] is None or v["model.n_head"] % v["model.n_kv_head"] == 0,
     lambda v: f"{v['model.n_kv_head']} does not divide model.n_head={v['model.n_head']} (each KV head serves "
               f"a group of query heads); valid: {divisors(v['model.n_head'])}"),
    (("model.dropout",),
     lambda v: v["model.dropout"] == 0,
     lambda v: f"{v['model.dropout']}, but the llama architecture has no dropout; set it to 0"),
    (("model.n_head", "model.n_embd", "model.head_dim"),
     lambda v: (v["model.head_dim"] or v["model.n_embd"] // v["model.n_head"]) % 2 == 0,
     lambda v: f"{v['model.n_head']} heads make a head width of "
               f"{v['model.head_dim'] or v['model.n_embd'] // v['model.n_head']}; rotary position embedding needs "
               "an even head width (model.head_dim, else model.n_embd / model.n_head)"),
)

FACTS = ArchFacts(
    name="llama", title="Llama",
    summary="llama (rotary positions, SwiGLU MLP, RMSNorm, grouped-query attention, no biases)",
    width_key="model.intermediate_size",
    width_name="intermediate_size",
    job_rules=JOB_RULES,
)
