"""``anytrain export``: a run's checkpoint as a Hugging Face model folder (``--format hf``) or as one safetensors file
with anytrain's own names (``--format safetensors``), both written by ``checkpoint/export.py``;
``anytrain export-checkpoint`` is the deprecated alias of the second."""

from __future__ import annotations

from pathlib import Path

import typer


def _wrote(path: Path, format: str) -> str:
    if format == "hf":
        return f"wrote {path} (transformers: AutoModelForCausalLM.from_pretrained({str(path)!r}))"
    return f"wrote {path} and {path.with_suffix('.json')}"


def export(
    source: str = typer.Argument(..., help="A run directory, or one of its checkpoints/step_* directories."),
    out: str = typer.Option(
        ...,
        "--out",
        "-o",
        help="hf: the output directory (created; refused if it holds other files); safetensors: the output file, "
        "ending in .safetensors (config: <name>.json).",
    ),
    format: str = typer.Option(
        "hf",
        "--format",
        help="Output format: hf (transformers' from_pretrained folder) or safetensors (one file, anytrain's names).",
    ),
    checkpoint: str = typer.Option(
        None, help="With a run directory: a specific checkpoint directory (default: the newest committed)."
    ),
    dtype: str = typer.Option("fp32", help="Weights dtype: fp32 or bf16."),
    tokenizer: str = typer.Option(None, help="hf: tokenizer.json to ship (default: the one in the run's data.path)."),
    max_shard_size: str = typer.Option(
        None, help="hf: largest safetensors file (default 5GB); bigger models are sharded."
    ),
    overwrite: bool = typer.Option(False, help="Replace an earlier `anytrain export` in --out."),
) -> None:
    """Write a checkpoint as a Hugging Face model folder: safetensors, config.json, generation_config.json and the
    tokenizer (loads with AutoModelForCausalLM / AutoTokenizer.from_pretrained); with --format safetensors, as one
    safetensors file with anytrain's parameter names (plus <out>.json with the model config)."""
    from anytrain.checkpoint.export import export as run_export

    path = run_export(source, out, format, checkpoint, dtype, overwrite, tokenizer, max_shard_size)
    typer.echo(_wrote(path, format))


def export_checkpoint(
    run_dir: str = typer.Argument(..., help="A run directory written by `anytrain train`."),
    out: str = typer.Option(..., "--out", "-o", help="Output file, ending in .safetensors (config: <name>.json)."),
    checkpoint: str = typer.Option(None, help="A specific checkpoint directory (default: the newest committed)."),
    dtype: str = typer.Option("fp32", help="Weights dtype in the file: fp32 or bf16."),
    overwrite: bool = typer.Option(False, help="Replace an existing output file and its .json."),
) -> None:
    """Deprecated: `anytrain export RUN --format safetensors --out FILE`. Consolidate a sharded DCP checkpoint into one
    safetensors file (plus <out>.json with the model config)."""
    from anytrain.checkpoint.export import export as run_export

    typer.echo(
        "warning: `anytrain export-checkpoint` is deprecated; "
        "use `anytrain export RUN --format safetensors --out FILE`",
        err=True,
    )
    path = run_export(run_dir, out, "safetensors", checkpoint, dtype, overwrite)
    typer.echo(_wrote(path, "safetensors"))


def register(app: typer.Typer) -> None:
    app.command("export")(export)
    app.command("export-checkpoint")(export_checkpoint)
