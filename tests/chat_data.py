"""Conversations for the fine-tuning tests: a small byte-level BPE tokenizer directory with a chat template
(ChatML as Qwen3 writes it, an empty think block on the last assistant turn; or Llama 3's headers), and
seeded conversations of uneven lengths and turns, as JSON lines."""
import json
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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
STYLES = {
    "qwen3": (QWEN3, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "llama": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                       "<|eot_id|>"], {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
}
WORDS = ("what is the sum of two and three five the answer please tell me about rivers cats sing numbers "
         "add seven eight nine ten eleven twelve hello thanks").split()


def sentence(rng, lo=2, hi=9) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def conversations(n=60, seed=0, max_turns=3) -> list[dict]:
    """Seeded rows: mostly `messages` (a system turn sometimes, 1..max_turns user/assistant pairs), some
    `prompt`/`completion`."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        if i % 5 == 4:
            rows.append({"prompt": sentence(rng), "completion": sentence(rng, 1, 12)})
            continue
        msgs = [{"role": "system", "content": "be brief"}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, max_turns)):
            msgs += [{"role": "user", "content": sentence(rng)},
                     {"role": "assistant", "content": sentence(rng, 1, 12)}]
        rows.append({"messages": msgs})
    return rows


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def tokenizer_dir(d, style="qwen3", vocab=320, template_file=False) -> str:
    """A tokenizer directory (tokenizer.json, tokenizer_config.json, and the template in it or, with
    `template_file`, in chat_template.jinja as transformers 5 writes it)."""
    template, specials, config = STYLES[style]
    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [json.dumps(r) for r in conversations(200, seed=99)]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **config}
    if template_file:
        (d / "chat_template.jinja").write_text(template)
    else:
        cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(d)
