"""Files of other tools: Hugging Face checkpoints in and out (hf, hf_tokenizer), a tokenizer's chat template
(chat_template), and the export of a run's weights (export)."""
