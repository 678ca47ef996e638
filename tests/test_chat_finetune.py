"""Fine-tuning on conversations (issue 49): `raytp prepare` renders them as transformers does and marks the
trained tokens; the packing puts whole conversations in rows; raytp's masked, packed loss and gradients equal
transformers' on the same conversations run one by one (Llama, Qwen3); and the fine-tune trains alike at one
device, TP=2, PP=2 and DP=2 x zero 1."""
import json

import numpy as np
import pytest
import torch
import torch.distributed as dist

from raytp.data import packing
from raytp.data.chat_demo import conversations, tokenizer_dir, write_jsonl
from raytp.data.corpus import batch, load_corpus
from raytp.data.prepare import prepare_local

transformers = pytest.importorskip("transformers")
BLOCK = 256


def _messages(row):
    if "messages" in row:
        return row["messages"]
    return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]


def _hf_ids(tok, msgs):
    out = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.fixture(scope="module")
def chat_set(tmp_path_factory):
    """{style: (tokenizer dir, prepared dir, good rows)}: Qwen3's template in tokenizer_config.json, Llama 3's
    in chat_template.jinja."""
    out = {}
    for style in ("qwen3", "llama"):
        d = tmp_path_factory.mktemp(style)
        tok = tokenizer_dir(d / "tok", style, template_file=style == "llama")
        rows = conversations(60)
        bad = [{"messages": [{"role": "user", "content": "hi"}]},
               {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},
               {"messages": "not a list"}]
        prepare_local([write_jsonl(d / "c.jsonl", rows[:30] + bad + rows[30:])], tok, str(d / "out"))
        out[style] = (tok, d / "out", rows)
    return out


@pytest.mark.parametrize("style", ["qwen3", "llama"])
def test_prepare_renders_as_transformers_and_trains_only_the_assistant_turns(chat_set, style):
    tok_dir, out, rows = chat_set[style]
    m = json.loads((out / "manifest.json").read_text())
    assert m["conversations"]["bad"] == {"no_assistant_turn": 1, "not_a_conversation": 1, "unknown_role": 1}
    assert m["conversations"]["rows"] == len(rows) + 3 and m["documents"] == len(rows)
    ids = np.fromfile(out / "shard-00000.bin", dtype=np.uint16)
    mask = np.fromfile(out / "shard-00000.mask", dtype=np.uint8)
    assert m["conversations"]["trained_tokens"] == int(mask.sum())
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    eot = "<|im_end|>" if style == "qwen3" else "<|eot_id|>"
    at = 0
    for row in rows:
        msgs = _messages(row)
        want = _hf_ids(tok, msgs)
        assert ids[at:at + len(want)].tolist() == want  # transformers' own rendering and ids
        trained = tok.decode([t for t, k in zip(want, mask[at:at + len(want)]) if k])
        answers = [m["content"].strip() if style == "llama" else m["content"] for m in msgs
                   if m["role"] == "assistant"]
        if style == "qwen3":  # the last turn's (empty) think block is the model's to say
            answers[-1] = "<think>\n\n</think>\n\n" + answers[-1]
        assert trained == "".join(a + eot for a in answers)
        at += len(want)
    assert at == len(ids)


