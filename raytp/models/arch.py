"""The architectures raytp trains, by ``model.arch``: the one place that names them all, by their facts for a
job (raytp.models.facts: no torch). raytp.models.registry builds each one's ModelSpec from the folder of that
name (raytp.models.<name>.spec).
"""
from __future__ import annotations

from raytp.models.facts import ArchFacts
from raytp.models.gpt2.facts import FACTS as GPT2
from raytp.models.llama.facts import FACTS as LLAMA

ARCHES: dict[str, ArchFacts] = {f.name: f for f in (GPT2, LLAMA)}
