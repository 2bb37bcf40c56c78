"""The prefix cache: full KV blocks of computed tokens found again by their contents, shared by
reference, evicted oldest first; and in the engine, outputs bit-identical to computing every
prompt in full, under preemption, chunked prefill, sampling and speculative decoding."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specfork import LLM, SamplingParams
from specfork.engine.block_manager import BlockManager
from specfork.engine.sequence import Sequence


def _seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(max_tokens=1), torch.Generator())


def _computed(blocks: BlockManager, tokens: list[int], seq_id: int = 0) -> Sequence:
    """A sequence holding blocks for ``tokens``, all of them computed and registered."""
    seq = _seq(tokens, seq_id)
    blocks.grow(seq, len(tokens))
    seq.num_cached_tokens = len(tokens)
    blocks.register(seq, seq.token_ids, seq.num_cached_tokens)
    return seq


def _admit(blocks: BlockManager, seq: Sequence, limit: int) -> int:
    blocks.take_prefix(seq, blocks.cached_prefix(seq.token_ids, limit))
    return seq.num_cached_tokens


def test_a_prompt_takes_the_full_blocks_another_computed_up_to_where_they_differ():
    blocks = BlockManager(16, 4, prefix_caching=True)
    first = _computed(blocks, list(range(10, 30)))  # 5 full blocks
    other = _seq(list(range(10, 20)) + [99] + list(range(21, 30)), 1)  # differs in block 2
    assert _admit(blocks, other, len(other) - 1) == 8
    assert other.block_table == first.block_table[:2]
    # what was taken is shared, not free: the first sequence's release keeps it held
    blocks.register(first, first.token_ids, first.num_cached_tokens)
    blocks.free(first)
    assert blocks.num_used_blocks == 2
    assert all(b not in blocks.allocate(blocks.num_free_blocks) for b in other.block_table)


def test_the_limit_leaves_the_prompts_last_tokens_to_compute():
    blocks = BlockManager(16, 4, prefix_caching=True)
    _computed(blocks, list(range(16)))
    same = _seq(list(range(16)), 1)
    assert _admit(blocks, same, len(same) - 1) == 12  # the last block would leave nothing to compute


def test_only_full_computed_blocks_are_found_and_a_different_start_finds_none():
    blocks = BlockManager(16, 4, prefix_caching=True)
    seq = _seq(list(range(14)))
    blocks.grow(seq, 14)
    seq.num_cached_tokens = 9  # blocks 0 and 1 computed, block 2 partly
    blocks.register(seq, seq.token_ids, seq.num_cached_tokens)
    assert len(blocks.cached_prefix(list(range(14)), 13)) == 2
    assert blocks.cached_prefix([7] + list(range(1, 14)), 13) == []  # keys chain from the first block


def test_a_cache_whose_rows_read_the_next_token_keys_blocks_by_it_too():
    """An EAGLE-3 head's row t reads the token at t + 1: its block holding rows 0..3 is found only
    by a prompt whose token 4 is the same, and only once that token exists."""
    blocks = BlockManager(16, 4, prefix_caching=True, lookahead=1)
    seq = _seq(list(range(10)))
    blocks.grow(seq, 9)
    blocks.register(seq, seq.token_ids, 9)  # rows 0..8 computed: blocks 0 and 1 (rows 4..7 read token 8)
    assert len(blocks.cached_prefix(list(range(12)), 8)) == 2
    assert len(blocks.cached_prefix(list(range(8)) + [99], 8)) == 1  # token 8 differs: rows 4..7 differ
    assert len(blocks.cached_prefix(list(range(8)), 8)) == 1  # no token 8 yet
    short = _seq(list(range(8)), 1)
    blocks.grow(short, 8)
    blocks.register(short, short.token_ids, 8)  # row 7 would read token 8: block 1 is not final
    assert len(short.block_keys) == 1


def test_a_held_copy_replaces_an_idle_one_and_empty_blocks_go_first():
    """Two blocks with the same contents (one computed while the other sat idle in the pool): the
    key moves to the held one, so the next prompt shares it instead of taking the idle copy; and
    a freed block with nothing registered in it is handed out before any cached one."""
    blocks = BlockManager(8, 4, prefix_caching=True)
    first = _computed(blocks, list(range(8)))
    blocks.free(first)  # its 2 blocks idle, findable
    again = _seq(list(range(8)) + [9], 1)  # computed anew, not from the cache
    blocks.grow(again, 9)
    again.num_cached_tokens = 9
    blocks.register(again, again.token_ids, 9)
    assert [b for b, _ in blocks.cached_prefix(list(range(9)), 8)] == again.block_table[:2]
    table = list(again.block_table)
    blocks.free(again)  # its third block holds nothing findable
    assert blocks.allocate(1) == [table[2]]
    assert [b for b, _ in blocks.cached_prefix(list(range(9)), 8)] == table[:2]


def test_freed_blocks_stay_findable_until_handed_out_last_blocks_first():
    blocks = BlockManager(8, 4, prefix_caching=True)
    seq = _computed(blocks, list(range(16)))  # blocks for 4 x 4 tokens
    table = list(seq.block_table)
    blocks.free(seq)
    assert blocks.num_used_blocks == 0
    later = list(range(16)) + [5]
    assert len(blocks.cached_prefix(later, 16)) == 4
    blocks.allocate(4)  # the 4 never-used blocks go first
    assert len(blocks.cached_prefix(later, 16)) == 4
    assert blocks.allocate(1) == [table[-1]]  # then the freed sequence's last block
    assert [b for b, _ in blocks.cached_prefix(later, 16)] == table[:3]


def test_shrinking_and_disabling():
    blocks = BlockManager(8, 4, prefix_caching=True)
    seq = _computed(blocks, list(range(12)))
    blocks.shrink(seq, 5)  # block 1 is cut into: written again from token 5, so no longer findable
    assert len(seq.block_keys) == 1 and len(seq.block_table) == 2
    assert len(blocks.cached_prefix(list(range(12)), 11)) == 1
    off = BlockManager(8, 4)
    _computed(off, list(range(12)))
    assert off.cached_prefix(list(range(12)), 11) == []


# -- the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=95, bos_token_id=1)
    path = tmp_path_factory.mktemp("tiny_prefix")
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return str(path)


SHARED = [1] + [(7 * i) % 90 + 2 for i in range(37)]  # 38 tokens: 9 full blocks of 4 and 2 more
PROMPTS = [SHARED + [40, 41, 42], SHARED + [50], SHARED[:21] + [60, 61, 62, 63, 64], SHARED + [40, 41, 42],
           [1, 70, 71]]


def _outputs(llm: LLM, params) -> list[tuple[list[int], list[float]]]:
    """Each prompt alone, in order (so later ones can find what earlier ones computed)."""
    outs = [llm.generate([p], sp)[0] for p, sp in zip(PROMPTS, params, strict=True)]
    return [(o.token_ids, [e.logprob for e in o.logprobs or []]) for o in outs]


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_outputs_with_the_cache_equal_computing_every_prompt_in_full(tiny_dir, mode):
    spec = {"mode": "sd", "drafter": "ngram", "k": 3} if mode == "sd" else {}
    greedy = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)] * len(PROMPTS)
    seeded = [SamplingParams(temperature=0.9, top_k=30, max_tokens=20, ignore_eos=True, seed=7 + i)
              for i in range(len(PROMPTS))]
    full = LLM(tiny_dir, deterministic=True, block_size=4, prefix_caching=False, **spec)
    cached = LLM(tiny_dir, deterministic=True, block_size=4, **spec)
    for params in (greedy, seeded):
        assert _outputs(cached, params) == _outputs(full, params)
    assert full.engine.block_manager.prefix_hit_tokens == 0
    # first pass: prompt 1 finds prompt 0's 9 shared blocks, prompt 2 five of them, prompt 3 (prompt
    # 0 again) all 10 below its last token; second pass: prompt 0 its 10, prompt 1 9, prompt 2 its 6
    assert cached.engine.block_manager.prefix_hit_tokens == (36 + 20 + 40) + (40 + 36 + 24 + 40)
    assert cached.engine.block_manager.num_used_blocks == 0


def test_under_preemption_and_chunked_prefill_outputs_are_unchanged(tiny_dir):
    """A tiny cache: sequences sharing blocks are preempted, give back only what no other holds,
    and come back finding their own blocks; prompts prefilled a few tokens a step."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [LLM(tiny_dir, deterministic=True, prefix_caching=False).generate([p], greedy)[0].token_ids
                for p in PROMPTS]
    tight = LLM(tiny_dir, deterministic=True, block_size=4, num_kv_blocks=24, max_num_batched_tokens=6)
    outs = tight.generate(PROMPTS, greedy)
    assert [o.token_ids for o in outs] == expected
    assert tight.engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert tight.engine.block_manager.prefix_hit_tokens > 0
    assert tight.engine.block_manager.num_used_blocks == 0, "blocks leaked"


