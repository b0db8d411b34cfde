"""``anytrain <verb>``, one module per verb group:

- ``data``: ``prepare`` (raw text -> token shards), ``prepare-sft`` (fine-tuning examples -> token + loss-mask shards)
- ``train``: ``train`` (run a recipe), ``status`` (how a run's last invocation ended)
- ``evaluate``: ``eval`` (validation loss, sample, downstream tasks), ``compare`` (loss curves of several runs)
- ``export``: ``export`` (a Hugging Face model folder, or one safetensors file), ``export-checkpoint`` (the
  deprecated alias of ``export --format safetensors``)
- ``plan``: ``plan`` (rank parallel layouts with the cost model, or size the job)
- ``launch``: ``launch slurm`` (an sbatch script), ``launch mpi`` (an mpirun line)
- ``doctor``: ``doctor`` (validate a machine or cluster)
- ``info``: ``info`` (devices, backends, versions, peak FLOP/s)

Each module defines ``register(app)``, which adds its verbs to the one Typer ``app``; ``VERB_GROUPS`` lists them in
the order ``anytrain --help`` shows them. The modules only parse arguments, call the library and print; nothing
outside this package imports it. User errors (:class:`~anytrain.errors.AnytrainError`) print one ``error: ...`` line
and exit non-zero.
"""

from __future__ import annotations

import sys

import typer

from anytrain.cli import data, doctor, evaluate, export, info, launch, plan, train
from anytrain.errors import AnytrainError

VERB_GROUPS = (data, train, evaluate, export, plan, launch, doctor, info)

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Pre-train language models on any accelerator.")
for group in VERB_GROUPS:
    group.register(app)


def main() -> None:
    try:
        code = app(standalone_mode=False)  # a command's typer.Exit(code) comes back as its return value
    except AnytrainError as exc:  # a clean stop (SIGTERM / SIGINT, checkpoint saved) is not an error: "stopped: ..."
        print(f"{'stopped' if getattr(exc, 'clean_stop', False) else 'error'}: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("aborted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # usage errors of typer's click (the click package, or the copy newer typers vendor)
        kinds = {c.__name__ for c in type(exc).__mro__}
        if "Exit" in kinds and hasattr(exc, "exit_code"):
            sys.exit(exc.exit_code)
        if "ClickException" in kinds:
            exc.show()
            sys.exit(exc.exit_code)
        raise
    if isinstance(code, int) and code:
        sys.exit(code)


if __name__ == "__main__":
    main()
