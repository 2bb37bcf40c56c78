"""Tokenizers: HF ``tokenizer.json``/``tokenizer_config.json`` directories and GGUF metadata,
both through transformers so that text handling (special tokens, BOS rules, chat templates)
is exactly what the checkpoint's authors specified."""

from __future__ import annotations

import logging
from pathlib import Path

from specfork.errors import ModelLoadError, PromptError

logger = logging.getLogger(__name__)


class Tokenizer:
    """Encode/decode text and apply the chat template of one checkpoint."""

    def __init__(self, hf_tokenizer) -> None:
        self._tok = hf_tokenizer

    @property
    def hf(self):
        """The underlying transformers tokenizer (to save it next to a trained draft)."""
        return self._tok

    @property
    def pad_token_id(self) -> int | None:
        return self._tok.pad_token_id

    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab()

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        """Raw text → ids, adding BOS/EOS only as the tokenizer's own settings say."""
        return list(self._tok(text)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if not self.has_chat_template():
            raise PromptError("this model has no chat template; pass raw prompts instead")
        _check_messages(messages)
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template already writes every special token it wants.
        return list(self._tok(text, add_special_tokens=False)["input_ids"])


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise PromptError("a chat conversation must be a non-empty list of messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise PromptError(f"each chat message must be {{'role': str, 'content': str}}, got {m!r}")


def load_hf_tokenizer(directory: Path) -> Tokenizer | None:
    if not any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        logger.info("%s has no tokenizer files; only token-id prompts can be used", directory)
        return None
    from transformers import AutoTokenizer

    try:
        return Tokenizer(AutoTokenizer.from_pretrained(str(directory)))
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer in {directory}: {e}") from None


def load_gguf_tokenizer(path: Path) -> Tokenizer | None:
    from transformers import AutoTokenizer

    try:
        return Tokenizer(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))
    except Exception as e:
        logger.warning("cannot build a tokenizer from %s (%s); only token-id prompts can be used", path, e)
        return None
