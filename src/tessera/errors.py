"""Errors that Tessera reports to its users.

Every error meant for a person (a bad model name, a broken config file) is a `TesseraError`; the CLI
prints its message without a traceback. Anything else is a bug and keeps its traceback.
"""


class TesseraError(Exception):
    """Base class of the errors Tessera reports to its users."""


class UnknownModelError(TesseraError):
    """A model name that is neither in the catalog nor a local model directory."""


class ConfigError(TesseraError):
    """A model config file that cannot be read, or lacks a field Tessera needs."""


class ShapeError(TesseraError, ValueError):
    """Shapes a model cannot take: batch < 1, a context beyond its positions, an image that does not tile."""


class PhaseError(TesseraError, ValueError):
    """A phase that the model's family does not have."""
