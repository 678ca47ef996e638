"""Data: corpora on disk and their formats (Megatron-LM's indexed dataset, nanoGPT's .bin, raytp's prepared
datasets), their preparation across a Ray cluster (raytp.data.prepare), and the pure sampling functions that
make each step's batch (raytp.data.sampling)."""
