"""Tokenizers: encode/decode text and apply chat templates for one checkpoint.

Two sources, one interface (:class:`Tokenizer`):

* GGUF files with a byte-level BPE vocabulary (``tokenizer.ggml.model == "gpt2"``: SmolLM2,
  Llama 3, Qwen2/3, ...) are built straight from the file's metadata with the ``tokenizers``
  library: the vocabulary, the merges, the control tokens as special tokens and the split rule
  named by ``tokenizer.ggml.pre``. This is what transformers' GGUF conversion builds (the tests
  compare the two on real text), without importing transformers or re-reading the file, so the
  embedded model's tokenizer is ready in a fraction of a second instead of ~9 s.
* HF directories, and GGUF vocabularies of any other kind (SentencePiece, other split rules,
  special tokens spelled outside the byte alphabet, no merges), go through transformers, chat
  templates included.

For the first kind, chat templates are rendered with jinja2 in a sandbox with the settings and
helpers transformers gives them (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``,
``raise_exception``, ``strftime_now``, a ``tojson`` that does not escape HTML, the
``{% generation %}`` block); a template that refuses a conversation is a ``PromptError``.
"""

from __future__ import annotations

import json
import logging
import re
from functools import cache, cached_property
from pathlib import Path

from specfork.errors import ModelLoadError, PromptError

logger = logging.getLogger(__name__)

CONTROL_TOKEN, USER_DEFINED_TOKEN = 3, 4  # GGUF token types

# The split rule of each GGUF pre-tokenizer name built here (llama.cpp's names); vocabularies with
# other names go through transformers (see _builds_here).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
# Names whose vocabularies use GPT-2's own byte-level split.
_GPT2_SPLIT_NAMES = {None, "default", "gpt2", "smollm"}


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback tokens


