"""The OpenAI request bodies specfork accepts, validated strictly, and the error they raise."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticUndefined

from specfork.errors import SpecforkError
from specfork.sampling_params import MAX_LOGPROBS, StructuredOutputs

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


class NullMeansDefault(BaseModel):
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


class StreamOptions(NullMeansDefault):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="usage so far in every chunk (extension, as in vLLM; "
                                         "with include_usage)")
    include_obfuscation: bool = Field(True, description="OpenAI's padding of stream chunks against length side "
                                      "channels: accepted, and no padding is sent")


def _valid_unicode(text: str) -> str:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text must be valid Unicode; it holds a lone surrogate at character {e.start}") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]

# Fields of the OpenAI API, and vLLM's extensions, that specfork does not implement: accepted
# when absent, null or at their neutral value, refused with a 400 naming them otherwise (silently
# ignoring them would change what users get). A field named in neither table nor declared on the
# request is refused as unknown, as OpenAI's API does.
_NEUTRAL: dict[str, tuple] = {
    "suffix": ("",),
    "length_penalty": (1,),
    "use_beam_search": (False,),
    "spaces_between_special_tokens": (True,),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none", "auto"),  # with no tools, "auto" calls none
    "function_call": ("none", "auto"),
    "modalities": (["text"],),
    "verbosity": ("medium",),
    "return_tokens_as_token_ids": (False,),
    "detokenize": (True,),
    "echo": (False,),  # chat's (vLLM); completions' is declared
    # no neutral value but null
    "truncate_prompt_tokens": (), "prompt_logprobs": (), "guided_grammar": (), "guided_whitespace_pattern": (),
    "chat_template": (), "audio": (), "prediction": (), "reasoning_effort": (), "documents": (),
}
# Fields that change nothing the model computes (the caller's bookkeeping): accepted and ignored.
# (vLLM's guided_decoding_backend picks the library that holds the output to its grammar: the output
# is the same whichever does it.)
_BOOKKEEPING = frozenset({"metadata", "store", "service_tier", "parallel_tool_calls", "request_id", "priority",
                          "prompt_cache_key", "safety_identifier", "guided_decoding_backend"})


def _is_neutral(value: object, neutral: tuple) -> bool:
    """``value`` equals one of the neutral values, a bool only a bool (``False == 0`` in Python)."""
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral)


class JsonSchemaFormat(NullMeansDefault):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema here


class ResponseFormat(NullMeansDefault):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self


class StructuredOutputsField(NullMeansDefault):
    """vLLM's ``structured_outputs`` object (the grammar kinds this server has)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None


