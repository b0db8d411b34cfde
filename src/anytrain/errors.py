"""User-facing errors: the CLI prints them as one line and exits non-zero, without a traceback."""


class AnytrainError(Exception):
    """A problem with the user's input or environment that they can fix; the message names field/file and fix."""

    exit_code = 2


class ConfigError(AnytrainError):
    """A config field is unknown, of the wrong type, out of range, or inconsistent with another."""


class DataError(AnytrainError):
    """Input data or a prepared dataset is missing or malformed."""


class RunDirError(AnytrainError):
    """The run directory cannot be used as asked (e.g. it already holds a run)."""


class TrainingError(AnytrainError):
    """Training stopped for a reason the user must look at (e.g. a non-finite loss)."""

    exit_code = 3


def one_line(exc: BaseException) -> str:
    """An exception as one line of at most 300 characters: for a DCP failure (a ``CheckpointException``), the first
    failing rank's exception, not the gathered tracebacks."""
    failures = getattr(exc, "failures", None)
    if failures:
        exc = next(iter(failures.values()))[0]
    text = f"{type(exc).__name__}: {str(exc).strip() or 'a file ends early or cannot be read'}".splitlines()[0]
    return text if len(text) <= 300 else text[:297] + "..."
