"""A small conversation set the repository makes itself, and a tiny model to fine-tune on it
(jobs/chat-qwen3-cpu.yaml, the tests, bench/prepare's conversations):

    python -m raytp.data.chat_demo chat-demo

writes ``chat-demo/model`` (a Hugging Face Qwen3 made from a config here: random weights, a byte-level BPE
tokenizer trained on the set, ChatML's tokens and Qwen3's chat template), and ``chat-demo/train.jsonl``,
``chat-demo/val.jsonl``: seeded conversations (a system turn sometimes, one to three user/assistant turns, some
as ``prompt``/``completion``) whose answers follow from the questions (sums, echoes), so that a small model
learns them.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

QWEN3 = (
    "{%- for message in messages %}{%- if message.role == 'assistant' %}{%- if loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
STYLES = {  # template, special tokens, tokenizer_config.json's roles
    "qwen3": (QWEN3, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "llama": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                       "<|eot_id|>"], {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
}
WORDS = "red blue green cat dog bird sun moon river stone tree star".split()
NUMBERS = "zero one two three four five six seven eight nine ten eleven twelve".split()


def _turn(rng: random.Random) -> tuple[str, str]:
    """A question and its answer: a sum of small numbers, or words said back."""
    if rng.random() < 0.5:
        a, b = rng.randint(0, 6), rng.randint(0, 6)
        return f"what is {NUMBERS[a]} plus {NUMBERS[b]}?", f"{NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[a + b]}."
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4)))
    return f"say {words}", words


def conversations(n: int = 60, seed: int = 0, max_turns: int = 3) -> list[dict]:
    """`n` seeded rows: mostly ``messages``, every fifth a ``prompt``/``completion``."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        if i % 5 == 4:
            q, a = _turn(rng)
            rows.append({"prompt": q, "completion": a})
            continue
        msgs = [{"role": "system", "content": "answer briefly"}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, max_turns)):
            q, a = _turn(rng)
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        rows.append({"messages": msgs})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> str:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tokenizer_dir(d: Path, style: str = "qwen3", vocab: int = 320, template_file: bool = False) -> str:
    """A tokenizer directory: tokenizer.json (byte-level BPE trained on conversations of this set),
    tokenizer_config.json, and the chat template in it or (`template_file`) in chat_template.jinja, as
    transformers 5 writes it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    template, specials, roles = STYLES[style]
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [json.dumps(r) for r in conversations(400, seed=99)]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **roles}
    if template_file:
        (d / "chat_template.jinja").write_text(template)
    else:
        cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(d)


def model_dir(d: Path, vocab: int = 320, seed: int = 0) -> str:
    """A tiny Qwen3 made from a config (random weights, seeded) beside its tokenizer, saved by transformers."""
    import torch
    import transformers
    d = Path(d)
    tokenizer_dir(d, "qwen3", vocab)
    cfg = transformers.Qwen3Config(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, intermediate_size=128,
                                   max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
                                   eos_token_id=2, pad_token_id=0)  # <|im_end|>, <|endoftext|>
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(d)
    return str(d)


def main(out: str) -> None:
    root = Path(out)
    model_dir(root / "model")
    write_jsonl(root / "train.jsonl", conversations(2000, seed=1))
    write_jsonl(root / "val.jsonl", conversations(100, seed=2))
    print(f"[raytp] wrote {root}/model (a tiny Qwen3 and its tokenizer), {root}/train.jsonl and {root}/val.jsonl")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "chat-demo")