class GenerationRequest(NullMeansDefault):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="keep the k most likely tokens (extension; 0 or -1 = off)")
    # ranges checked by SamplingParams, as from the Python API
    min_p: float = Field(0.0, description="drop tokens less likely than min_p x the likeliest (extension, as in vLLM)")
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = Field(1.0, description="penalise tokens of the prompt and output (extension, as in vLLM)")
    min_tokens: int = Field(0, description="tokens before EOS or a stop may end a choice (extension, as in vLLM)")
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias added to its logit, -100..100")
    allowed_token_ids: list[int] | None = Field(None, description="only these tokens may be generated (extension, as "
                                                "in vLLM)")
    bad_words: list[Text] | None = Field(None, description="words never to generate (extension, as in vLLM)")
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = Field(None, description="token ids that end a choice (extension, as in vLLM)")
    include_stop_str_in_output: bool = Field(False, description="end the text with the stop string it met "
                                             "(extension, as in vLLM)")
    skip_special_tokens: bool = Field(True, description="leave special tokens out of the text (extension, as in vLLM)")
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="keep generating after EOS (extension, as in vLLM)")
    user: str | None = None
    return_token_ids: bool = Field(False, description="add the generated token ids to each choice (extension)")
    response_format: ResponseFormat | None = Field(None, description="{'type': 'json_object'} or {'type': "
                                                   "'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}")
    guided_json: dict[str, Any] | str | None = Field(None, description="a JSON schema the output follows (extension, "
                                                     "as in vLLM)")
    guided_regex: str | None = Field(None, description="a regular expression the output matches (extension, as in "
                                     "vLLM)")
    guided_choice: list[str] | None = Field(None, description="the output is one of these strings (extension, as "
                                            "in vLLM)")
    structured_outputs: StructuredOutputsField | None = Field(None, description="{'json' | 'json_object' | 'regex' | "
                                                              "'choice': ...} (extension, as in vLLM)")

    OTHER_SPELLINGS: ClassVar[dict[str, str]] = {}  # another endpoint's field -> this one's
    NEUTRAL_HERE: ClassVar[dict[str, tuple]] = {}  # neutral values this endpoint's defaults make

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop must be up to 4 non-empty strings")
        return stop

    @field_validator("top_k")
    @classmethod
    def _minus_one_is_off(cls, top_k: int) -> int:
        return 0 if top_k == -1 else top_k  # vLLM's spelling of "off"

    @field_validator("stream_options")
    @classmethod
    def _options_need_a_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("only allowed with stream: true")
        return options

    def refuse_unsupported(self) -> None:
        """A 400 naming the first field sent that this server would otherwise ignore."""
        for name, value in (self.model_extra or {}).items():
            if name in _BOOKKEEPING or value is None:
                continue
            if name == "best_of":
                if value != self.n:
                    raise ApiError(400, "'best_of' other than n is not supported by this server", param=name)
            elif name in _NEUTRAL or name in self.NEUTRAL_HERE:
                if not _is_neutral(value, self.NEUTRAL_HERE.get(name) or _NEUTRAL[name]):
                    raise ApiError(400, f"'{name}' is not supported by this server", param=name)
            else:
                spelled = self.OTHER_SPELLINGS.get(name)
                hint = f" (it spells this '{spelled}')" if spelled else ""
                raise ApiError(400, f"'{name}' is not a parameter of this endpoint{hint}", param=name)

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def _structured_fields(self) -> list[str]:
        """The request's fields that ask for a structured output (response_format of type text asks none)."""
        asked = [name for name in ("guided_json", "guided_regex", "guided_choice", "structured_outputs")
                 if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            asked.insert(0, "response_format")
        return asked

    def structured_output(self) -> StructuredOutputs | None:
        """What the output must be, from whichever one field asks for it; a 400 for two, or for one
        that does not say what it wants."""
        asked = self._structured_fields()
        if not asked:
            return None
        if len(asked) > 1:
            raise ApiError(400, f"give one of {', '.join(asked)}: each says what the output must be", param=asked[1])
        try:
            if asked[0] == "response_format":
                fmt = self.response_format
                if fmt.type == "json_object":
                    return StructuredOutputs(json_object=True)
                if fmt.json_schema.json_schema is None:
                    raise ApiError(400, "json_schema.schema is required", param="response_format")
                return StructuredOutputs(json=fmt.json_schema.json_schema)
            if asked[0] == "guided_json":
                return StructuredOutputs(json=self.guided_json)
            if asked[0] == "guided_regex":
                return StructuredOutputs(regex=self.guided_regex)
            if asked[0] == "guided_choice":
                return StructuredOutputs(choice=tuple(self.guided_choice))
            so = self.structured_outputs
            return StructuredOutputs(json=so.json_schema, json_object=bool(so.json_object), regex=so.regex,
                                     choice=None if so.choice is None else tuple(so.choice))
        except SpecforkError as e:
            raise ApiError(400, str(e), param=asked[0]) from None

    def field_of(self, param: str | None) -> str | None:
        """This request's field behind a sampling parameter the engine refused (its error's ``param``)."""
        if param == "structured_outputs":
            return next(iter(self._structured_fields()), param)
        return "logprobs" if param == "prompt_logprobs" else param


class CompletionRequest(GenerationRequest):
    OTHER_SPELLINGS: ClassVar[dict[str, str]] = {"max_completion_tokens": "max_tokens", "top_logprobs": "logprobs"}
    NEUTRAL_HERE: ClassVar[dict[str, tuple]] = {"add_special_tokens": (True,)}  # the tokenizer's own settings
    prompt: Text | list[int] | list[Text] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0, description="tokens to generate at most; 0 with echo scores the "
                                   "prompt without generating")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @model_validator(mode="after")
    def _nothing_to_generate_needs_echo(self) -> CompletionRequest:
        if self.max_tokens == 0:
            if not self.echo:
                raise ValueError("max_tokens: 0 returns nothing without echo: true (which returns the prompt and, "
                                 "with logprobs, its log-probabilities)")
            if self.min_tokens > 0:
                raise ValueError(f"min_tokens ({self.min_tokens}) cannot exceed max_tokens (0)")
        return self

    @property
    def scores_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its log-probabilities) back, nothing generated."""
        return self.echo and self.max_tokens == 0

    @property
    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or a batch (a list of texts or of token-id lists)."""
        if isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    @field_validator("prompt")
    @classmethod
    def _prompts_not_empty(cls, prompt: str | list, info: ValidationInfo) -> str | list:
        if isinstance(prompt, list):
            if not prompt or any(isinstance(p, list) and not p for p in prompt):
                raise ValueError("prompt is empty")
            batch, n = (len(prompt) if not isinstance(prompt[0], int) else 1), info.data.get("n", 1)
            if batch * n > MAX_CHOICES:
                raise ValueError(f"{batch} prompts x n = {n} makes {batch * n} choices; at most {MAX_CHOICES} "
                                 "a request")
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: Text


