"""Llama: the model (model.py), its TP plan and sharding table (plan.py), its Hugging Face spelling (hf.py),
gathered into one ModelSpec with its job checks (spec.py)."""
