"""The models raytp trains, one folder per architecture (gpt2/, llama/), each described by a ModelSpec
(raytp.models.spec); raytp.models.registry names them. Shared: ModelArgs (args.py), the CausalLM base
(base.py), building a TP shard of any of them (shard.py), the model file (files.py)."""