class Tokenizer:
    """Encode/decode text and apply the chat template of one checkpoint."""

    def __init__(self, backend, *, chat_template: str | None, special_tokens: dict[str, str | None],
                 hf_tokenizer=None) -> None:
        """``backend``: a ``tokenizers.Tokenizer`` built here, or None with ``hf_tokenizer``: a
        transformers tokenizer that does everything (HF directories, other GGUF vocabularies).
        ``special_tokens``: bos/eos/unk/pad token strings, as chat templates see them."""
        self._backend = backend
        self._hf = hf_tokenizer
        self._via_transformers = hf_tokenizer is not None
        self.chat_template = chat_template or None
        self.special_tokens = special_tokens

    @classmethod
    def from_transformers(cls, hf_tokenizer) -> Tokenizer:
        special = {name: getattr(hf_tokenizer, name, None) for name in ("bos_token", "eos_token", "unk_token",
                                                                        "pad_token")}
        template = getattr(hf_tokenizer, "chat_template", None)
        return cls(None, chat_template=template if isinstance(template, str) else None, special_tokens=special,
                   hf_tokenizer=hf_tokenizer)

    @property
    def hf(self):
        """A transformers tokenizer with the same behaviour (to save it next to a trained draft)."""
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            special = {k: v for k, v in self.special_tokens.items() if v is not None}
            self._hf = PreTrainedTokenizerFast(tokenizer_object=self._backend, chat_template=self.chat_template,
                                               **special)
        return self._hf

    def _id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)

    @property
    def pad_token_id(self) -> int | None:
        return self._hf.pad_token_id if self._via_transformers else self._id("pad_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._hf.eos_token_id if self._via_transformers else self._id("eos_token")

    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    @cached_property
    def vocab(self) -> dict[str, int]:
        return self._hf.get_vocab() if self._via_transformers else self._backend.get_vocab(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Raw text → ids, adding BOS/EOS only as the tokenizer's own settings say."""
        if self._via_transformers:
            return list(self._hf(text)["input_ids"])
        return self._encode(text, add_special_tokens=True)

    def encode_fragment(self, text: str) -> list[int]:
        """The ids of a piece of text as it stands inside a longer one: no BOS or EOS."""
        if self._via_transformers:
            return list(self._hf(text, add_special_tokens=False)["input_ids"])
        return self._encode(text, add_special_tokens=False)

    def _encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        # encode_batch, not encode: it releases the GIL, so a long prompt tokenized on a worker
        # thread does not stall the server's event loop (encode holds it for the whole text).
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._via_transformers:
            return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for. A token may hold part of a character (byte-level BPE
        splits an emoji or a CJK character over tokens; SentencePiece falls back to ``<0xNN>``
        tokens), which decoding alone turns into U+FFFD: its raw bytes come from its vocabulary
        entry instead, so that a text's tokens' bytes join into the text's UTF-8."""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        raw = self._hf.convert_ids_to_tokens(token_id) if self._via_transformers else self._backend.id_to_token(token_id)
        if raw is None:
            return text.encode("utf-8")
        if match := _BYTE_TOKEN.fullmatch(raw):
            return bytes([int(match.group(1), 16)])
        symbols = _byte_of_symbol()
        if all(c in symbols for c in raw):
            return bytes(symbols[c] for c in raw)
        return text.encode("utf-8")

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, template_kwargs: dict | None = None) -> list[int]:
        """The conversation rendered by the model's template and tokenized. ``add_generation_prompt``
        opens the assistant's turn; ``continue_final_message`` leaves the last message open instead
        (its end-of-turn markup cut off), so that generation continues its text, as transformers
        and vLLM do. ``template_kwargs`` are further variables for the template (vLLM's
        ``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``)."""
        if not self.has_chat_template():
            raise PromptError("this model has no chat template; pass raw prompts instead")
        check_messages(messages)
        if add_generation_prompt and continue_final_message:
            raise PromptError("continue_final_message continues the last message, so it cannot be combined "
                              "with add_generation_prompt (set that to false)")
        extra = dict(template_kwargs or {})
        reserved = sorted(set(extra) & _TEMPLATE_VARIABLES)
        if reserved:
            raise PromptError(f"chat template variables {reserved} are set by the request itself, not by "
                              "chat_template_kwargs")
        rendered = messages
        if continue_final_message:  # the content marked, to find where it ends in the rendered text
            rendered = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_HERE}]
        import jinja2

        try:
            if self._via_transformers:
                text = self._hf.apply_chat_template(rendered, tokenize=False,
                                                    add_generation_prompt=add_generation_prompt, **extra)
            else:
                # As transformers does: tokens that are not set are left out (a template tests them).
                special = {k: v for k, v in self.special_tokens.items() if v is not None}
                text = self._template.render(**{**special, **extra}, messages=rendered, tools=None, documents=None,
                                             add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as e:  # the template refuses this conversation (e.g. roles out of order)
            raise PromptError(f"the chat template refused these messages: {e}") from None
        if continue_final_message:
            text = _open_final_message(text, messages[-1]["content"])
        # The template already writes every special token it wants.
        if self._via_transformers:
            return list(self._hf(text, add_special_tokens=False)["input_ids"])
        return self._encode(text, add_special_tokens=False)

    @cached_property
    def _template(self):
        return compile_chat_template(self.chat_template)


def compile_chat_template(source: str):
    """A chat template compiled in jinja2's immutable sandbox, with the helpers transformers gives
    templates (``raise_exception``, ``strftime_now``, an HTML-safe ``tojson``, the
    ``{% generation %}`` block, rendered as its body)."""
    from datetime import datetime

    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks;
        rendering keeps the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, GenerationBlock])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ModelLoadError(f"the model's chat template does not compile: {e}") from None


# Variables the request's own options set: chat_template_kwargs may not replace them.
_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                                 "tokenize", "return_dict", "chat_template", "conversation"})
# Appended to the last message's content under continue_final_message, to find where it ends.
_CONTINUE_HERE = "\u2063specfork-continue-here\u2063"


def _open_final_message(text: str, final: str) -> str:
    """The rendered conversation cut right after the last message's content (what follows it is
    the template's end-of-turn markup), found by the marker rendered after it; a template that
    changes the marker's text is cut after the content's last occurrence, as transformers does."""
    if text.count(_CONTINUE_HERE) == 1:
        return text[: text.index(_CONTINUE_HERE)]
    text = text.replace(_CONTINUE_HERE, "")
    for content in (final, final.strip()):
        end = text.rfind(content)
        if content and end >= 0:
            return text[: end + len(content)]
    raise PromptError("continue_final_message: the chat template does not write the last message's content "
                      "verbatim, so there is no place to continue it from")


