"""GPT-2's facts for a job (raytp.models.arch): no torch here."""
from __future__ import annotations

from raytp.models.facts import ArchFacts

FACTS = ArchFacts(
    name="gpt2", title="GPT-2",
    summary="gpt2 (learned positions, GELU MLP, tied head)",
    width_key="4*model.n_embd",
    width_name="mlp width 4*n_embd",
)