# A message's fields for tool calling: refused when set (no tool calls here), dropped when empty.
_TOOL_FIELDS = ("tool_calls", "function_call", "tool_call_id")
# Fields an assistant message returned by the API carries (clients send it back as it came): dropped.
_REPLY_FIELDS = ("refusal", "annotations", "reasoning_content", "reasoning")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: Text | None = None  # given to the chat template, which may use it

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, message: object) -> object:
        if not isinstance(message, dict):
            return message
        if message.get("role") in ("tool", "function") or any(message.get(k) for k in _TOOL_FIELDS):
            raise ValueError("tool calls and tool results are not supported by this server")
        if message.get("audio") is not None:
            raise ValueError("audio is not supported: this model reads text only")
        dropped = (*_TOOL_FIELDS, *_REPLY_FIELDS, "audio")
        return {k: v for k, v in message.items() if k not in dropped and not (k == "name" and v is None)}

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: object) -> object:
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported: this model reads text only")
        return content

    def as_template_message(self) -> dict:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content}
        return message if self.name is None else {**message, "name": self.name}


class ChatTemplateOptions(BaseModel):
    """How a request's conversation is rendered (vLLM's extensions): chat completions and /tokenize."""

    add_generation_prompt: bool = Field(True, description="open the assistant's turn (extension, as in vLLM)")
    continue_final_message: bool = Field(
        False, description="leave the last message open and continue it (extension, as in vLLM)")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="further variables for the chat template (extension, as in vLLM)")

    @field_validator("continue_final_message")
    @classmethod
    def _one_template_mode(cls, continue_final: bool, info: ValidationInfo) -> bool:
        if continue_final and info.data.get("add_generation_prompt", True):
            raise ValueError("needs add_generation_prompt: false")
        return continue_final


class ChatCompletionRequest(GenerationRequest, ChatTemplateOptions):
    NEUTRAL_HERE: ClassVar[dict[str, tuple]] = {"add_special_tokens": (False,)}  # the template writes them
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return top

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def field_of(self, param: str | None) -> str | None:
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return "top_logprobs" if param == "logprobs" else super().field_of(param)


class TokenizeRequest(ChatTemplateOptions):
    """vLLM's /tokenize: a text (``prompt``) or a conversation (``messages``, rendered by the chat
    template as /v1/chat/completions renders it)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    # Only the endpoint's own settings (the tokenizer's for a text, none for a conversation).
    add_special_tokens: bool | None = None

    @model_validator(mode="after")
    def _text_or_conversation(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either 'prompt' (a text) or 'messages' (a conversation)")
        if self.add_special_tokens is not None and self.add_special_tokens != (self.prompt is not None):
            raise ValueError(f"add_special_tokens: {self.add_special_tokens} is not supported by this server")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize: token ids back to text (special tokens included)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    tokens: list[int]


def parse_request(model: type[BaseModel], body: object) -> BaseModel:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in first["loc"] if not str(p).startswith("function-after"))
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "missing":
            message = f"'{loc}' is required"
        elif first["type"] == "extra_forbidden":
            message = f"{loc}: unknown field"
        elif loc:
            got = f" (got {_short(first['input'])})" if "input" in first else ""
            message = f"{loc}: {message}{got}"
        raise ApiError(400, message, param=loc or None) from None
    if isinstance(request, GenerationRequest):
        request.refuse_unsupported()
    return request


def _short(value: object, limit: int = 80) -> str:
    try:
        text = repr(value)
    except RecursionError:
        return "a deeply nested value"
    return text if len(text) <= limit else text[: limit - 3] + "..."
