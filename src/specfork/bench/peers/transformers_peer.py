"""transformers ``generate`` on the same checkpoint (a GGUF dequantized to fp32): AR, prompt
lookup and assisted generation (with the same draft) at batch 1; AR on left-padded batches. EOS is
ignored (every request makes ``output_len`` tokens) unless ``--no-ignore-eos``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from specfork.bench.peers.common import GenerateGroup, PeerRun, one_at_a_time
from specfork.bench.settings import BenchSettings

KINDS = ("AR", "prompt-lookup", "assisted")
BATCHED_KINDS = ("AR",)  # prompt lookup and assisted generation take one sequence


def _load(name: str):
    from transformers import AutoModelForCausalLM

    from specfork.loading.resolve import resolve_checkpoint

    path = resolve_checkpoint(name).path
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def transformers_run(kind: str, s: BenchSettings) -> PeerRun:
    """transformers ``kind`` (AR, prompt-lookup or assisted; batched: AR)."""
    return PeerRun(f"transformers {kind}", kind, lambda: _loaded(kind, s))


@contextmanager
def _loaded(kind: str, s: BenchSettings) -> Iterator[GenerateGroup]:
    from specfork.loading.resolve import resolve_checkpoint, resolve_draft

    model = _load(s.model)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    kwargs = dict(do_sample=s.temperature > 0, max_new_tokens=s.output_len,
                  pad_token_id=model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0)
    if s.temperature > 0:  # the filters stated, none of generate's defaults (top-k 50)
        kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k)
    if kind == "prompt-lookup":
        kwargs["prompt_lookup_num_tokens"] = 10
    elif kind == "assisted":
        kwargs["assistant_model"] = _load(resolve_draft(s.draft, resolve_checkpoint(s.model), heads=False))

    def lengths(n: int) -> dict:
        return {"max_new_tokens": n, **({"min_new_tokens": n} if s.ignore_eos else {})}

    def to_eos(out: list[int]) -> list[int]:  # a finished row of a batch is padded after its EOS
        if s.ignore_eos:
            return out
        return next((out[: i + 1] for i, t in enumerate(out) if t in eos), out)

    @torch.inference_mode()
    def generate(ids: list[int], n: int) -> list[int]:
        return to_eos(model.generate(torch.tensor([ids]), **{**kwargs, **lengths(n)})[0, len(ids) :].tolist())

    @torch.inference_mode()
    def generate_group(group: list[list[int]], n: int) -> list[list[int]]:
        width = max(len(ids) for ids in group)  # left padding, as transformers expects for generation
        ids = torch.tensor([[kwargs["pad_token_id"]] * (width - len(g)) + g for g in group])
        mask = torch.tensor([[0] * (width - len(g)) + [1] * len(g) for g in group])
        out = model.generate(ids, attention_mask=mask, **{**kwargs, **lengths(n)})[:, width:].tolist()
        return [to_eos(row) for row in out]

    yield generate_group if s.batch_size > 1 else one_at_a_time(generate)
