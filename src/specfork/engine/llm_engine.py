"""The engine loop: requests in, scheduler → step → stop checks, outputs out."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count

import torch

from specfork.config import Config
from specfork.engine.block_manager import BlockManager
from specfork.engine.model_runner import ModelRunner
from specfork.engine.scheduler import Scheduler
from specfork.engine.sequence import Sequence
from specfork.engine.step import AutoregressiveStep, NewTokens, Step, StepHealth
from specfork.errors import EngineFailure, PromptError, SpecforkError
from specfork.loading import LoadedModel, load_model
from specfork.native_kernels import instruction_set
from specfork.outputs import RequestOutput, TokenLogprob
from specfork.sampling_params import SamplingParams
from specfork.structured_output import GrammarCompiler

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class StepUpdate:
    """New tokens of one sequence after a step (``finished`` once it stopped).

    ``error`` is set when the step failed for this sequence: it is then finished with
    finish_reason "error" and its resources are freed; other sequences are not affected."""

    seq: Sequence
    new_token_ids: list[int]
    finished: bool
    new_logprobs: list[TokenLogprob] | None = None
    error: str | None = None


class LLMEngine:
    def __init__(self, config: Config, build_step: Callable[[LLMEngine], Step] | None = None,
                 extra_roles: tuple = ()) -> None:
        """``build_step`` makes the decoding step from the engine's parts (default: AR).
        ``extra_roles``: ranks the step needs in the torch.distributed world besides the model's
        (parallel/world.py ``RankRole``s, e.g. SSD's drafter as a rank)."""
        self.config = config
        threads_before = torch.get_num_threads()
        if config.threads is not None and config.device == "cpu":
            torch.set_num_threads(config.threads)
        for option, device in (("device", config.device), ("drafter_device", config.drafter_device)):
            if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
                raise SpecforkError(f"{option} '{device}' was requested but CUDA is not available")
        self.device = torch.device(config.device)
        dtype = _DTYPES[config.torch_dtype_name]
        num_blocks = config.num_kv_blocks or -(-config.kv_cache_tokens // config.block_size)
        try:
            self.world = _start_world(config, num_blocks, extra_roles)
        except BaseException:
            torch.set_num_threads(threads_before)
            raise
        # The process's torch threads come back when the engine closes, or is dropped without
        # closing, unless someone set them since (another engine).
        self._restore_threads = weakref.finalize(self, _restore_threads, threads_before, torch.get_num_threads())
        self.parallel = None
        if config.tensor_parallel_size > 1:
            from specfork.parallel.group import TensorParallelGroup

            self.parallel = TensorParallelGroup(self.world)
        try:
            self._build(config, build_step, dtype, num_blocks)
        except BaseException:
            self._close_world()
            self._restore_threads()
            raise

    def _build(self, config: Config, build_step, dtype: torch.dtype, num_blocks: int) -> None:
        requested_len = config.max_model_len
        try:
            self.loaded: LoadedModel = load_model(
                config.model, device=self.device, dtype=dtype, max_positions=requested_len, **config.load_options,
                shard=self.parallel.shard if self.parallel else None,
            )
        except Exception as e:
            if self.parallel:  # the other ranks wait for every rank's report
                self.parallel.check_loaded(f"{type(e).__name__}: {e}")
            raise
        if self.parallel:
            self.parallel.check_loaded(None)
        arch = self.loaded.arch
        if requested_len is not None and requested_len > arch.max_position_embeddings:
            raise SpecforkError(
                f"max_model_len {requested_len} exceeds the model's context length {arch.max_position_embeddings}"
            )
        self.runner = ModelRunner(
            self.loaded.model,
            num_blocks=num_blocks,
            block_size=config.block_size,
            device=self.device,
            deterministic=config.deterministic,
            kv_dtype=getattr(torch, config.kv_cache_dtype) if config.kv_cache_dtype else None,
            parallel=self.parallel,
            cuda_graphs=config.cuda_graphs,
            max_seqs=config.max_num_seqs,
            max_rows=config.k_max + 1,
        )
        self.block_manager = BlockManager(num_blocks, config.block_size, prefix_caching=config.prefix_caching)
        # KV slots a verify window writes past the next token cut the usable length (plain
        # decoding's steps in one call stop at the model's length: the scheduler's lookahead_limit).
        capacity = num_blocks * config.block_size - config.lookahead
        if requested_len is not None and requested_len > capacity:
            raise SpecforkError(
                f"max_model_len {requested_len} does not fit in the KV cache, which holds {capacity} tokens "
                f"({num_blocks} blocks of {config.block_size}{', less the lookahead of k' if config.lookahead else ''}); "
                "give a larger --kv-cache-tokens (num_kv_blocks) or a smaller --max-model-len"
            )
        self.max_model_len = min(requested_len or arch.max_position_embeddings, capacity)
        self.num_kv_blocks = num_blocks
        self.step_strategy: Step = (build_step(self) if build_step
                                    else AutoregressiveStep(self.runner, config.decode_steps, self.max_model_len))
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            on_release=self._release,
            prefix_user=self.step_strategy,
            lookahead_limit=self.max_model_len if build_step is None else None,
        )
        self.eos_token_ids = frozenset(arch.eos_token_ids)
        self.grammars = GrammarCompiler(self.loaded.tokenizer, arch.vocab_size, self.eos_token_ids)
        self._ids = count()
        logger.info(
            "loaded %s (%s, %d layers) on %s%s%s; KV cache %d blocks x %d tokens; max_model_len %d",
            self.loaded.location.path, arch.architecture, arch.num_layers, self.device,
            f" (native kernels: {instruction_set()})" if self.device.type == "cpu"
            else f" (CUDA graphs: {'on' if self.runner.graphs else 'off'})",
            f", tensor parallel over {self.parallel.size} ranks" if self.parallel else "",
            num_blocks, config.block_size, self.max_model_len,
        )

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    # ---- requests -------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Raw text or token ids → validated token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError("prompt is empty")
            if self.tokenizer is None:
                raise PromptError("this model has no tokenizer; pass prompts as lists of token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            if any(not isinstance(t, int) or isinstance(t, bool) for t in prompt):
                raise PromptError("a token-id prompt must be a list of integers")
            ids = list(prompt)
        else:
            raise PromptError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        self.check_prompt_ids(ids)
        return ids

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict | None = None) -> list[int]:
        if self.tokenizer is None:
            raise PromptError("this model has no tokenizer, so it cannot apply a chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message,
                                                 template_kwargs=template_kwargs)
        self.check_prompt_ids(ids)
        return ids

    def check_prompt_ids(self, ids: list[int]) -> None:
        if not ids:
            raise PromptError("prompt is empty (it encodes to no tokens)")
        self.check_vocabulary(ids)
        if len(ids) >= self.max_model_len:
            raise PromptError(
                f"prompt has {len(ids)} tokens but the context holds {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )

    def check_vocabulary(self, ids, what: str = "token ids {} are", error: type[SpecforkError] = PromptError,
                         param: str | None = None) -> None:
        """Every id of ``ids`` is one of the model's (``what`` says the first bad ones in the error)."""
        vocab = self.loaded.arch.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise error(f"{what.format(bad[:5])} outside the vocabulary [0, {vocab})", param=param)

    def check_sampling_ids(self, params: SamplingParams, stops: frozenset[int],
                           bad_words: tuple[tuple[int, ...], ...]) -> None:
        """The token ids a request's sampling names are the model's (a bias or an allowed id past
        the vocabulary would fail the batch it runs in), and its allowed ids leave something to
        generate (else every logit would be -inf, and the draw meaningless)."""
        allowed = params.allowed_token_ids or ()
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("allowed_token_ids", allowed)):
            self.check_vocabulary(ids, f"{name} names token ids {{}}", SpecforkError, name)
        if allowed:
            usable = set(allowed) - {w[-1] for w in bad_words}  # each may be held back where its word began
            if not usable:
                raise SpecforkError("every token of allowed_token_ids ends a bad word: where those words begin, "
                                    "nothing could be generated", param="allowed_token_ids")
            if params.min_tokens and not usable - stops:
                raise SpecforkError("allowed_token_ids holds only stop tokens, which min_tokens holds back: nothing "
                                    "could be generated", param="allowed_token_ids")

    def bad_word_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """The token sequences of a request's bad words, as vLLM makes them: each word (leading
        spaces stripped) on its own and after a space, the second only where it is as many
        tokens and starts with another token."""
        if not params.bad_words:
            return ()
        if self.tokenizer is None:
            raise SpecforkError("bad_words needs the model's tokenizer, and this model has none", param="bad_words")
        found: list[tuple[int, ...]] = []
        for word in params.bad_words:
            alone = tuple(self.tokenizer.encode_fragment(word.lstrip()))
            spaced = tuple(self.tokenizer.encode_fragment(" " + word.lstrip()))
            found.append(alone)
            if len(spaced) == len(alone) and spaced[0] != alone[0]:
                found.append(spaced)
        return tuple(dict.fromkeys(found))

    def check_length(self, prompt_len: int, max_tokens: int) -> None:
        """The one length rule of every entry point (API, CLI, server): the prompt plus
        ``max_tokens`` must fit in the context (``max_model_len``)."""
        if prompt_len + max_tokens > self.max_model_len:
            raise PromptError(
                f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) is {prompt_len + max_tokens} "
                f"tokens, more than the context holds (max_model_len {self.max_model_len}); lower max_tokens "
                f"to at most {max(self.max_model_len - prompt_len, 0)}", param="max_tokens",
            )

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        self.check_prompt_ids(prompt_ids)
        self.check_length(len(prompt_ids), params.max_tokens)
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        bad_words = self.bad_word_ids(params)
        self.check_sampling_ids(params, stops, bad_words)
        seq_id = next(self._ids)
        gen = torch.Generator(device=self.device)
        # Any engine seed works: the derived seed is taken modulo 2**64 (small seeds are unchanged).
        gen.manual_seed(params.seed if params.seed is not None else (self.config.seed * 1_000_003 + seq_id) & 0xFFFF_FFFF_FFFF_FFFF)
        grammar = self.grammars.grammar(params.structured_outputs) if params.structured_outputs is not None else None
        seq = Sequence(seq_id, prompt_ids, params, gen, stops, bad_words, grammar)
        self.scheduler.add(seq)
        return seq

    def close(self) -> None:
        """Release what the engine holds outside this process (a drafter process, tensor-parallel
        ranks)."""
        self.step_strategy.close()
        self._close_world()
        self._restore_threads()

    def _close_world(self) -> None:
        if self.parallel:
            self.parallel.close()
        if self.world:
            self.world.close()

    def health(self) -> StepHealth:
        """How the decoding step's helpers are doing (an SSD drafter that failed: degraded)."""
        return self.step_strategy.health()

    def idle(self) -> None:
        """No request to run: the step looks after its helpers (a server calls this while idle)."""
        self.step_strategy.idle()

    def abort(self, seq: Sequence) -> None:
        if not seq.is_finished:
            seq.finish_reason = "abort"
            seq.finish_time = time.perf_counter()
            self.scheduler.finish(seq)

    def _release(self, seq: Sequence) -> None:
        self.step_strategy.release(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop ------------------------------------------------------------------------

    def step(self) -> list[StepUpdate]:
        """Schedule, run and commit one batch.

        A failure while running the batch fails the batch's requests (finish_reason "error",
        resources freed); a failure while committing one sequence's tokens fails that sequence
        only. Either way the engine stays consistent and the failures come back as updates
        with ``error`` set (logged with their traceback)."""
        batch = self.scheduler.schedule(self.step_strategy.lookahead)
        if batch is None:
            return []
        try:
            produced = self.step_strategy.execute(batch)
        except EngineFailure:
            raise
        except Exception:
            logger.exception("running a batch of %d sequences failed; failing them", len(batch.seqs))
            return [self._fail(seq, "the batch this request ran in failed") for seq in batch.seqs]
        for seq in batch.seqs:
            self.block_manager.register(seq, seq.token_ids, seq.num_cached_tokens)
        now = time.perf_counter()
        updates = []
        for seq, new in produced.items():
            try:
                updates.append(self._commit(seq, new, now))
            except Exception:
                logger.exception("committing the tokens of sequence %d failed; failing it", seq.seq_id)
                updates.append(self._fail(seq, "committing this request's tokens failed"))
        return updates

    def _commit(self, seq: Sequence, new: NewTokens, now: float) -> StepUpdate:
        accepted = self._append(seq, new.ids)
        logprobs = None
        if seq.logprobs is not None and new.logprobs is not None:
            logprobs = new.logprobs[: len(accepted)]
            seq.logprobs.extend(logprobs)
        self.step_strategy.committed(seq)
        if seq.first_token_time is None and accepted:
            seq.first_token_time = now
        if seq.finish_reason is not None:
            seq.finish_time = now
            self.scheduler.finish(seq)
        return StepUpdate(seq, accepted, seq.finish_reason is not None, logprobs)

    def _fail(self, seq: Sequence, message: str) -> StepUpdate:
        if not seq.is_finished:
            seq.finish_reason = "error"
            seq.finish_time = time.perf_counter()
            self.scheduler.finish(seq)
        return StepUpdate(seq, [], True, error=message)

    def _append(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """Append tokens one by one, stopping at the first stop condition. (A stop token cannot come
        before ``min_tokens``: sampling holds it back; a stop string counts once the output is
        longer, as in vLLM.)"""
        params = seq.params
        accepted = []
        for tok in tokens:
            seq.token_ids.append(tok)
            accepted.append(tok)
            if tok in seq.stop_ids:
                seq.finish_reason = "stop"
            elif params.stop and seq.num_output_tokens > params.min_tokens and self._hit_stop_string(seq):
                seq.finish_reason = "stop"
            elif seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                break
        return accepted

    def _hit_stop_string(self, seq: Sequence) -> bool:
        if self.tokenizer is None:
            return False
        return _first_stop(self._decode_output(seq), seq.params.stop, self._stops_from(seq))[0] >= 0

    def _stops_from(self, seq: Sequence) -> int:
        """Where in the output's text a stop string may end, at the earliest: past the text of its
        first ``min_tokens`` tokens (a character they only began is not theirs: vLLM's detokenizer
        has not emitted it yet)."""
        if seq.params.min_tokens == 0:
            return 0
        ids = seq.output_token_ids[: seq.params.min_tokens]
        text = self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)
        return len(text.rstrip("\ufffd")) + 1

    def _decode_output(self, seq: Sequence) -> str:
        """The output's text. A token that ended it (EOS or a stop id) is left out, as vLLM does,
        unless ``include_stop_str_in_output``; it stays in the token ids."""
        ids = seq.output_token_ids
        if (seq.finish_reason == "stop" and ids and ids[-1] in seq.stop_ids
                and not seq.params.include_stop_str_in_output):
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)

    def visible_text(self, seq: Sequence) -> str:
        """The decoded output, cut before the first stop string (after it, with
        ``include_stop_str_in_output``)."""
        if self.tokenizer is None:
            return ""
        text = self._decode_output(seq)
        cut, stop = _first_stop(text, seq.params.stop, self._stops_from(seq))
        if cut < 0:
            return text
        return text[: cut + len(stop)] if seq.params.include_stop_str_in_output else text[:cut]

    def output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            request_id=seq.seq_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=self.visible_text(seq),
            finish_reason=seq.finish_reason or "abort",
            metrics=self.metrics(seq),
            logprobs=None if seq.logprobs is None else list(seq.logprobs),
            prompt_logprobs=None if seq.prompt_logprobs is None else list(seq.prompt_logprobs),
        )

    def metrics(self, seq: Sequence) -> dict:
        end = seq.finish_time or time.perf_counter()
        n = seq.num_output_tokens
        total = end - seq.arrival_time
        ttft = (seq.first_token_time - seq.arrival_time) if seq.first_token_time else None
        tpot = (end - seq.first_token_time) / (n - 1) if seq.first_token_time and n > 1 else None
        return {
            "num_prompt_tokens": seq.num_prompt_tokens,
            "num_generated_tokens": n,
            "time_s": total,
            "ttft_s": ttft,
            "tpot_s": tpot,
            "tokens_per_s": n / total if total > 0 else None,
            "num_preemptions": seq.num_preemptions,
            "num_cached_prompt_tokens": seq.num_prompt_tokens_reused,
            **{k: v for stat in seq.stats.values() for k, v in stat.as_metrics().items()},
        }


