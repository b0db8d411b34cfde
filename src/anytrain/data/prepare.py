"""``anytrain prepare``: raw documents -> token shards, streamed in bounded memory, in parallel, resumable.

The main process reads the inputs (``data/readers.py``) into chunks of about ``chunk_bytes`` bytes: JSONL as raw
blocks of whole lines, other formats as documents. Worker processes (``workers``; 1 = this process) decode and parse
whole chunks and tokenize them (:class:`TextEncoder`), and the main process appends each chunk's tokens to the shards
in chunk order, so the output does not depend on the worker count. A document goes to the validation split when a
hash of its source name falls below ``val_fraction``, so the split does not depend on file order or workers either.
Each document is encoded with a byte-level BPE tokenizer (a given ``tokenizer.json``, or one trained here on a sample
of the training documents of about ``tokenizer_sample_bytes``) and followed by EOS.

The dataset is built in the hidden sibling folder ``.<out>.prepare-partial`` and renamed onto ``out`` when complete.
That folder's ``progress.json`` (written atomically at every shard boundary and at least every
:data:`COMMIT_SECONDS`) records the finished shards, the open shard's committed size and the input position after the
last committed chunk; ``resume`` cuts the shards back to it and continues from that position. An interrupt keeps the
folder for ``--resume``; an error (bad input, full disk) removes it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from anytrain.data.encoding import TextEncoder
from anytrain.data.readers import (
    EMBEDDED,
    ENCODING_ERRORS,
    Document,
    InputFile,
    Position,
    embedded_corpus_dir,
    item_documents,
    iter_file,
    iter_items,
    list_inputs,
)
from anytrain.data.shards import INDEX, ShardWriter, token_dtype, write_index
from anytrain.diskio import disk_full_as_error, missing_parents, move_into_place, remove, write_text_atomic
from anytrain.errors import DataError

__all__ = ["prepare", "load_tokenizer", "train_tokenizer", "embedded_corpus_dir", "Document", "EMBEDDED", "MARKER"]

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|pad|>"]
MARKER = ".anytrain-dataset.json"  # written first into every dataset folder; --overwrite replaces only such folders
PROGRESS = "progress.json"
LOCK = ".lock"
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # the byte alphabet plus the special tokens
MAX_VOCAB = 2**32
COMMIT_SECONDS = 10.0  # at most this long between progress commits (plus one at every shard boundary)
KILL_AT_CHUNK = "ANYTRAIN_TEST_KILL_PREPARE_AT_CHUNK"  # test hook: SIGKILL after writing that chunk, before its commit


class PrepareInterrupted(DataError):
    """Ctrl-C during prepare: the finished part is kept for ``--resume``."""

    exit_code = 130


def is_validation(doc: Document, val_fraction: float) -> bool:
    """Deterministic split: a document goes to validation when its name hashes below ``val_fraction``."""
    return _name_hash(doc.source) < val_fraction


def _name_hash(source: str) -> float:
    return int.from_bytes(hashlib.sha256(source.encode()).digest()[:8], "little") / 2**64


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


def _sample_texts(files: list[InputFile], budget: int, opts: dict, forced_val: str | None, failure: list):
    """Training-split texts for the tokenizer: every one when the inputs total at most ``budget`` bytes, else each
    file's leading documents up to its share of ``budget`` (its size / total size). A reading error stops the
    iterator and is kept in ``failure`` (re-raised by the caller: the trainer runs the iterator from Rust)."""
    total = sum(f.size for f in files)
    try:
        for index, f in enumerate(files):
            share, taken = (None if budget >= total else budget * f.size / max(total, 1)), 0
            for doc, _ in iter_file(f, index, None, opts["text_field"], opts["encoding_errors"]):
                if doc.text is None or is_validation(doc, opts["val_fraction"]) or doc.source == forced_val:
                    continue
                if share is not None and taken >= share:
                    break
                taken += len(doc.text)
                yield doc.text
    except BaseException as exc:
        failure.append(exc)


# ---------------------------------------------------------------------------------------------------------------------
# Workers: one chunk of input items -> the tokens of each split

_worker: dict = {}


def _init_worker(
    tokenizer_file: str,
    val_fraction: float,
    forced_val: str | None,
    batch_docs: int,
    text_field: str,
    encoding_errors: str,
    separate_process: bool,
) -> None:
    if separate_process:  # one tokenizer thread per worker process; exit when the main process dies (kill -9)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle (it stops the pool)
        parent = os.getppid()
        threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    tokenizer = load_tokenizer(tokenizer_file)
    dtype = token_dtype(tokenizer.get_vocab_size(with_added_tokens=True))
    eos = np.array([_eos_id(tokenizer, tokenizer_file)], dtype=dtype).tobytes()
    _worker.update(
        encoder=TextEncoder(tokenizer, dtype, batch_docs),
        eos=eos,
        val_fraction=val_fraction,
        forced_val=forced_val,
        text_field=text_field,
        encoding_errors=encoding_errors,
    )


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _encode_chunk(items: list[tuple]) -> dict:
    """Decode and parse the chunk's items; the tokens (bytes: each document's ids, then EOS) and document counts of
    each split, the null texts skipped, and the chunk's lowest-hash document name."""
    w = _worker
    docs = item_documents(items, w["text_field"], w["encoding_errors"])
    texts = [(source, text) for source, text in docs if text is not None]
    hashes = [_name_hash(source) for source, _ in texts]
    tokens: dict[str, list[bytes]] = {"train": [], "val": []}
    for (source, _), name_hash, ids in zip(texts, hashes, w["encoder"]([t for _, t in texts]), strict=True):
        split = tokens["val" if source == w["forced_val"] or name_hash < w["val_fraction"] else "train"]
        split.append(ids)
        split.append(w["eos"])
    return {
        "tokens": {k: b"".join(v) for k, v in tokens.items()},
        "documents": {k: len(v) // 2 for k, v in tokens.items()},
        "nulls": len(docs) - len(texts),
        "lowest": min(zip(hashes, (s for s, _ in texts), strict=True)) if texts else None,
    }


class _Encoder:
    """Runs :func:`_encode_chunk` over chunks in order: here (one worker) or in a pool of forked processes, with at
    most two chunks per worker in flight (bounded memory)."""

    def __init__(self, workers: int, init_args: tuple) -> None:
        self.workers, self.pool = workers, None
        if workers == 1:
            _init_worker(*init_args, False)
            return
        import multiprocessing

        # fork: no re-import of the caller's main module (the CLI's imports take seconds); the variable, set while
        # forking, keeps tokenizers from warning in the children that its threads were used before the fork
        context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
        saved = os.environ.get("TOKENIZERS_PARALLELISM")
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        try:
            self.pool = context.Pool(workers, _init_worker, (*init_args, True))
        finally:
            if saved is None:
                del os.environ["TOKENIZERS_PARALLELISM"]
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = saved

    def run(self, chunks: Iterator[tuple[list, Position]]) -> Iterator[tuple[dict, Position]]:
        if self.pool is None:
            for items, end in chunks:
                yield _encode_chunk(items), end
            return
        pending: deque = deque()
        for items, end in chunks:
            pending.append((self.pool.apply_async(_encode_chunk, (items,)), end))
            if len(pending) >= 2 * self.workers:
                result, e = pending.popleft()
                yield result.get(), e
        while pending:
            result, e = pending.popleft()
            yield result.get(), e

    def close(self, ok: bool) -> None:
        if self.pool is not None:
            if ok:
                self.pool.close()
            else:
                self.pool.terminate()
            self.pool.join()


def _chunks(files: list[InputFile], start: Position | None, opts: dict, chunk_bytes: int):
    """``(items, position after the chunk)``: input items (:func:`iter_items`) of about ``chunk_bytes`` bytes each,
    read but not decoded or parsed (that is the workers' job)."""
    items: list[tuple] = []
    size = 0
    end = start
    for item, n, end in iter_items(files, start, opts["text_field"], opts["encoding_errors"], chunk_bytes):
        items.append(item)
        size += n
        if size >= chunk_bytes:
            yield items, end
            items, size = [], 0
    if items:
        yield items, end


# ---------------------------------------------------------------------------------------------------------------------
# Checks


def check_options(
    vocab_size: int,
    val_fraction: float,
    shard_tokens: int,
    text_field: str,
    batch_docs: int,
    encoding_errors: str,
    tokenizer_path: str | None,
    workers: int = 1,
    tokenizer_sample_bytes: int = 1,
    chunk_bytes: int = 1,
) -> None:
    """Refuse out-of-range prepare options before anything is read or written."""
    if tokenizer_path is None and not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise DataError(
            f"--vocab-size: must be at least {MIN_VOCAB} (256 byte tokens + {len(SPECIAL_TOKENS)} "
            f"special tokens) and at most {MAX_VOCAB}, got {vocab_size}"
        )
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction: must be in (0, 1), got {val_fraction}")
    for name, value in (
        ("--shard-tokens", shard_tokens),
        ("batch_docs", batch_docs),
        ("--workers", workers),
        ("--tokenizer-sample-bytes", tokenizer_sample_bytes),
        ("chunk_bytes", chunk_bytes),
    ):
        if value < 1:
            raise DataError(f"{name}: must be >= 1, got {value}")
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
        raise DataError(
            f"{out}: not empty and not a dataset written by anytrain prepare (no {MARKER}); refusing to "
            "delete it even with --overwrite; pick another --out"
        )


def partial_dir(out: Path) -> Path:
    """The hidden sibling folder an unfinished dataset is built in (kept by an interrupt for ``--resume``)."""
    return out.parent / f".{out.name}.prepare-partial"


def _lock(folder: Path):
    """An exclusive lock on ``folder`` held for the life of the returned file; one line if another prepare holds it."""
    fh = open(folder / LOCK, "a")  # noqa: SIM115 - kept open to hold the lock
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        raise DataError(f"{folder}: another anytrain prepare is writing this dataset; wait for it or stop it") from None
    return fh


def _settings_change(old: dict, new: dict) -> str | None:
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            return key
    return None


# ---------------------------------------------------------------------------------------------------------------------
# Driver


class _Run:
    """One prepare into ``self.partial``: tokenizer, the tokenizing pass (resumable), the index."""

    def __init__(
        self,
        partial: Path,
        files: list[InputFile],
        opts: dict,
        settings: dict,
        given_tokenizer,
        workers: int,
        chunk_bytes: int,
        show_progress: bool,
    ) -> None:
        self.partial, self.files, self.opts, self.settings = partial, files, opts, settings
        self.given, self.workers, self.chunk_bytes, self.show_progress = (
            given_tokenizer,
            workers,
            chunk_bytes,
            (show_progress),
        )
        self.total_bytes = sum(f.size for f in files)
        self.whole_sample = opts["tokenizer_sample_bytes"] >= self.total_bytes

    # state ------------------------------------------------------------------------------------------------------------

    def _fresh(self, forced_val: str | None) -> dict:
        """Empty the folder (but the lock), write the marker and the tokenizer, commit an empty progress."""
        (self.partial / PROGRESS).unlink(missing_ok=True)
        for path in self.partial.iterdir():
            if path.name != LOCK:
                remove(path)
        (self.partial / MARKER).write_text(json.dumps({"written_by": "anytrain prepare", "format": 1}) + "\n")
        tokenizer = self.given if self.given is not None else self._train_tokenizer(forced_val)
        tokenizer.save(str(self.partial / "tokenizer.json"))
        state = {
            "settings": self.settings,
            "forced_val": forced_val,
            "chunks": 0,
            "position": None,
            "documents": {"train": 0, "val": 0},
            "skipped_null": 0,
            "lowest": None,
            "shards": {"train": [], "val": []},
        }
        write_text_atomic(self.partial / PROGRESS, json.dumps(state))
        return state

    def _train_tokenizer(self, forced_val: str | None):
        budget = self.opts["tokenizer_sample_bytes"]
        what = "all training documents" if self.whole_sample else f"a sample of about {budget / 1e6:,.0f} MB"
        if self.show_progress:
            print(f"training a {self.opts['vocab_size']}-token tokenizer on {what}", file=sys.stderr)
        failure: list = []
        tokenizer = train_tokenizer(
            _sample_texts(self.files, budget, self.opts, forced_val, failure), self.opts["vocab_size"]
        )
        if failure:
            raise failure[0]
        return tokenizer

    def _commit(self, state: dict, writers: dict[str, ShardWriter]) -> None:
        for writer in writers.values():
            writer.flush()
        state["shards"] = {name: [dict(s) for s in w.shards] for name, w in writers.items()}
        write_text_atomic(self.partial / PROGRESS, json.dumps(state))

    # passes -----------------------------------------------------------------------------------------------------------

    def run(self, state: dict | None) -> dict:
        if state is None:
            state = self._fresh(None)
        state = self._tokenize(state)
        if state["documents"]["val"] == 0:  # no name hashed into validation: hold out the lowest-hash document
            if not self.whole_sample or state["lowest"] is None or state["forced_val"] is not None:
                raise DataError(
                    f"{', '.join(self.opts['inputs'])}: no document went to validation; raise --val-fraction"
                )
            state = self._tokenize(self._fresh(state["lowest"][1]))  # a small corpus: prepare it again
        if state["documents"]["train"] == 0:
            raise DataError(
                f"{', '.join(self.opts['inputs'])}: every document went to validation; add data or lower --val-fraction"
            )
        return self._write_index(state)

    def _tokenize(self, state: dict) -> dict:
        """The tokenizing pass from the committed position to the end of the inputs."""
        tokenizer_file = self.partial / "tokenizer.json"
        tokenizer = load_tokenizer(tokenizer_file)
        dtype = token_dtype(tokenizer.get_vocab_size(with_added_tokens=True))
        shard_tokens = self.opts["shard_tokens"]
        writers = {
            name: ShardWriter.resume(self.partial, name, dtype, shard_tokens, state["shards"][name])
            for name in ("train", "val")
        }
        start = Position.from_list(state["position"]) if state["position"] else None
        kill_at = int(os.environ.get(KILL_AT_CHUNK, "0"))
        encoder = _Encoder(
            self.workers,
            (
                str(tokenizer_file),
                self.opts["val_fraction"],
                state["forced_val"],
                self.opts["batch_docs"],
                self.opts["text_field"],
                self.opts["encoding_errors"],
            ),
        )
        bar = _ProgressBar(self.total_bytes, self.files, state, self.show_progress)
        ok, last_commit = False, time.monotonic()
        try:
            for result, end in encoder.run(_chunks(self.files, start, self.opts, self.chunk_bytes)):
                shards_before = sum(len(w.shards) for w in writers.values())
                tokens = {name: np.frombuffer(result["tokens"][name], dtype=dtype) for name in writers}
                for name, writer in writers.items():
                    writer.write(tokens[name])
                    state["documents"][name] += result["documents"][name]
                state["skipped_null"] += result["nulls"]
                if result["lowest"] is not None and (
                    state["lowest"] is None or result["lowest"] < tuple(state["lowest"])
                ):
                    state["lowest"] = list(result["lowest"])
                state["chunks"] += 1
                state["position"] = end.to_list()
                bar.update(end, state, sum(int(t.size) for t in tokens.values()))
                if state["chunks"] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                shard_closed = sum(len(w.shards) for w in writers.values()) != shards_before
                if shard_closed or time.monotonic() - last_commit >= COMMIT_SECONDS:
                    self._commit(state, writers)
                    last_commit = time.monotonic()
            ok = True
        finally:
            encoder.close(ok)
            bar.close()
            for writer in writers.values():
                writer.close()
        self._commit(state, writers)
        return state

    def _write_index(self, state: dict) -> dict:
        tokenizer = load_tokenizer(self.partial / "tokenizer.json")
        vocab = tokenizer.get_vocab_size(with_added_tokens=True)
        eos = _eos_id(tokenizer, self.opts["tokenizer_hint"])
        stats = {
            name: {"documents": state["documents"][name], "tokens": sum(s["tokens"] for s in shards)}
            for name, shards in state["shards"].items()
        }
        meta = {
            "inputs": self.opts["inputs"],
            "val_fraction": self.opts["val_fraction"],
            "skipped_null": state["skipped_null"],
            "stats": stats,
        }
        write_index(self.partial, token_dtype(vocab), vocab, eos, state["shards"], meta)
        (self.partial / PROGRESS).unlink()
        return json.loads((self.partial / INDEX).read_text())


class _ProgressBar:
    """A rich progress bar on stderr (input bytes, documents, tokens, MB/s, ETA); nothing when ``show`` is False."""

    def __init__(self, total_bytes: int, files: list[InputFile], state: dict, show: bool) -> None:
        self.progress = None
        if not show:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.before = np.cumsum([0] + [f.size for f in files])  # bytes of the inputs before each one
        self.tokens = sum(s["tokens"] for shards in state["shards"].values() for s in shards)
        self.progress = Progress(
            TextColumn("tokenizing"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TextColumn("{task.fields[docs]:,} docs {task.fields[tokens]:,} tokens"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        done = self._done(Position.from_list(state["position"])) if state["position"] else 0
        self.task = self.progress.add_task(
            "prepare", total=total_bytes, completed=done, docs=sum(state["documents"].values()), tokens=self.tokens
        )
        self.progress.start()

    def _done(self, position: Position) -> int:
        return int(self.before[position.file]) + position.done

    def update(self, end: Position, state: dict, tokens: int) -> None:
        if self.progress is not None:
            self.tokens += tokens
            self.progress.update(
                self.task, completed=self._done(end), docs=sum(state["documents"].values()), tokens=self.tokens
            )

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def _open_partial(partial: Path, settings: dict, resume: bool, overwrite: bool, out: Path):
    """``(lock, committed state or None)`` for the build folder: a leftover one is continued with ``resume`` (when
    its settings match), discarded with ``overwrite``, refused otherwise."""
    if partial.is_dir() and not (partial / MARKER).is_file() and any(p.name != LOCK for p in partial.iterdir()):
        raise DataError(f"{partial}: exists and was not written by anytrain prepare; move it away")
    existed = partial.is_dir()
    partial.mkdir(exist_ok=True)
    lock = _lock(partial)
    progress = partial / PROGRESS
    if not existed or not progress.is_file():
        return lock, None
    if not resume and not overwrite:
        lock.close()
        raise DataError(
            f"{out}: an interrupted prepare is in {partial}; pass --resume to continue it or --overwrite to start over"
        )
    if not resume:
        return lock, None
    state = json.loads(progress.read_text())
    changed = _settings_change(state["settings"], settings)
    if changed is not None:
        lock.close()
        raise DataError(
            f"--resume: the interrupted prepare in {partial} was started with another {changed}; run the "
            "same command as before, or pass --overwrite instead of --resume to start over"
        )
    return lock, state


def prepare(
    inputs: list[str],
    out_dir: str | Path,
    tokenizer_path: str | None = None,
    vocab_size: int = 8192,
    val_fraction: float = 0.05,
    text_field: str = "text",
    shard_tokens: int = 100_000_000,
    overwrite: bool = False,
    batch_docs: int = 256,
    encoding_errors: str = "strict",
    workers: int = 1,
    resume: bool = False,
    tokenizer_sample_bytes: int = 1_000_000_000,
    chunk_bytes: int = 4 << 20,
    progress: bool | None = None,
) -> dict:
    """Tokenize ``inputs`` into ``out_dir``; returns the index written. The dataset is built in
    :func:`partial_dir` and renamed onto ``out_dir`` when complete: a failure leaves ``out_dir`` as it was. An
    existing non-empty ``out_dir`` is replaced only with ``overwrite`` and only if it carries :data:`MARKER`.
    ``progress`` (default: stderr is a terminal) shows a progress bar."""
    out = Path(out_dir)
    check_options(
        vocab_size,
        val_fraction,
        shard_tokens,
        text_field,
        batch_docs,
        encoding_errors,
        tokenizer_path,
        workers,
        tokenizer_sample_bytes,
        chunk_bytes,
    )
    check_out_dir(out, overwrite)
    given = load_tokenizer(tokenizer_path) if tokenizer_path else None
    files = list_inputs(inputs)
    if not files:
        raise DataError(f"{', '.join(inputs)}: no documents found")
    opts = {
        "inputs": inputs,
        "vocab_size": vocab_size,
        "val_fraction": val_fraction,
        "text_field": text_field,
        "shard_tokens": shard_tokens,
        "batch_docs": batch_docs,
        "encoding_errors": "replace" if inputs == [EMBEDDED] else encoding_errors,
        "tokenizer_sample_bytes": tokenizer_sample_bytes,
        "tokenizer_hint": tokenizer_path or "trained tokenizer",
    }
    tokenizer_hash = hashlib.sha256(Path(tokenizer_path).read_bytes()).hexdigest() if given else None
    settings = {
        **{k: v for k, v in opts.items() if k not in ("batch_docs", "tokenizer_hint")},
        "files": [f.fingerprint() for f in files],
        "vocab_size": None if given else vocab_size,
        "tokenizer": tokenizer_hash,
    }
    created = missing_parents(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_dir(out)
    lock, state = _open_partial(partial, settings, resume, overwrite, out)
    show = sys.stderr.isatty() if progress is None else progress
    run = _Run(partial, files, opts, settings, given, workers, chunk_bytes, show)
    try:
        with disk_full_as_error(out):
            index = run.run(state)
    except KeyboardInterrupt:
        lock.close()
        raise PrepareInterrupted(
            f"interrupted; the finished shards are kept in {partial}: run the same command with --resume to continue"
        ) from None
    except BaseException:
        lock.close()
        remove(partial)
        if created is not None:
            remove(created)
        raise
    (partial / LOCK).unlink()
    lock.close()
    _move_into_place(partial, out, overwrite)
    return index


def _move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished folder onto ``out``; a replaced dataset is removed only after the new one is in place."""
    try:
        check_out_dir(out, overwrite)  # again: the folder may have changed while we tokenized
    except BaseException:
        remove(tmp)
        raise
    move_into_place(tmp, out)
