"""specfork: an inference engine for exact speculative decoding."""

from specfork.errors import ModelLoadError, PromptError, SpecforkError
from specfork.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "SpecforkError", "ModelLoadError", "PromptError", "RequestOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the loaders; import it lazily so `specfork --help` stays fast.
    if name == "LLM":
        from specfork.llm import LLM

        return LLM
    if name == "RequestOutput":
        from specfork.outputs import RequestOutput

        return RequestOutput
    raise AttributeError(f"module 'specfork' has no attribute {name!r}")
