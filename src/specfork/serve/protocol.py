"""The OpenAI request bodies specfork accepts, validated strictly, and the error they raise."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticUndefined

from specfork.sampling_params import MAX_LOGPROBS

MAX_CHOICES = 128  # n, as the OpenAI API


class ApiError(Exception):
    """An error answered as an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


def _valid_unicode(text: str) -> str:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text must be valid Unicode; it holds a lone surrogate at character {e.start}") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]

# Fields of the OpenAI API that specfork does not implement: accepted at their neutral value,
# refused with a clear message otherwise (silently ignoring them would change what users get).
_NEUTRAL = {
    "best_of": (None, 1),
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
    stop: Text | list[Text] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="keep generating after EOS (extension, as in vLLM)")
    user: str | None = None
    return_token_ids: bool = Field(False, description="add the generated token ids to each choice (extension)")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, body: object) -> object:
        """An optional field sent as null takes its default, as in the OpenAI API (whose optional
        fields are all nullable: clients and wrappers send ``"temperature": null``). Required
        fields stay as sent, so a null one is still refused."""
        if not isinstance(body, dict):
            return body
        optional = {name for name, f in cls.model_fields.items() if f.default is not PydanticUndefined}
        return {k: v for k, v in body.items() if v is not None or k not in optional}

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return stop

    @model_validator(mode="after")
    def _supported(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        for name, neutral in _NEUTRAL.items():
            value = (self.model_extra or {}).get(name)
            if name == "best_of" and value == self.n:
                continue
            if value not in neutral:
                raise ValueError(f"'{name}' is not supported by this server")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def field_of(self, param: str | None) -> str | None:
        """This request's field behind a sampling parameter the engine refused (its error's ``param``)."""
        return "logprobs" if param == "prompt_logprobs" else param


class CompletionRequest(GenerationRequest):
    prompt: Text | list[int] | list[Text]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @property
    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("prompt is empty")
            if isinstance(prompt[0], str):
                if len(prompt) != 1:
                    raise ValueError("send one prompt per request (batched prompts are not supported)")
                return prompt[0]
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]

    def as_template_message(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def field_of(self, param: str | None) -> str | None:
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return "top_logprobs" if param == "logprobs" else param


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
    try:
        text = repr(value)
    except RecursionError:
        return "a deeply nested value"
    return text if len(text) <= limit else text[: limit - 3] + "..."