def test_a_request_for_prompt_logprobs_computes_its_whole_prompt(tiny_dir):
    llm = LLM(tiny_dir, deterministic=True, block_size=4)
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1))
    want = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    out = llm.generate([PROMPTS[3]], want)[0]  # the same prompt again
    assert out.metrics["num_cached_prompt_tokens"] == 0
    alone = LLM(tiny_dir, deterministic=True, block_size=4, prefix_caching=False).generate([PROMPTS[3]], want)[0]
    assert [(e.token_id, e.logprob) for e in out.prompt_logprobs] == \
        [(e.token_id, e.logprob) for e in alone.prompt_logprobs]
    again = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=1))[0]
    assert again.metrics["num_cached_prompt_tokens"] == 40  # its full blocks below its last token


def test_sd_with_a_head_takes_the_heads_cached_rows_with_the_targets(head_pair):
    """The head's row t reads the target's features at t, which a cached prefix does not
    compute again: the head keeps its own rows of those blocks cached, the target takes only
    what the head also holds, and SD's outputs (greedy and sampled, so the head's distributions
    too) are those of computing every prompt in full."""
    shared = [(3 * i + 1) % 8 for i in range(13)]
    prompts = [shared + [2, 4], shared + [5], shared[:9] + [6, 1], shared + [2, 4], shared[:12] + [7, 7]]
    greedy = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * len(prompts)
    seeded = [SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=3 + i) for i in range(len(prompts))]

    def run(llm, params):
        outs = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params, strict=True)]
        return [o.token_ids for o in outs], sum(o.metrics["draft_tokens_accepted"] for o in outs[1:])

    spec = {"mode": "sd", "draft": head_pair["draft"], "k": 3, "deterministic": True, "block_size": 4}
    full, cached = LLM(head_pair["target"], prefix_caching=False, **spec), LLM(head_pair["target"], **spec)
    for params in (greedy, seeded):
        expected, _ = run(full, params)
        got, accepted = run(cached, params)
        assert got == expected
        assert accepted > 0  # the sequences that took a prefix still got the head's drafts
    head_blocks = cached.engine.step_strategy.proposer.drafts.blocks
    # whole blocks of 4 below each prompt's last token: prompts 1-4 of the first pass find 12, 8, 12
    # and 8 tokens (prompt 4's token 12 differs from the others', so the head's rows 8..11, which
    # read it, do: the target takes 8 of its 12 cached tokens); the second pass 12, 12, 8, 12, 12
    assert cached.engine.block_manager.prefix_hit_tokens == head_blocks.prefix_hit_tokens == 40 + 56
    assert cached.engine.block_manager.num_used_blocks == 0 and head_blocks.num_used_blocks == 0


