"""Errors a user can fix. Every package may raise these; the CLI prints them as one sentence plus
what to do, exit code 2, without a traceback. Anything else is a bug and keeps its traceback."""


class UserError(Exception):
    """Bad input (config, data, checkpoint, environment): the message says what to change."""


class ConfigError(UserError):
    """An invalid configuration value, reported before any model is loaded."""


class DataError(UserError):
    """A bad dataset row or source: names the file, the row and the problem."""


class CheckpointError(UserError):
    """A missing, mismatched or corrupted checkpoint: lists what is wrong by name."""
