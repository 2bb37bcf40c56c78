"""The OpenAI request bodies specfork accepts, validated strictly, and the error they raise."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ApiError(Exception):
    """An error answered as an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


# Fields of the OpenAI API that specfork does not implement: accepted at their neutral value,
# refused with a clear message otherwise (silently ignoring them would change what users get).
_NEUTRAL = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "functions": (None, []),
    "response_format": (None, {"type": "text"}),
}


class GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens (extension; 0 = off)")
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="keep generating after EOS (extension, as in vLLM)")
    user: str | None = None
    return_token_ids: bool = Field(False, description="add the generated token ids to each choice (extension)")

    @model_validator(mode="after")
    def _supported(self):
        if self.n != 1:
            raise ValueError(f"n must be 1 (specfork returns one choice per request), got {self.n}")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        for name, neutral in _NEUTRAL.items():
            value = (self.model_extra or {}).get(name)
            if value not in neutral:
                raise ValueError(f"'{name}' is not supported by this server")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str]

    @model_validator(mode="after")
    def _one_prompt(self):
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise ValueError("prompt is empty")
            if isinstance(self.prompt[0], str):
                if len(self.prompt) != 1:
                    raise ValueError("send one prompt per request (batched prompts are not supported)")
                self.prompt = self.prompt[0]
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_message(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_request(model: type[BaseModel], body: object) -> BaseModel:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in first["loc"] if not str(p).startswith("function-after"))
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "missing":
            message = f"'{loc}' is required"
        elif loc:
            got = f" (got {_short(first['input'])})" if "input" in first else ""
            message = f"{loc}: {message}{got}"
        raise ApiError(400, message, param=loc or None) from None


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
