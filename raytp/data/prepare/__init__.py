"""`raytp prepare`: a corpus (text files, JSON lines, Parquet; local, shared or object-store) tokenized over
every CPU of a Ray cluster into a prepared dataset (raytp.data.manifest): shards in Megatron-LM's indexed
format, each document's ids followed by the end-of-document id, and a manifest written last.

    prepare(["s3://bucket/corpus/*.jsonl.gz"], "llama3/tokenizer.json", "s3://bucket/prepared")

inputs.py    SOURCE arguments -> files and their formats (by suffix, never guessed)
read.py      the documents of a piece of a file; the cheap check of each file's first records
tokenizer.py the tokenizer and its end-of-document token
chat.py      conversations: rendered with the chat template, each token trained on or not
plan.py      the shards: a pure function of the files and the shard size (not of the cluster)
shard.py     one shard read, encoded and written (by a Ray task, or in this process)
outdir.py    the output directory: start, start over, nothing to do, or refuse
driver.py    all of it in order, over Ray Data or in this process
"""
from __future__ import annotations

from raytp.data.manifest import Manifest


def prepare(sources, tokenizer: str, out: str, text_key: str = "text", eod: str | None = None,
            address: str | None = None, shard_tokens: int | None = None, overwrite: bool = False,
            progress: bool = True, chat_template: str | None = None) -> Manifest:
    """Tokenize `sources` (paths, directories, globs or URLs) with `tokenizer` (a tokenizer.json or a
    directory holding one) into a prepared dataset at `out`, over the Ray cluster this process is connected
    to (else `address`, else RAY_ADDRESS, else a local Ray started for it); its manifest. A dataset already
    there from the same inputs and tokenizer is returned as it is."""
    from raytp.data.prepare.driver import run
    return run(list(sources), tokenizer, out, text_key, eod, shard_tokens, overwrite, progress, address,
               chat_template=chat_template).manifest


def prepare_local(files, tokenizer: str, out: str, text_key: str = "text", eod: str | None = None,
                  shard_tokens: int | None = None, overwrite: bool = False, progress: bool = False,
                  chat_template: str | None = None) -> Manifest:
    """`prepare` in this process, without Ray (a small source, prepared by `raytp train` itself): the same
    shards and manifest."""
    from raytp.data.prepare.driver import run
    return run([str(f) for f in files], tokenizer, out, text_key, eod, shard_tokens, overwrite, progress,
               local=True, chat_template=chat_template).manifest
