"""``anytrain info``: what ``hardware`` sees on this machine."""

from __future__ import annotations

import json

import typer


def info() -> None:
    """Devices, backends, versions and the peak FLOP/s anytrain will use for MFU."""
    from anytrain import hardware

    device = hardware.resolve_device("auto")
    typer.echo(json.dumps(hardware.summary(device), indent=1))


def register(app: typer.Typer) -> None:
    app.command("info")(info)
