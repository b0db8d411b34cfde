"""CLI verbs of the evaluation package (``anytrain export``, ``anytrain compare``), registered by ``cli.py``; the work
is done in ``evals/hf.py`` and ``evals/compare.py``."""

from __future__ import annotations

import typer


def export_command(
    source: str = typer.Argument(..., help="A run directory, or one of its checkpoints/step_* directories."),
    out: str = typer.Option(..., "--out", "-o", help="Output directory (created; refused if it holds other files)."),
    format: str = typer.Option("hf", "--format", help="Output format: hf (transformers' from_pretrained folder)."),
    dtype: str = typer.Option("fp32", help="Weights dtype: fp32 or bf16."),
    tokenizer: str = typer.Option(None, help="tokenizer.json to ship (default: the one in the run's data.path)."),
    max_shard_size: str = typer.Option("5GB", help="Largest safetensors file; bigger models are sharded."),
    overwrite: bool = typer.Option(False, help="Replace an earlier `anytrain export` in --out."),
) -> None:
    """Write a checkpoint as a Hugging Face model folder: safetensors, config.json, generation_config.json and the
    tokenizer (loads with AutoModelForCausalLM / AutoTokenizer.from_pretrained)."""
    from anytrain.errors import RunDirError
    from anytrain.evals.hf import export_hf, parse_size

    if format != "hf":
        raise RunDirError(f"--format: expected hf, got {format!r} (anytrain's own format: export-checkpoint)")
    path = export_hf(source, out, dtype=dtype, overwrite=overwrite, tokenizer=tokenizer,
                     max_shard_bytes=parse_size(max_shard_size))  # fmt: skip
    typer.echo(f"wrote {path} (transformers: AutoModelForCausalLM.from_pretrained({str(path)!r}))")


def register(app: typer.Typer) -> None:
    """Add this package's verbs to the ``anytrain`` app."""
    app.command("export")(export_command)