def check_messages(messages: object) -> None:
    """A conversation is a non-empty list of {'role': str, 'content': non-empty str} messages."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("a chat conversation must be a non-empty list of messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise PromptError(f"each chat message must be {{'role': str, 'content': str}}, got {m!r}")
        if not m["content"]:
            raise PromptError(f"chat message content is empty (role {m['role']!r}); prompts must not be empty")


def load_hf_tokenizer(directory: Path) -> Tokenizer | None:
    if not any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        logger.info("%s has no tokenizer files; only token-id prompts can be used", directory)
        return None
    from transformers import AutoTokenizer

    try:
        return Tokenizer.from_transformers(AutoTokenizer.from_pretrained(str(directory)))
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer in {directory}: {e}") from None


def load_gguf_tokenizer(reader) -> Tokenizer | None:
    """The tokenizer a parsed GGUF file (:class:`GGUFFile`) describes, or None without one."""
    kind = reader.get("tokenizer.ggml.model")
    if kind is None or reader.array_length("tokenizer.ggml.tokens") is None:
        logger.info("%s has no tokenizer metadata; only token-id prompts can be used", reader.path)
        return None
    if _builds_here(reader, kind):
        try:
            return _byte_level_bpe(reader, reader.get("tokenizer.ggml.pre"))
        except Exception as e:  # malformed vocabularies: say so, as for any checkpoint
            raise ModelLoadError(f"cannot build the tokenizer of {reader.path}: {e}") from None
    return _through_transformers(reader.path)


def _builds_here(reader, kind: str) -> bool:
    """Whether :func:`_byte_level_bpe` builds this vocabulary exactly as transformers does: byte-level
    BPE with merges, a known split rule, and every named special token spelled in the byte alphabet
    (transformers re-spells other tokens, so e.g. DeepSeek's ``<｜begin▁of▁sentence｜>`` goes there)."""
    if kind != "gpt2" or not reader.array_length("tokenizer.ggml.merges"):
        return False
    pre = reader.get("tokenizer.ggml.pre")
    if pre not in _SPLITS and pre not in _GPT2_SPLIT_NAMES:
        return False
    tokens, alphabet = reader.get("tokenizer.ggml.tokens"), set(byte_alphabet().values())
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        index = reader.get(f"tokenizer.ggml.{key}")
        if isinstance(index, int) and 0 <= index < len(tokens) and not set(tokens[index]) <= alphabet:
            return False
    return True


def _through_transformers(path: Path) -> Tokenizer | None:
    logger.info("building the %s tokenizer through transformers (slower)", path.name)
    from transformers import AutoTokenizer

    try:
        return Tokenizer.from_transformers(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))
    except Exception as e:
        logger.warning("cannot build a tokenizer from %s (%s); only token-id prompts can be used", path, e)
        return None


@cache
def _byte_of_symbol() -> dict[str, int]:
    """byte_alphabet read backwards: the byte each symbol stands for."""
    return {symbol: b for b, symbol in byte_alphabet().items()}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible spelling of bytes as printable characters: printable Latin-1 bytes stand
    for themselves, the others (controls, space, ...) for the code points from 256 upwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


def _byte_level_bpe(reader, pre: str | None) -> Tokenizer:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as Backend

    tokens = reader.get("tokenizer.ggml.tokens")
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # Tokens stored with characters outside the byte alphabet are spelled in it (as transformers does).
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    merges = [tuple(m.split(" ")) for m in reader.get("tokenizer.ggml.merges") or []]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                                 continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                                 byte_fallback=False))
    split = _SPLITS.get(pre)
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    types = reader.array("tokenizer.ggml.token_type")
    if types is not None:
        control = [AddedToken(tokens[i], normalized=False, special=True)
                   for i in (types == CONTROL_TOKEN).nonzero()[0] if set(tokens[i]) <= alphabet]
        backend.add_special_tokens(control)
        user = [AddedToken(tokens[i], normalized=False, special=False)
                for i in (types == USER_DEFINED_TOKEN).nonzero()[0] if tokens[i] in vocab]
        backend.add_tokens(user)

    def token(key: str) -> str | None:
        index = reader.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    special = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
               "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")}
    add_bos, add_eos = bool(reader.get("tokenizer.ggml.add_bos_token")), bool(reader.get("tokenizer.ggml.add_eos_token"))
    bos, eos = special["bos_token"], special["eos_token"]
    if (add_bos and bos is not None) or (add_eos and eos is not None):
        pieces = ([bos] if add_bos and bos else []) + ["$A"] + ([eos] if add_eos and eos else [])
        ids = [(t, vocab[t]) for t in (bos if add_bos else None, eos if add_eos else None) if t is not None]
        backend.post_processor = processors.TemplateProcessing(single=" ".join(pieces), special_tokens=ids)
    return Tokenizer(backend, chat_template=reader.get("tokenizer.chat_template"), special_tokens=special)
