"""`raytp prepare`: tokenize a corpus over a Ray cluster into a prepared dataset (raytp.data.prepare).

    raytp prepare 's3://bucket/corpus/*.jsonl.gz' --tokenizer llama3/ --out s3://bucket/prepared
"""
from __future__ import annotations

import os

import click

from raytp.cli.base import fail, failed, main
from raytp.data.prepare.plan import MIN_SHARD_TOKENS, SHARD_TOKENS, SPREAD


def conversations_line(conv: dict) -> str:
    """A dataset of conversations in a few words: trained tokens, and the rows left out by reason."""
    bad = ", ".join(f"{n:,} {k.replace('_', ' ')}" for k, n in conv["bad"].items() if n)
    return (f"conversations: {conv['trained_tokens']:,} tokens trained on, {sum(conv['bad'].values()):,} of "
            f"{conv['rows']:,} rows left out" + (f" ({bad})" if bad else ""))


@main.command()
@click.argument("sources", nargs=-1, required=True, metavar="SOURCE...")
@click.option("--tokenizer", required=True, help="tokenizer.json, or a directory holding one.")
@click.option("--out", required=True, help="The dataset's directory: a path or a URL (s3://...).")
@click.option("--text-key", default="text", show_default=True,
              help="The field (JSON lines) or column (Parquet) that holds each document's text.")
@click.option("--eod", default=None, metavar="TOKEN",
              help="The end-of-document token (default: tokenizer_config.json's eos_token beside the tokenizer, "
                   "else <|endoftext|>, <|end_of_text|>, </s> or <eos>, whichever the vocabulary has).")
@click.option("--shard-tokens", default=None, type=click.IntRange(min=1),
              help=f"About this many tokens per shard, the unit of parallel work (default: {SHARD_TOKENS:,}, "
                   f"less for a corpus of fewer than {SPREAD} such shards, down to {MIN_SHARD_TOKENS:,}).")
@click.option("--overwrite", is_flag=True, help="Replace a dataset at --out prepared from other inputs.")
@click.option("--chat-template", default=None, metavar="FILE",
              help="Conversations' chat template (Jinja) (default: the tokenizer's: chat_template.jinja beside it, "
                   "else tokenizer_config.json's chat_template).")
@click.option("--address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else a local Ray).")
def prepare(sources, tokenizer, out, text_key, eod, shard_tokens, overwrite, chat_template, address):
    """Tokenize SOURCE... (text files, JSON lines optionally compressed, Parquet; files, directories, globs
    or URLs) over every CPU of a Ray cluster into a prepared dataset at --out: Megatron-LM .bin/.idx shards,
    each document followed by the end-of-document token, and a manifest.json written last. Rows of
    conversations ("messages", or "prompt" and "completion") are rendered with the chat template, each token
    marked trained on or not (a .mask beside each shard), bad rows counted by reason."""
    from raytp.data.prepare.driver import run
    from raytp.files.storage import StorageError
    if address or os.environ.get("RAY_ADDRESS"):
        from raytp.head import use_token_if_present  # a cluster Ray started asks for its token
        use_token_if_present()
    try:
        r = run(list(sources), tokenizer, out, text_key, eod, shard_tokens, overwrite, progress=True,
                address=address, chat_template=chat_template)
    except (ValueError, StorageError) as e:
        fail(str(e), 2)
    except Exception as e:  # noqa: BLE001 - a failed cluster or storage: one line (its traceback with --debug)
        failed(e)
    m = r.manifest
    what = f"{m.documents:,} documents, {m.tokens:,} tokens, {len(m.shards)} shards ({m.dtype})"
    if m.conversations is not None:
        what += "; " + conversations_line(m.conversations)
    if not r.fresh:
        click.echo(f"[raytp] {out}: already prepared from these inputs with this tokenizer ({what}); "
                   "nothing to do", err=True)
        return
    click.echo(f"[raytp] prepared {what} in {r.seconds:.1f}s ({r.tokens_per_s:,.0f} tokens/s) -> {out}", err=True)
