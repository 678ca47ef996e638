"""Fine-tuning on conversations through Ray (issue 49): `prepare` on Ray Data, a fine-tune of a tiny Qwen3 made
from a config at TP=2 (masked, packed, validated on held-out conversations), export to Hugging Face with its
tokenizer and chat template, and transformers answers as raytp does; `raytp sample --chat` says the same. A
rank killed mid-fine-tune heals bit for bit."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers import close, drive, one_device_records, raytp_cli, run

from raytp.config import from_dict
from raytp.data.chat_demo import conversations, model_dir, write_jsonl

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def chat_data(ray_local, tmp_path_factory):
    """(a tiny Qwen3 made from a config, beside its tokenizer; its conversations prepared on Ray Data)."""
    from raytp.data.prepare import prepare
    d = tmp_path_factory.mktemp("chat")
    model = model_dir(d / "model")
    m = prepare([write_jsonl(d / "train.jsonl", conversations(300, seed=1))], model, str(d / "prepared"),
                progress=False)  # over the Ray this process joined: Ray Data
    assert m.conversations["bad"] == {} and m.conversations["trained_tokens"] < m.tokens / 2
    return model, str(d / "prepared")


def chat_job(model, data, tp=2, dp=1, steps=6, **sections):
    return from_dict({"model": {"init_from": model, "block_size": 128},
                      "parallel": {"tp": tp, "dp": dp},
                      "train": {"steps": steps, "batch_size": 4, "lr": 3e-3, "warmup_steps": 1, "eval_interval": 3,
                                "steps_per_call": 3},
                      "data": {"source": data, "tokenizer": model, "val_fraction": 0.1},
                      "checkpoint": {"every": steps}, "runtime": {"placement_timeout_s": 300.0}, **sections})


@pytest.mark.slow
def test_prepare_train_export_and_transformers_answers(chat_data, tmp_path):
    from raytp.data.prepare import chat
    from raytp.files.interop.export import embedded_tokenizer
    from raytp.models.files import load_model
    from raytp.runtime.origin import starting_state
    model, data = chat_data
    run_dir = tmp_path / "run"
    cfg, init_state = starting_state(chat_job(model, data), None, run_dir, say=lambda m: None)
    assert init_state is not None
    d, _, _ = drive(cfg, run_dir, "chat-ft", init_state=init_state)  # from the model's own weights
    close(d)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss_tokens" in r]
    assert len(steps) == 6 and all(0 < r["loss_tokens"] < 4 * 128 for r in steps)  # trained tokens only
    assert any(r.get("val_loss") is not None for r in records)
    raytp_cli("export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "hf"), "--tokenizer", model)
    assert (json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text()).get("chat_template")
            or (tmp_path / "hf" / "chat_template.jinja").is_file())
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    msgs = [{"role": "user", "content": "what is two plus three?"}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = theirs.generate(**prompt, max_new_tokens=12, do_sample=False)[0].tolist()
    raytp_cli("export", str(run_dir), "--out", str(tmp_path / "model.pt"), "--tokenizer", model)
    ours = load_model(tmp_path / "model.pt").eval()
    tok_json = (Path(model) / "tokenizer.json").read_text()
    spec = json.loads(embedded_tokenizer(tmp_path / "model.pt", "chat"))
    ids, eot = chat.prompt_ids(chat.renderer(tok_json, spec), msgs[0]["content"])
    assert ids == prompt["input_ids"][0].tolist() and eot == theirs.generation_config.eos_token_id
    mine = ours.generate(torch.tensor([ids]), 12, temperature=0.0, stop=eot)[0].tolist()
    assert mine == out[:len(mine)] and len(mine) > len(ids)  # greedy: raytp's file answers as the export does
    said = raytp_cli("sample", str(tmp_path / "model.pt"), "--chat", "--prompt", msgs[0]["content"],
                     "--tokens", "12", "--temperature", "0").stdout
    answer = mine[len(ids):]
    assert said == tok.decode(answer[:answer.index(eot)] if eot in answer else answer, skip_special_tokens=True) + "\n"


@pytest.mark.slow
def test_a_killed_rank_mid_finetune_heals_bit_for_bit(chat_data, tmp_path):
    """TP=1 x DP=2 fine-tune, snapshots every step: rank 1 killed after step 3 heals from its replica, and the
    run ends with the uninterrupted run's weights and AdamW state, to the bit, and its losses."""
    import signal
    from helpers import assert_bitwise_equal, events, final_state, losses, signal_rank
    from raytp.runtime.origin import starting_state
    model, data = chat_data
    from reference_runs import unbroken_run
    out = {}
    for name, faults in (("whole", None), ("killed", [(3, signal_rank(1, signal.SIGKILL))])):
        cfg = chat_job(model, data, tp=1, dp=2, steps=8, recovery={"snapshot_every": 1},
                       runtime={"placement_timeout_s": 300.0, "step_timeout_s": 30.0})
        cfg, _ = starting_state(cfg, None, tmp_path / name, say=lambda m: None)  # the model's shape: seeded
        if faults is None:  # the unbroken run: in forked ranks (tests/reference_runs.py)
            unbroken_run(cfg, tmp_path / name, f"chat-{name}")
        else:
            run(cfg, tmp_path / name, f"chat-{name}", faults=faults)
        out[name] = (final_state(tmp_path / name, 8), losses(tmp_path / name))
    assert events(tmp_path / "killed", "recovered")
    assert_bitwise_equal(out["killed"][0], out["whole"][0])
    assert out["killed"][1] == out["whole"][1]


@pytest.mark.slow
def test_a_live_resize_keeps_the_finetune_loss_curve(chat_data, tmp_path):
    """TP=1 x DP=2, resized live to TP=2 x DP=1 after step 3: the fine-tune's losses and trained-token counts
    stay one device's (the packed rows are a function of the seed and step, not of the
    layout; the loss is over the global batch's trained tokens)."""
    import io
    from raytp.runtime.driver.driver import Driver
    from raytp.runtime.origin import starting_state
    model, data = chat_data
    cfg, _ = starting_state(chat_job(model, data, tp=1, dp=2, steps=6), None, tmp_path / "ref", say=lambda m: None)
    want = one_device_records(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=1)))
    d = Driver(cfg, tmp_path / "run", "chat-resized", out=io.StringIO())
    try:
        d.start()
        d.train_loop(until=3)
        assert d.resize(tp=2, dp=1).ok
        d.train_loop(until=6)
    finally:
        d.release()
        d.log.close()
    got = [m for m in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "loss_tokens" in m]
    assert [(m["tp"], m["dp"]) for m in got] == [(1, 2)] * 3 + [(2, 1)] * 3
    assert [m["loss_tokens"] for m in got] == [m["loss_tokens"] for m in want]
    rel = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(got, want))
    assert len(got) == 6 and rel < 1e-5, rel
