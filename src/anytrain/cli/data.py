"""``anytrain prepare`` and ``anytrain prepare-sft``: raw text and fine-tuning examples into token shards
(``data/prepare.py``, ``data/sft.py``)."""

from __future__ import annotations

import typer


def prepare(
    inputs: list[str] = typer.Argument(
        ...,
        help="Files or folders (.txt, .jsonl[.gz|.zst], .parquet, a datasets save_to_disk folder), or 'shakespeare'.",
    ),
    out: str = typer.Option(..., "--out", "-o", help="Output directory for shards, index.json and tokenizer.json."),
    tokenizer: str = typer.Option(None, help="Existing tokenizer.json to use instead of training one."),
    vocab_size: int = typer.Option(8192, help="Vocabulary size when training a tokenizer."),
    val_fraction: float = typer.Option(0.05, help="Fraction of documents held out for validation."),
    text_field: str = typer.Option("text", help="Field/column holding the text in .jsonl, .parquet, datasets inputs."),
    shard_tokens: int = typer.Option(100_000_000, help="Maximum tokens per shard file."),
    overwrite: bool = typer.Option(False, help="Replace an existing dataset (or an interrupted prepare) in --out."),
    encoding_errors: str = typer.Option("strict", help="Text that is not UTF-8: strict (refuse) or replace (U+FFFD)."),
    workers: int = typer.Option(1, help="Tokenizer processes (1 = this process); the output is the same for any."),
    resume: bool = typer.Option(False, help="Continue an interrupted prepare of the same inputs and options."),
    tokenizer_sample_bytes: int = typer.Option(
        1_000_000_000,
        help="Train the tokenizer on about this many bytes, a share of each input file (all of a smaller corpus).",
    ),
) -> None:
    """Tokenize raw text into memory-mapped token shards with a validation split, streaming (bounded memory), with a
    progress bar on a terminal. Null texts are skipped."""
    import time

    from anytrain.data.prepare import prepare as run_prepare

    started = time.perf_counter()
    index = run_prepare(
        inputs,
        out,
        tokenizer,
        vocab_size,
        val_fraction,
        text_field,
        shard_tokens,
        overwrite,
        encoding_errors=encoding_errors,
        workers=workers,
        resume=resume,
        tokenizer_sample_bytes=tokenizer_sample_bytes,
    )
    seconds = time.perf_counter() - started
    stats, skipped = index["meta"]["stats"], index["meta"]["skipped_null"]
    tokens = stats["train"]["tokens"] + stats["val"]["tokens"]
    typer.echo(
        f"prepared {out}: vocab {index['vocab_size']} ({index['dtype']}), "
        f"train {stats['train']['tokens']:,} tokens / {stats['train']['documents']} docs, "
        f"val {stats['val']['tokens']:,} tokens / {stats['val']['documents']} docs"
        + (f", {skipped} null texts skipped" if skipped else "")
        + f"; {seconds:.1f} s, {tokens / max(seconds, 1e-9):,.0f} tokens/s"
    )


def prepare_sft(
    inputs: list[str] = typer.Argument(..., help='JSONL files or folders: {"text"} or {"prompt", "completion"}.'),
    out: str = typer.Option(..., "--out", "-o", help="Output directory (token + loss-mask shards, index.json)."),
    tokenizer: str = typer.Option(..., help="The model's tokenizer.json, or its folder (e.g. the model.hf_path)."),
    layout: str = typer.Option("pack", help="pack (examples back to back) or pad (each example starts a window)."),
    seq_len: int = typer.Option(0, help="With --layout pad: the training data.seq_len."),
    val_fraction: float = typer.Option(0.05, help="Fraction of examples held out for validation."),
    shard_tokens: int = typer.Option(100_000_000, help="Maximum tokens per shard file."),
    overwrite: bool = typer.Option(False, help="Replace an existing dataset that anytrain wrote in --out."),
) -> None:
    """Tokenize supervised fine-tuning examples; training then counts the loss on completion tokens only
    (docs/hf-models.md)."""
    from anytrain.data.sft import prepare_sft as run_prepare_sft

    index = run_prepare_sft(inputs, out, tokenizer, val_fraction, layout, seq_len, shard_tokens, overwrite)
    splits = ", ".join(
        f"{name} {s['examples']} examples / {s['tokens']:,} tokens ({s['trained_tokens']:,} trained)"
        for name, s in index["meta"]["stats"].items()
    )
    typer.echo(f"prepared {out} ({layout}): vocab {index['vocab_size']}, " + splits)


def register(app: typer.Typer) -> None:
    app.command("prepare")(prepare)
    app.command("prepare-sft")(prepare_sft)
