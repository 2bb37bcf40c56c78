"""Errors specfork raises: for bad user input (``SpecforkError``, a ``ValueError``), and
``EngineFailure`` when the engine itself cannot go on."""


class SpecforkError(ValueError):
    """Base class of every error specfork raises for bad input; ``param`` names the request
    parameter at fault where one is (the server returns it in its error body)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelLoadError(SpecforkError):
    """A model path, alias or file that cannot be loaded."""


class MissingTensorError(ModelLoadError):
    """A checkpoint lacks a tensor the model needs (``name`` in HF spelling)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"checkpoint is missing the tensor {name!r}")
        self.name = name


class PromptError(SpecforkError):
    """A prompt that cannot be generated from (empty, too long, bad token ids)."""


class EngineFailure(RuntimeError):
    """The engine cannot go on (e.g. a tensor-parallel rank died): not one request's fault, so
    the engine's step raises it instead of failing the batch's requests."""
