"""The documents of a piece of a corpus file, and a cheap check of each file's first records.

Every problem is a ValueError naming the file (and the line of a JSON-lines file, the row of a Parquet
file) and what is wrong: not UTF-8, not JSON, no text field, a text that is not a string, not Parquet.
`check_head` finds most of them on the driver before anything is written, from each file's first
HEAD_BYTES; the tasks find the rest as they read.
"""
from __future__ import annotations

import codecs
import json
from collections.abc import Iterator

from raytp.data.prepare.plan import Piece
from raytp.data.prepare.inputs import File
from raytp.files.storage import Storage

HEAD_BYTES = 1 << 16   # what the driver's check reads of each file
PARQUET_BATCH = 1024   # rows per Arrow batch read from a Parquet file
TEXT, CONVERSATIONS = "text", "conversations"  # what a file's rows are


def open_file(f: File, decompress: bool = True):
    """A file's bytes (decompressed), opened through fsspec."""
    store = Storage(f.url)
    try:
        return store.fs.open(store.path(), "rb", compression=f.compression if decompress else None)
    except (ImportError, ValueError) as e:  # a compression whose library is missing
        raise ValueError(f"{f.url}: cannot read {f.compression} data ({e})") from None


def is_conversation(record: dict, key: str) -> bool:
    """Whether a record is a conversation (``messages``, or ``prompt`` and ``completion``) rather than a text
    under `key`."""
    return key not in record and ("messages" in record or ("prompt" in record and "completion" in record))


def record_text(line: bytes, key: str, kind: str = TEXT) -> str | dict | None:
    """The text of one JSON line (None for a blank line), or of a conversations file the record itself;
    ValueError saying what is wrong with it (what a conversation holds is checked as it is encoded:
    raytp.data.prepare.chat)."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 ({e.reason} at byte {e.start} of the line)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}, not an object with a {key!r} field")
    if kind == CONVERSATIONS:
        if not is_conversation(record, key):
            raise ValueError(f"not a conversation (no 'messages', nor 'prompt' and 'completion'; its fields: "
                             f"{', '.join(list(record)[:8]) or 'none'}), in a file of conversations")
        return record
    if is_conversation(record, key):
        raise ValueError("a conversation among texts (a file holds one or the other)")
    if key not in record:
        fields = ", ".join(list(record)[:8]) or "none"
        raise ValueError(f"no {key!r} field (its fields: {fields}); choose one with --text-key")
    text = record[key]
    if not isinstance(text, str):
        raise ValueError(f"field {key!r} is a {type(text).__name__}, not a string")
    return text


def _line_of(f: File, offset: int) -> int:
    """The line number (from 1) of the line starting at byte `offset` of an uncompressed file."""
    n = 1
    with open_file(f) as fh:
        while offset > 0:
            chunk = fh.read(min(offset, 1 << 22))
            if not chunk:
                break
            n += chunk.count(b"\n")
            offset -= len(chunk)
    return n


def _jsonl(f: File, piece: Piece, key: str, kind: str) -> Iterator[str | dict]:
    with open_file(f) as fh:
        pos = piece.start
        if pos > 0:  # the line that crosses `start` belongs to the range before
            fh.seek(pos - 1)
            pos += len(fh.readline()) - 1
        first, k = pos, 0
        while piece.end is None or pos < piece.end:
            line = fh.readline()
            if not line:
                return
            try:
                text = record_text(line, key, kind)
            except ValueError as e:  # its line number, counted from the file's start only when needed
                at = k + 1 if first == 0 else _line_of(f, first) + k
                raise ValueError(f"{f.url}:{at}: {e}") from None
            pos += len(line)
            k += 1
            if text is not None:
                yield text


def _text(f: File) -> Iterator[str]:
    with open_file(f) as fh:
        data = fh.read()
    try:
        yield data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{f.url}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _parquet_file(f: File, fh):
    import pyarrow.parquet as pq
    try:
        return pq.ParquetFile(fh)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid/OSError variously for a non-Parquet file
        raise ValueError(f"{f.url}: not a Parquet file ({e})") from None


def parquet_kind(names: list[str], key: str) -> str:
    """A Parquet file's rows by its columns: texts under `key`, else conversations."""
    if key not in names and ("messages" in names or {"prompt", "completion"} <= set(names)):
        return CONVERSATIONS
    return TEXT


