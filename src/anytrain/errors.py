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