def test_parquet_conversations_prepare_as_their_json_lines_do(chat_set, tmp_path):
    """The same rows as Parquet (a `messages` column of structs; `prompt`/`completion` strings in a file of
    their own) give the JSON lines' ids and masks, recognised by their columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    tok_dir, out, rows = chat_set["qwen3"]
    chats = [r for r in rows if "messages" in r]
    pairs = [r for r in rows if "prompt" in r]
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "a.parquet")
    pq.write_table(pa.Table.from_pylist(pairs), tmp_path / "b.parquet")
    write_jsonl(tmp_path / "a.jsonl", chats)
    write_jsonl(tmp_path / "b.jsonl", pairs)
    got = prepare_local([tmp_path / "a.parquet", tmp_path / "b.parquet"], tok_dir, str(tmp_path / "pq"))
    want = prepare_local([tmp_path / "a.jsonl", tmp_path / "b.jsonl"], tok_dir, str(tmp_path / "js"))
    assert got.documents == want.documents == len(rows) and got.conversations["bad"] == {}
    for suffix, dtype in ((".bin", np.uint16), (".mask", np.uint8)):
        a, b = ([np.fromfile(tmp_path / d / f"{s.prefix}{suffix}", dtype=dtype) for s in m.shards]
                for d, m in (("pq", got), ("js", want)))
        assert np.array_equal(np.concatenate(a), np.concatenate(b))


def test_packing_places_whole_documents_first_fit_and_counts_the_long_ones():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 34, 300)  # 0..32 positions: each fits a row of 32
    lengths[[3, 50]] = [80, 100]  # longer than a row of 32 (+1)
    ends = np.cumsum(lengths)
    for pack, too_long in ((True, "truncate"), (False, "truncate"), (True, "drop")):
        p = packing.plan(ends, 32, seed=5, pack=pack, too_long=too_long)
        placed = sorted(p.starts.tolist())
        ok = (lengths >= 2) & ((lengths - 1 <= 32) | (too_long == "truncate"))
        assert placed == sorted((ends - lengths)[ok].tolist())  # each kept document once, whole
        per_row = np.add.reduceat(p.lengths - 1, p.row_starts[:-1])
        assert per_row.max() <= 32 and (p.too_long, p.short) == (2, int((lengths < 2).sum()))
        if pack:  # first-fit (every row open, fewer than packing.OPEN): at most one row is half full or less
            assert p.rows < packing.OPEN and (per_row <= 16).sum() <= 1 and p.rows < len(placed)
        else:
            assert p.rows == len(placed)
    again = packing.plan(ends, 32, seed=5)
    assert np.array_equal(again.starts, packing.plan(ends, 32, seed=5).starts)  # a pure function of the seed


def _hf_model(style):
    if style == "llama":
        cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                                       rope_theta=500.0, tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.Qwen3Config(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=2, head_dim=16, intermediate_size=48,
                                   max_position_embeddings=512, rope_theta=500.0, tie_word_embeddings=False)
    return transformers.Qwen3ForCausalLM(cfg)


@pytest.mark.parametrize("style", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_a_packed_masked_batch_gives_transformers_loss_and_gradients(chat_set, style, tmp_path):
    """One packed batch of conversations: raytp's loss (the sum over trained tokens / their count) and its
    gradients equal transformers' on each conversation alone, unpacked, labels -100 where not trained on."""
    from raytp.files.interop import hf
    from raytp.models.registry import build_model
    tok_dir, out, _ = chat_set[style]
    torch.manual_seed(4)
    theirs = _hf_model(style).float().eval()
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    theirs.save_pretrained(tmp_path)
    ours = build_model(hf.inspect(tmp_path), seed=0)
    hf.load_into(tmp_path, ours, 0, 1)
    corpus = load_corpus(str(out), None)
    x, y, docs = batch(corpus, "train", 1, 0, 0, 1, 4, BLOCK)
    trained_docs = [set(docs[r][y[r] >= 0].tolist()) for r in range(len(x))]
    assert max(len(t) for t in trained_docs) >= 3  # several conversations share a row
    count = int((y >= 0).sum())
    loss = ours(x, y, documents=docs) / count
    loss.backward()
    want_loss = 0.0
    theirs.zero_grad()
    for r in range(x.shape[0]):
        for d in docs[r].unique().tolist():
            at = (docs[r] == d).nonzero().flatten()
            if (y[r, at] < 0).all():
                continue  # padding
            # the conversation alone: its inputs and last token (any id where not trained on: its logit is unused)
            ids = torch.cat([x[r, at], y[r, at[-1:]].clamp(min=0)])[None]
            labels = torch.cat([torch.tensor([-100]), y[r, at].masked_fill(y[r, at] < 0, -100)])[None]
            part = theirs(ids, labels=labels, num_items_in_batch=count).loss
            part.backward()
            want_loss += float(part.detach())
    assert abs(float(loss.detach()) - want_loss) < 1e-5 * max(1.0, abs(want_loss))
    grads = {n.removeprefix("model."): p.grad for n, p in theirs.named_parameters()}
    for n, p in ours.named_parameters():
        assert float((p.grad - grads[n]).abs().max()) < 1e-5, n


B_BLOCK, B_BATCH, B_M = 96, 8, 2  # B_M: micro-batches of a pipeline stage


def _finetune_layouts(rank, world, init, data, runs):
    """Each run (arch, tp, pp, dp, zero, micro-batches per rank, sequence parallel) -> (losses, loss_tokens,
    trained tokens per micro-batch) of 20 steps."""
    import dataclasses
    from tp_training import HYPER, STEPS, SEED, gpt_config, llama_config
    from raytp.models.registry import build_model
    from raytp.models.shard import build_shard
    from raytp.models.stage import stage_of
    from raytp.parallel.groups import ProcessGroups, build_groups
    from raytp.parallel.layout import Layout
    from raytp.train.optimizer import make_optimizer
    from raytp.train.stage_runner import PipelineSchedule
    from raytp.train.step import train_step
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    corpus = load_corpus(data, None)
    out = []
    for arch, tp, pp, dp, zero, m, sp in runs:
        cfg = dataclasses.replace(llama_config() if arch == "llama" else gpt_config(), vocab_size=320,
                                  block_size=B_BLOCK)
        if world == 1:
            groups, model = ProcessGroups(Layout(1), 0, None, None), build_model(cfg, SEED)
            stage = None
        else:
            groups = build_groups(Layout(tp, pp=pp, dp=dp, zero=zero), rank)
            stage = stage_of(cfg, pp, groups.pp_rank) if pp > 1 else None
            model = build_shard(cfg, SEED, groups.tp, sp, stage=stage)
        opt = make_optimizer(model, HYPER, dp, groups.dp_rank, zero)
        pipe = PipelineSchedule("1f1b", stage, sp) if pp > 1 else None
        losses, tokens, per_mb = [], [], []
        for step in range(STEPS):
            x, y, d = batch(corpus, "train", SEED, step, groups.dp_rank, dp, B_BATCH, B_BLOCK)
            mbs = list(zip(x.chunk(m), y.chunk(m), d.chunk(m)))
            r = train_step(model, opt, mbs, groups, step, HYPER, schedule=pipe)
            losses.append(r.loss)
            tokens.append(r.loss_tokens)
            per_mb.append([int((mb[1] >= 0).sum()) for mb in mbs])
        if hasattr(opt, "settle"):
            opt.settle()
        out.append((losses, tokens, per_mb))
    return out