def _conversation_columns(names: list[str]) -> list[str]:
    return ["messages"] if "messages" in names else ["prompt", "completion"]


def _column_check(f: File, pf, key: str) -> None:
    import pyarrow as pa
    schema = pf.schema_arrow
    if parquet_kind(schema.names, key) == CONVERSATIONS:
        return
    if key not in schema.names:
        raise ValueError(f"{f.url}: no column {key!r} (its columns: {', '.join(schema.names[:8])}); "
                         "choose one with --text-key")
    typ = schema.field(key).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
        raise ValueError(f"{f.url}: column {key!r} holds {typ}, not strings")


def _parquet(f: File, piece: Piece, key: str, kind: str) -> Iterator[str | dict]:
    with open_file(f) as fh:
        pf = _parquet_file(f, fh)
        _column_check(f, pf, key)
        meta = pf.metadata
        if kind == CONVERSATIONS:
            columns = _conversation_columns(pf.schema_arrow.names)
            for g in piece.row_groups:
                for batch in pf.iter_batches(batch_size=PARQUET_BATCH, row_groups=[g], columns=columns):
                    yield from batch.to_pylist()
            return
        for g in piece.row_groups:
            row = sum(meta.row_group(j).num_rows for j in range(g))
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH, row_groups=[g], columns=[key]):
                for text in batch.column(0).to_pylist():
                    row += 1
                    if text is None:
                        raise ValueError(f"{f.url}: row {row}: {key!r} is null")
                    yield text


def documents(f: File, piece: Piece, key: str, kind: str = TEXT) -> Iterator[str | dict]:
    """The texts of one piece of a file, in order (of a file of conversations, its records)."""
    if f.kind == "text":
        return _text(f)
    if f.kind == "jsonl":
        return _jsonl(f, piece, key, kind)
    return _parquet(f, piece, key, kind)


def _kind_of(line: bytes, key: str) -> str:
    """What a file's first record says its rows are (TEXT if it is not JSON: record_text says why)."""
    try:
        record = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return TEXT
    return CONVERSATIONS if isinstance(record, dict) and is_conversation(record, key) else TEXT


def check_head(f: File, key: str) -> tuple[tuple[int, ...], str]:
    """Check a file's first records (ValueError naming what is wrong): (a Parquet file's row groups' sizes
    in bytes (what plan.plan cuts it by), else (); what its rows are, TEXT or CONVERSATIONS, known from its
    first record or its columns, never from a flag)."""
    if f.kind == "parquet":
        with open_file(f) as fh:
            pf = _parquet_file(f, fh)
            _column_check(f, pf, key)
            return (tuple(pf.metadata.row_group(g).total_byte_size for g in range(pf.metadata.num_row_groups)),
                    parquet_kind(pf.schema_arrow.names, key))
    with open_file(f) as fh:
        try:
            head = fh.read(HEAD_BYTES)
            whole = len(head) < HEAD_BYTES or not fh.read(1)
        except Exception as e:  # noqa: BLE001 - gzip, bz2 and zstd each raise their own error for foreign data
            if not f.compression:
                raise
            raise ValueError(f"{f.url}: not {f.compression} data ({e})") from None
    if f.kind == "text":
        try:
            codecs.getincrementaldecoder("utf-8")().decode(head, final=whole)
        except UnicodeDecodeError as e:
            raise ValueError(f"{f.url}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        return (), TEXT
    lines = head.split(b"\n")
    kind = None
    for n, line in enumerate(lines if whole else lines[:-1], start=1):  # the last, unless whole, is cut off
        if kind is None and line.strip():
            kind = _kind_of(line, key)
        try:
            record_text(line, key, kind or TEXT)
        except ValueError as e:
            raise ValueError(f"{f.url}:{n}: {e}") from None
    return (), kind or TEXT
