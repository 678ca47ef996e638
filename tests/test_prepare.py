"""`raytp prepare`: a JSON-lines (plain and gzipped) and a Parquet corpus made here from stdlib text, tokenized
with a BPE tokenizer trained here, over the shared local Ray (from and to S3: tests/test_s3.py);
the shards read back as Megatron-LM's indexed format give each document's encoding followed by the
end-of-document id; a prepare killed mid-write leaves no dataset and a re-run completes; bad input is one
error naming the file (and line)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from prepare_corpus import EOD, SHARD_TOKENS, expected, make_corpus, read_back
from raytp.cli import main
from raytp.data import manifest as manifest_mod
from raytp.data.prepare import outdir, prepare, prepare_local
from raytp.data.prepare.driver import run
from raytp.data.prepare.plan import MIN_SHARD_TOKENS, SPREAD, Piece, plan, shard_size
from raytp.data.prepare.plan import SHARD_TOKENS as DEFAULT_SHARD_TOKENS
from raytp.data.prepare.inputs import File, format_of
from raytp.files.storage import Storage

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def _files(where: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(where.iterdir()) if p.name != outdir.MARKER}


# -- pure decisions ---------------------------------------------------------------------------------------
def test_formats_come_from_the_suffix_and_an_unknown_one_is_named():
    assert format_of("s3://b/x/part-1.jsonl.zst") == ("jsonl", "zstd")
    assert format_of("a.JSON.gz") == ("jsonl", "gzip")
    assert format_of("/d/notes.md") == ("text", None)
    assert format_of("t.parquet") == ("parquet", None)
    for bad in ("data.csv", "README", "x.txt.gz", "y.parquet.bz2"):
        with pytest.raises(ValueError, match=f"{bad}: unknown format"):
            format_of(bad)


def test_the_plan_covers_every_byte_once_and_does_not_depend_on_the_cluster():
    files = [File("big.jsonl", "jsonl", 1000, None, ""), File("s1.txt", "text", 10, None, ""),
             File("s2.txt", "text", 10, None, ""), File("z.jsonl.gz", "jsonl", 100, "gzip", ""),
             File("p.parquet", "parquet", 999, None, "")]
    shards = plan(files, shard_tokens=75, row_groups={4: (200, 200, 50)})  # 300 bytes of text per shard
    assert shards == [(Piece(0, 0, 300),), (Piece(0, 300, 600),), (Piece(0, 600, 900),),  # the big file cut
                      (Piece(0, 900, 1000), Piece(1), Piece(2)),  # small files share a shard
                      (Piece(3),),  # compressed: whole (about 4x its 100 bytes of text)
                      (Piece(4, row_groups=(0,)),), (Piece(4, row_groups=(1, 2)),)]  # Parquet by row groups
    assert plan(files, 75, {4: (200, 200, 50)}) == shards
    with pytest.raises(ValueError, match="--shard-tokens"):
        plan(files, 0, {})


def test_a_small_corpus_is_cut_into_smaller_shards_so_that_many_tasks_encode_it():
    def corpus(mb):  # text bytes, ~4 a token
        return [File("a.jsonl", "jsonl", mb << 20, None, "")]
    assert shard_size(corpus(1)) == MIN_SHARD_TOKENS  # 256k tokens: one shard of the smallest size
    assert shard_size(corpus(1024)) == (1024 << 18) // SPREAD  # 268M tokens: SPREAD shards of ~4M
    assert shard_size(corpus(1 << 20)) == DEFAULT_SHARD_TOKENS  # a TB: the default size


@pytest.mark.parametrize("names, marker, overwrite, expected", [
    ([], None, False, outdir.START),
    ([outdir.MARKER, "shard-00000.bin", ".tmp-1-shard-00001.bin"], "fp", False, outdir.START_OVER),  # killed
    ([outdir.MARKER, manifest_mod.NAME], "fp", False, outdir.DONE),
    ([outdir.MARKER, manifest_mod.NAME], "other", True, outdir.START_OVER),
])
def test_what_a_run_does_with_its_output_directory(names, marker, overwrite, expected):
    assert outdir.decide(names, marker, "fp", overwrite, "out") == expected


def test_a_foreign_or_different_output_directory_is_refused():
    with pytest.raises(ValueError, match="not a dataset raytp prepare made"):
        outdir.decide(["thesis.tex"], None, "fp", True, "out")  # --overwrite never removes what is not ours
    with pytest.raises(ValueError, match="other inputs .* --overwrite"):
        outdir.decide([outdir.MARKER, manifest_mod.NAME], "other", "fp", False, "out")


# -- prepared over Ray -----------------------------------------------------------------------------------
@pytest.mark.slow  # over 10 s: the full suite's, not the quick tier's
def test_prepared_shards_read_back_as_each_documents_ids_then_eod(ray_local, corpus, tmp_path):
    data, docs, tok_file, tok = corpus
    sources = [str(data / "a.jsonl"), str(data / "b.jsonl.gz"), str(data / "c.parquet")]
    m = prepare(sources, str(tok_file), str(tmp_path / "ds"), shard_tokens=SHARD_TOKENS, progress=False)
    assert len(m.shards) >= 4 and m.dtype == "uint16" and m.eod_id == tok.token_to_id(EOD)
    assert m.tokenizer["eod_token"] == EOD and m.vocab_size == tok.get_vocab_size()
    assert manifest_mod.parse((tmp_path / "ds" / "manifest.json").read_text(), "m") == m
    got = read_back(tmp_path / "ds", m)
    assert got == expected(tok, docs)
    assert m.documents == len(docs) and m.tokens == sum(map(len, got))
    assert not [p for p in (tmp_path / "ds").iterdir() if p.name.startswith(".tmp-")]

    # Deterministic: the same bytes again, over Ray from a directory and without Ray (prepare_local).
    again = prepare([str(data)], str(tok_file), str(tmp_path / "ds2"), shard_tokens=SHARD_TOKENS, progress=False)
    local = prepare_local([str(data)], str(tok_file), str(tmp_path / "ds3"), shard_tokens=SHARD_TOKENS)
    assert again.shards == local.shards == m.shards
    assert _files(tmp_path / "ds") != {} and _files(tmp_path / "ds2") == _files(tmp_path / "ds3")
    assert {k: v for k, v in _files(tmp_path / "ds").items() if k != "manifest.json"} == \
        {k: v for k, v in _files(tmp_path / "ds2").items() if k != "manifest.json"}

    # The same inputs again: nothing to do; other inputs: refused unless --overwrite.
    r = run([str(data)], str(tok_file), str(tmp_path / "ds2"), shard_tokens=SHARD_TOKENS, progress=False)
    assert not r.fresh and r.manifest == again
    with pytest.raises(ValueError, match="other inputs"):
        prepare([str(data / "a.jsonl")], str(tok_file), str(tmp_path / "ds2"), progress=False)
    one = prepare([str(data / "a.jsonl")], str(tok_file), str(tmp_path / "ds2"), overwrite=True, progress=False)
    assert one.documents == len(docs) // 3 and not (tmp_path / "ds2" / "shard-00003.bin").exists()


def test_a_vocabulary_past_65536_writes_int32_ids(corpus, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    data, docs, _, _ = corpus
    vocab = {"[UNK]": 0, "</s>": 70_000, **{f"w{i}": i for i in range(1, 70_000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "t.txt").write_text("w1 w69999 w70000 w65536 other")
    m = prepare_local([str(tmp_path / "t.txt")], str(tmp_path), str(tmp_path / "ds"))
    assert m.dtype == "int32" and m.eod_id == 70_000
    assert read_back(tmp_path / "ds", m) == [[1, 69_999, 0, 65_536, 0, 70_000]]


# -- bad input: one error naming the file (and line), before anything is written where it can be -----------
def _prepare_cli(*args):
    r = CliRunner().invoke(main, ["prepare", *map(str, args)])
    return r.exit_code, r.output


@pytest.mark.slow  # over 15 s: the quick tier keeps under 3 minutes
def test_bad_input_is_one_error_naming_the_file_and_line(ray_local, corpus, tmp_path):
    data, _, tok_file, _ = corpus
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n\n{"body": "b", "id": 3}\n')
    code, out = _prepare_cli(bad, "--tokenizer", tok_file, "--out", tmp_path / "o1")
    assert code == 2 and f"error: {bad}:3: no 'text' field (its fields: body, id)" in out
    assert not (tmp_path / "o1").exists()  # found before anything was written

    # Past what the driver checks: found by the task, named by line; no manifest.
    late = tmp_path / "late.jsonl"
    late.write_text(json.dumps({"text": "x" * 70_000}) + "\n" + '{"text": "y"}\n' * 4000 + "[1, 2]\n")
    with pytest.raises(ValueError, match=f"{late}:4002: a JSON list, not an object"):
        prepare([str(late)], str(tok_file), str(tmp_path / "o2"), shard_tokens=5000, progress=False)
    assert not (tmp_path / "o2" / "manifest.json").exists()

    (tmp_path / "x.csv").write_text("text\nhello\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "zero.txt").write_text("")
    (tmp_path / "fake.parquet").write_text("not parquet")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    for source, out, message in [
            (tmp_path / "x.csv", "o3", "x.csv: unknown format (suffix '.csv')"),
            (tmp_path / "empty", "o3", "empty: an empty source (no files)"),
            (tmp_path / "zero.txt", "o3", "zero.txt: an empty source"),
            (tmp_path / "fake.parquet", "o3", "fake.parquet: not a Parquet file"),
            (tmp_path / "latin1.txt", "o3", "latin1.txt: not UTF-8 text"),
            (data / "c.parquet", "o3", "c.parquet: no column 'body' (its columns: text)"),
            (data / "a.jsonl", foreign, "mine is not empty and not a dataset raytp prepare made")]:
        args = ["--text-key", "body"] if "c.parquet" in str(source) else []
        code, out = _prepare_cli(source, "--tokenizer", tok_file, "--out", tmp_path / out, *args)
        assert code == 2 and message in out and out.count("error:") == 1 and "Traceback" not in out, out
    assert not (tmp_path / "o3").exists() and (foreign / "notes.txt").read_text() == "keep me"


def test_the_end_of_document_token_is_found_or_asked_for(corpus, tmp_path):
    from tokenizers import Tokenizer, models
    data, _, tok_file, tok = corpus
    bare = tmp_path / "bare"
    bare.mkdir()
    Tokenizer(models.BPE()).save(str(bare / "tokenizer.json"))
    with pytest.raises(ValueError, match="no end-of-document token raytp knows .* pass --eod"):
        prepare_local([data / "a.jsonl"], str(bare), str(tmp_path / "o"))
    with pytest.raises(ValueError, match="--eod: end-of-document token '<eos>' is not in the vocabulary"):
        prepare_local([data / "a.jsonl"], str(tok_file), str(tmp_path / "o"), eod="<eos>")
    named = tmp_path / "named"
    named.mkdir()
    (named / "tokenizer.json").write_bytes(tok_file.read_bytes())
    (named / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "Ġ"}}))
    m = prepare_local([data / "a.jsonl"], str(named), str(tmp_path / "o"))
    assert m.eod_id == tok.token_to_id("Ġ") and m.tokenizer["eod_token"] == "Ġ"


# -- killed mid-write ----------------------------------------------------------------------------------------
def _kill_tree(proc) -> None:
    """SIGKILL a process and every process under it, and wait until they are gone. Ray's workers are not in
    the driver's process group, so a killpg alone leaves a task writing a shard into the re-run's directory."""
    import psutil
    try:
        root = psutil.Process(proc.pid)
    except psutil.NoSuchProcess:  # it ended already (and was reaped: Ray in this process ignores SIGCHLD)
        proc.wait()
        return
    gone: list = []
    for _ in range(3):  # again: a raylet may have forked a worker between the listing and the kill
        tree = [root, *root.children(recursive=True)]
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        gone += tree
    proc.wait()
    _, alive = psutil.wait_procs(gone, timeout=60)
    assert not alive, alive


@pytest.mark.slow  # a `raytp prepare` process starting its own Ray, killed, then a re-run
def test_a_prepare_killed_mid_write_leaves_no_dataset_and_a_rerun_completes(ray_local, corpus, tmp_path):
    data, docs, tok_file, tok = corpus
    big = tmp_path / "big.jsonl"
    with open(big, "w") as f:
        for _ in range(40):
            f.writelines(json.dumps({"text": t}) + "\n" for t in docs)
    out = tmp_path / "ds"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-m", "raytp.cli", "prepare", str(big), "--tokenizer", str(tok_file),
                             "--out", str(out), "--shard-tokens", "100000"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and any(p.name.startswith(".tmp-") for p in out.iterdir())):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no shard was being written"
            time.sleep(0.01)
    finally:
        _kill_tree(proc)  # the driver, its Ray and the tasks writing: as a machine dies
    assert (out / outdir.MARKER).exists() and not (out / manifest_mod.NAME).exists(), \
        f"the prepare ended before it was killed: {proc.stderr.read().decode()[-2000:]}"
    with pytest.raises(FileNotFoundError):
        outdir.existing(Storage(str(out)))
    m = prepare([str(big)], str(tok_file), str(out), shard_tokens=100_000, progress=False)
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]
    assert read_back(out, m) == expected(tok, docs) * 40
