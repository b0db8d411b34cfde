"""``anytrain export`` and ``anytrain export-checkpoint``: a run's checkpoint as a Hugging Face model folder
(``evals/hf_export.py``), or consolidated into one safetensors file (``evals/__init__.py``)."""

from __future__ import annotations

import typer


def export(
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
    from anytrain.evals.hf_export import export_hf, parse_size

    if format != "hf":
        raise RunDirError(f"--format: expected hf, got {format!r} (anytrain's own format: export-checkpoint)")
    path = export_hf(
        source, out, dtype=dtype, overwrite=overwrite, tokenizer=tokenizer, max_shard_bytes=parse_size(max_shard_size)
    )
    typer.echo(f"wrote {path} (transformers: AutoModelForCausalLM.from_pretrained({str(path)!r}))")


def export_checkpoint(
    run_dir: str = typer.Argument(..., help="A run directory written by `anytrain train`."),
    out: str = typer.Option(..., "--out", "-o", help="Output file, ending in .safetensors (config: <name>.json)."),
    checkpoint: str = typer.Option(None, help="A specific checkpoint directory (default: the newest committed)."),
    dtype: str = typer.Option("fp32", help="Weights dtype in the file: fp32 or bf16."),
    overwrite: bool = typer.Option(False, help="Replace an existing output file and its .json."),
) -> None:
    """Consolidate a sharded DCP checkpoint into one safetensors file (plus <out>.json with the model config)."""
    from anytrain.evals import export_run

    path = export_run(run_dir, out, checkpoint=checkpoint, dtype=dtype, overwrite=overwrite)
    typer.echo(f"wrote {path} and {path.with_suffix('.json')}")


def register(app: typer.Typer) -> None:
    app.command("export")(export)
    app.command("export-checkpoint")(export_checkpoint)
