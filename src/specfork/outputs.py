"""What a finished request returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """token_ids are the generated tokens only (EOS included when it ended the request)."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    metrics: dict = field(default_factory=dict)
