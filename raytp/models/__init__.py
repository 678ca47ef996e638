"""The models raytp trains, one folder per architecture (gpt2/, llama/), each described by a ModelSpec
(raytp.models.spec) and its torch-free facts for a job (raytp.models.arch, which names them all;
raytp.models.registry builds their specs). Shared: ModelArgs (args.py), the CausalLM base
(base.py), building a TP shard of any of them (shard.py), the model file (files.py)."""