@pytest.mark.slow
def test_a_finetune_trains_alike_at_one_device_tp2_pp2_and_dp2_zero1(chat_set):
    """20 steps of masked, packed fine-tuning of a Llama: TP=2, PP=2 (1F1B, two micro-batches) and DP=2 x
    zero 1 give one device's (one micro-batch of the 8 rows) losses within 1e-5 relative, and every layout
    counts the same trained tokens per step, though micro-batches hold uneven counts of them (a mean per
    micro-batch would not give one device's loss); a GPT-2 (learned positions, restarting at each
    conversation: each TP rank looks up its slice of them) at TP=2 with sequence parallelism too."""
    from raytp.parallel.spawn import run_ranks
    data = str(chat_set["qwen3"][1])
    refs = run_ranks(1, _finetune_layouts, data, [("llama", 1, 1, 1, 0, 1, False), ("gpt2", 1, 1, 1, 0, 1, False)])[0]
    ref = {"llama": refs[0], "gpt2": refs[1]}
    runs = [("llama", 2, 1, 1, 0, 1, False), ("llama", 1, 2, 1, 0, B_M, False), ("llama", 1, 1, 2, 1, 1, False),
            ("gpt2", 2, 1, 1, 0, 1, True)]
    for rank_out in run_ranks(2, _finetune_layouts, data, runs, timeout_s=600):
        assert all(len(set(c)) > 1 for c in rank_out[1][2])  # PP's two micro-batches: uneven trained tokens
        for run, (losses, tokens, _) in zip(runs, rank_out):
            want, want_tokens, _ = ref[run[0]]
            assert tokens == want_tokens, run
            rel = np.abs(np.array(losses) - want) / np.abs(want)
            assert rel.max() < 1e-5, (run, rel.max())


def test_rows_the_template_cannot_render_are_counted_and_a_job_may_refuse_them(tmp_path):
    """A template named on the command line that raises on some rows (a system turn): those rows are left out
    and counted as template_error; data.bad_rows: refuse refuses the dataset, naming them."""
    import subprocess
    import sys
    from raytp.config import from_dict
    from raytp.data.chat_demo import QWEN3
    from raytp.data.corpus import job_corpus
    tok = tokenizer_dir(tmp_path / "tok")
    strict = tmp_path / "strict.jinja"
    strict.write_text("{%- if messages[0].role == 'system' %}{{ raise_exception('no system turns') }}{%- endif %}"
                      + QWEN3)
    rows = conversations(40, seed=3)
    systems = sum(1 for r in rows if r.get("messages", [{}])[0].get("role") == "system")
    assert systems > 0
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    m = prepare_local([src], tok, str(tmp_path / "out"), chat_template=str(strict))
    assert m.conversations["bad"] == {"template_error": systems} and m.documents == len(rows) - systems
    data = {"source": str(tmp_path / "out"), "bad_rows": "refuse"}
    with pytest.raises(ValueError, match="template_error"):
        job_corpus(from_dict({"data": data}).data)
    assert job_corpus(from_dict({"data": {**data, "bad_rows": "skip"}}).data).counts["bad"] == {
        "template_error": systems}
    bare = tmp_path / "bare"  # a tokenizer without a template: one error line, status 2, nothing written
    bare.mkdir()
    (bare / "tokenizer.json").write_text((tmp_path / "tok" / "tokenizer.json").read_text())
    p = subprocess.run([sys.executable, "-m", "raytp.cli", "prepare", src, "--tokenizer", str(bare), "--out",
                        str(tmp_path / "never")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().startswith("error:") and "--chat-template" in p.stderr
    assert not (tmp_path / "never").exists()


def test_a_dataset_of_conversations_is_estimated_with_its_attention_mask(chat_set):
    """Packed conversations keep attention inside each, as data.document_mask does, though the key is off: the
    data check says so, and the memory estimate (the start line's, and the first step's comparison) counts the
    same per-layer mask."""
    import dataclasses
    from raytp.api.job import check_data
    from raytp.config import from_dict
    from raytp.runtime.estimate import estimate
    cfg = from_dict({"model": {"arch": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64,
                               "intermediate_size": 96, "block_size": 96, "vocab_size": 320},
                     "data": {"source": str(chat_set["qwen3"][1])}, "runtime": {"device": "cuda"}})
    line, conversations = check_data(cfg)
    assert conversations and "packed into" in line
    masked = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, document_mask=True))
    assert estimate(cfg, documents=True) == estimate(masked) != estimate(cfg)
