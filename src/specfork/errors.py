"""Errors raised for bad user input. All are ``ValueError`` subclasses."""


class SpecforkError(ValueError):
    """Base class of every error specfork raises for bad input."""


class ModelLoadError(SpecforkError):
    """A model path, alias or file that cannot be loaded."""


class PromptError(SpecforkError):
    """A prompt that cannot be generated from (empty, too long, bad token ids)."""
