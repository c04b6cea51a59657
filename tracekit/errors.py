"""Named errors raised by tracekit's core; the CLI turns them into one-line messages."""


class TracekitError(Exception):
    """Base of every error tracekit expects and reports without a traceback; the CLI exits with
    `exit_code` (2: the input could not be used; 1: the work itself failed)."""

    exit_code = 2


class ConfigError(TracekitError, ValueError):
    """Raised when a trainer option or combination of options is impossible."""


class DataError(TracekitError):
    """Raised when an input data file is missing or malformed; names the file and line."""


class PolicyMismatch(TracekitError):
    """Raised when a policy file does not match the model it is applied to."""


class RunNotFound(TracekitError):
    """Raised when a run directory or its manifest.json does not exist."""


class SchemaVersionError(TracekitError):
    """Raised when a trace file was written with a schema major version this tracekit cannot read."""


class RunMismatch(TracekitError):
    """Raised when runs compared were recorded from different models; names both runs and what differs."""