def test_ssd_with_a_head_takes_no_cached_prefix():
    from specfork.speculative.ssd.proposer import SSDProposer

    proposer = SSDProposer.__new__(SSDProposer)
    proposer.feature_layers = (2, 5, 8)
    assert proposer.usable_prefix(None, 32) == 0
    proposer.feature_layers = ()
    assert proposer.usable_prefix(None, 32) == 32


def test_a_prompt_of_whole_blocks_seen_before_still_computes_its_last_token(tiny_dir):
    llm = LLM(tiny_dir, deterministic=True, block_size=4)
    prompt = SHARED[:36]  # 9 full blocks
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first, again = (llm.generate([prompt], greedy)[0] for _ in range(2))
    assert again.metrics["num_cached_prompt_tokens"] == 32 and again.token_ids == first.token_ids


def test_a_head_whose_cache_is_full_drafts_nothing_instead_of_failing(head_pair):
    """A prefix taken from the head's cache can cost it blocks that the target's shared copy did
    not, so its cache can fill first: sequences it has no room for decode plainly that round."""
    llm = LLM(head_pair["target"], mode="sd", draft=head_pair["draft"], k=3, deterministic=True, block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [3, 3, 0, 2]]
    expected = [o.token_ids for o in LLM(head_pair["target"], deterministic=True).generate(prompts, greedy)]
    head_blocks = llm.engine.step_strategy.proposer.drafts.blocks
    taken = head_blocks.allocate(head_blocks.num_free_blocks - 3)  # room for one sequence's rows at most
    outs = llm.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == expected and all(o.finish_reason == "length" for o in outs)
    head_blocks.release_blocks(taken)
    assert sum(o.metrics["draft_tokens_proposed"] for o in llm.generate(prompts, greedy)) > \
        sum(o.metrics["draft_tokens_proposed"] for o in outs)


