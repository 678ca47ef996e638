"""Context parallelism: a sequence cut over a CP group (sequence), attention over it (ring_attention, its blocks
in attention_blocks; ulysses) and the layer that runs either on its group (context_attention)."""
