"""Errors specfork raises: for bad user input (``SpecforkError``, a ``ValueError``), and
``EngineFailure`` when the engine itself cannot go on."""


class SpecforkError(ValueError):
    """Base class of every error specfork raises for bad input."""


class ModelLoadError(SpecforkError):
    """A model path, alias or file that cannot be loaded."""


class PromptError(SpecforkError):
    """A prompt that cannot be generated from (empty, too long, bad token ids)."""


class EngineFailure(RuntimeError):
    """The engine cannot go on (e.g. a tensor-parallel rank died): not one request's fault, so
    the engine's step raises it instead of failing the batch's requests."""