def test_a_head_that_never_drafted_caches_its_rows_when_its_request_ends(head_pair):
    """A request that ended after one token never had the head draft (nor run the prompt's
    features); it runs them as the request ends, so a prompt repeating the start finds the head's
    rows, and with them the target's blocks."""
    shared = [(3 * i + 1) % 8 for i in range(13)]
    spec = {"mode": "sd", "draft": head_pair["draft"], "k": 3, "deterministic": True, "block_size": 4}
    llm = LLM(head_pair["target"], **spec)
    first = llm.generate([shared + [2, 4]], SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert first.metrics.get("draft_tokens_proposed", 0) == 0  # no round ran
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    out = llm.generate([shared + [5]], greedy)[0]
    assert out.metrics["num_cached_prompt_tokens"] == 12
    expected = LLM(head_pair["target"], prefix_caching=False, **spec).generate([shared + [5]], greedy)[0]
    assert out.token_ids == expected.token_ids and out.metrics["draft_tokens_accepted"] > 0


@pytest.mark.parametrize("mode", ["ar", "sd-head"])
def test_prompts_admitted_together_share_their_start(tiny_dir, head_pair, mode):
    """Four requests with the same 38-token start arrive together: the first computes it and the
    others, admitted a step later, take its blocks (AR); under SD with a head, whose rows do not
    exist a step later, they compute it themselves. Outputs are those of no cache either way."""
    target, spec = (tiny_dir, {}) if mode == "ar" else \
        (head_pair["target"], {"mode": "sd", "draft": head_pair["draft"], "k": 3})
    start = SHARED if mode == "ar" else [(3 * i + 1) % 8 for i in range(38)]
    prompts = [start + [t] for t in (3, 4, 5, 6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = LLM(target, deterministic=True, block_size=4, prefix_caching=False, **spec).generate(prompts, greedy)
    llm = LLM(target, deterministic=True, block_size=4, **spec)
    scheduler, admitted = llm.engine.scheduler, []
    prefill = scheduler._schedule_prefill

    def counted():
        batch = prefill()
        if batch is not None:
            admitted.append(len(batch.seqs))
        return batch

    scheduler._schedule_prefill = counted
    outs = llm.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    cached = [o.metrics["num_cached_prompt_tokens"] for o in outs]
    assert cached == ([0, 36, 36, 36] if mode == "ar" else [0, 0, 0, 0])
    assert admitted == [1, 3]  # the others wait one step, never one by one