def _restore_threads(before: int, set_here: int) -> None:
    if torch.get_num_threads() == set_here:
        torch.set_num_threads(before)


def _start_world(config: Config, num_blocks: int, extra_roles: tuple):
    """The torch.distributed world (None when the engine needs no other rank): the model's
    tensor-parallel shards on ranks 1..N-1, then ``extra_roles``. The other ranks load while rank
    0 does. On a torchrun rank other than 0 its role runs here, and the process then ends."""
    if config.tensor_parallel_size == 1 and not extra_roles:
        return None
    import os

    from specfork.engine.shard_role import SHARD_ROLE
    from specfork.parallel.group import ShardLaunch
    from specfork.parallel.world import RankRole, World, WorldPlan

    if config.tensor_parallel_size > 1:  # before any rank starts: a split that cannot be is a clear error at once
        from specfork.loading.loader import read_arch
        from specfork.models.tensor_parallel import TensorShard

        TensorShard(0, config.tensor_parallel_size, reduce=None).heads(read_arch(config.model))
    cores = len(os.sched_getaffinity(0))
    threads = config.threads or max(1, cores // config.tensor_parallel_size)
    if config.threads is not None and config.distributed_launch == "local" and threads * config.tensor_parallel_size > cores:
        logger.warning("%d ranks of %d threads each on %d cores: their threads wait on one another (measured: "
                       "5x slower than the default, cores / ranks threads each); leave --threads out",
                       config.tensor_parallel_size, threads, cores)
    torch.set_num_threads(threads)
    launch = ShardLaunch(
        model=config.model, dtype=config.torch_dtype_name, max_positions=config.max_model_len,
        load_options=config.load_options, num_blocks=num_blocks, block_size=config.block_size,
        kv_dtype=config.kv_cache_dtype, deterministic=config.deterministic, threads=threads,
    )
    roles = (RankRole(SHARD_ROLE, launch),) * (config.tensor_parallel_size - 1) + tuple(extra_roles)
    plan = WorldPlan(roles, config.tensor_parallel_size, config.device, config.dist_timeout_s)
    world = World.start(plan, config.distributed_launch)
    if world is None:  # this torchrun rank served its role until rank 0 finished
        raise SystemExit(0)
    return world


def _first_stop(text: str, stops: tuple[str, ...], ends_from: int = 0) -> tuple[int, str]:
    """Index of the earliest stop string in ``text`` that ends at character ``ends_from`` or later
    (its end: the index after its last character), and that string (the longest of those found
    there), or (-1, "")."""
    found = [(i, -len(stop), stop) for stop in stops if (i := text.find(stop, max(0, ends_from - len(stop)))) >= 0]
    if not found:
        return -1, ""
    index, _, stop = min(found)
    return index, stop
