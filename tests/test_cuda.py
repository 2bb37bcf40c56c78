"""The same engine on CUDA (skipped without a GPU): logits against transformers on the GPU,
speculative decoding against AR (draft model, n-gram lookup, EAGLE-3 head; SD and SSD), lossless
sampling with a reduced-vocabulary head and with SSD, bf16 generation, and training a head on the
GPU."""

import pytest
import torch
from eagle3_heads import HEAD_DRAFT_IDS
from helpers import assert_greedy_match, head_step_inputs, step_logits
from lossless import (
    NUM_TOKENS,
    PROMPT,
    SETTINGS,
    check,
    exact_joint,
    marginal,
    sample_ssd,
    sampling_params,
    ssd_models,
)

from specfork import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[1, 5, 9, 13, 2, 7], [1, 44, 3], [1, 8, 8, 8, 8, 8, 8, 20, 21]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _hf_logits(path, prompt, tokens, device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).to(device).eval()
    ids = torch.tensor([prompt + tokens], device=device)
    with torch.no_grad():
        return model(ids).logits[0, len(prompt) - 1 :].float().cpu()


def test_cuda_greedy_matches_transformers(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint.path), device="cuda")
    out = llm.generate([PROMPTS[0]], GREEDY)[0].token_ids
    ref_logits = _hf_logits(str(tiny_checkpoint.path), PROMPTS[0], out, "cuda")
    ref = ref_logits.argmax(-1).tolist()[: len(out)]
    assert_greedy_match(out, ref, ref_logits, atol=1e-3, rtol=1e-4)


def test_cuda_logits_match_cpu(tiny_checkpoints):
    path = str(tiny_checkpoints["llama-gqa-tied"].path)
    gpu = LLM(path, device="cuda")
    seq = gpu.engine.add_request(PROMPTS[2], GREEDY)
    gpu.engine.block_manager.grow(seq, len(PROMPTS[2]))
    logits = gpu.engine.runner.forward([seq], [0], [PROMPTS[2]], list(range(len(PROMPTS[2]))), decode=False)
    gpu.engine.abort(seq)
    ref = _hf_logits(path, PROMPTS[2][:1], PROMPTS[2][1:], "cpu")
    torch.testing.assert_close(logits.cpu(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("drafter", ["draft", "ngram"])
def test_cuda_sd_equals_ar(tiny_checkpoints, drafter):
    path = str(tiny_checkpoints["llama-gqa-tied"].path)
    ar = LLM(path, device="cuda")
    draft = str(tiny_checkpoints["llama3-rope-untied-sharded"].path)
    sd = LLM(path, device="cuda", mode="sd", drafter=drafter, draft=draft if drafter == "draft" else None, k=4)
    for prompt, ours in zip(PROMPTS, sd.generate(PROMPTS, GREEDY), strict=True):
        ref = ar.generate([prompt], GREEDY)[0].token_ids
        ref_logits = _hf_logits(path, prompt, ref, "cuda")
        assert_greedy_match(ours.token_ids, ref, ref_logits, atol=1e-3, rtol=1e-4)


def test_cuda_sampling_with_seed_is_reproducible(tiny_checkpoints):
    path = str(tiny_checkpoints["qwen2-bias-untied"].path)
    llm = LLM(path, device="cuda", mode="sd", drafter="ngram", k=3)
    p = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, seed=3, ignore_eos=True)
    a = llm.generate(PROMPTS, p)
    b = llm.generate(PROMPTS, p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_cuda_bf16_generates(tiny_checkpoints):
    path = str(tiny_checkpoints["qwen3-qknorm-tied"].path)
    fp32 = LLM(path, device="cuda").generate(PROMPTS, GREEDY)
    bf16 = LLM(path, device="cuda", dtype="bfloat16").generate(PROMPTS, GREEDY)
    assert all(len(o.token_ids) == 32 for o in bf16)
    # bf16 rounding may change late tokens, but the first token of a healthy model agrees
    assert sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(fp32, bf16, strict=True)) >= 2


def test_cuda_ssd_greedy_equals_ar(tiny_checkpoints):
    path = str(tiny_checkpoints["llama-gqa-tied"].path)
    draft = str(tiny_checkpoints["llama3-rope-untied-sharded"].path)
    ar = LLM(path, device="cuda", deterministic=True).generate(PROMPTS, GREEDY)
    with LLM(path, device="cuda", mode="ssd", draft=draft, k=3, deterministic=True) as ssd:
        out = ssd.generate(PROMPTS, GREEDY)
        assert ssd.engine.step_strategy.proposer.failure is None
    assert [o.token_ids for o in out] == [o.token_ids for o in ar]


@pytest.mark.parametrize("backup", ["jit", "fast"])
def test_cuda_ssd_sampling_is_lossless(tmp_path, backup):
    """At temperature > 0 the drafter's q crosses the pipe and is verified on the target's GPU:
    the output distribution is still exactly the target's."""
    models = ssd_models(tmp_path)
    params_kw = SETTINGS["temperature"]
    joint = exact_joint(models["hf_target"], SamplingParams(**params_kw), NUM_TOKENS)
    samples = sample_ssd(models, params_kw, backup, None, 6000, device="cuda")
    for name, (stat, dof, limit) in check(samples, joint).items():
        assert stat < limit, f"{backup} {name}: chi2 {stat:.1f} >= {limit:.1f} (dof {dof})"


HEAD_PROMPTS = [PROMPT, [2, 4], [6, 1, 1, 0, 3], [5]]
HEAD_GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("mode, k", [("sd", 3), ("sd", 5), ("ssd", 3)])
def test_cuda_greedy_with_an_eagle3_head_equals_ar(head_pair, mode, k):
    """The head reads the target's features captured on the GPU; SSD's drafter process gets them
    over the pipe; greedy output equals AR on the GPU, batch 1 and 4."""
    ar = LLM(head_pair["target"], device="cuda", deterministic=True).generate(HEAD_PROMPTS, HEAD_GREEDY)
    with LLM(head_pair["target"], device="cuda", mode=mode, draft=head_pair["draft"], k=k,
             deterministic=True) as llm:
        for batch in ([HEAD_PROMPTS[0]], HEAD_PROMPTS):
            outs = llm.generate(batch, HEAD_GREEDY)
            assert [o.token_ids for o in outs] == [o.token_ids for o in ar[: len(batch)]]
        if mode == "ssd":
            assert llm.engine.step_strategy.proposer.failure is None
        else:
            assert llm.engine.step_strategy.proposer.drafts.graphs.graphs, "no drafting step was graphed"
    accepted = sum(o.metrics["draft_tokens_accepted"] for o in outs)
    assert 0 < accepted < sum(o.metrics["draft_tokens_proposed"] for o in outs)


def test_cuda_sd_with_a_reduced_vocabulary_head_is_lossless(head_pair):
    """Draft probabilities scattered into the full vocabulary on the GPU: the target's tokens
    outside the draft vocabulary keep their exact probability."""
    params_kw = SETTINGS["temperature"]
    joint = exact_joint(head_pair["hf_target"], SamplingParams(**params_kw), NUM_TOKENS)
    assert sum(p for t, p in marginal(joint, (0,)).items() if t[0] not in HEAD_DRAFT_IDS) > 0.1
    n = 6000
    llm = LLM(head_pair["target"], device="cuda", mode="sd", draft=head_pair["draft"], k=3, max_num_seqs=512,
              kv_cache_tokens=512 * 16)
    outs = llm.generate([PROMPT] * n, [sampling_params(i, params_kw) for i in range(n)])
    assert 0 < sum(o.metrics["draft_tokens_accepted"] for o in outs) < sum(
        o.metrics["draft_tokens_proposed"] for o in outs)
    for name, (stat, dof, limit) in check([tuple(o.token_ids) for o in outs], joint).items():
        assert stat < limit, f"{name}: chi2 {stat:.1f} >= {limit:.1f} (dof {dof})"


def test_cuda_trains_an_eagle3_head(tmp_path):
    """``train-draft --kind eagle3 --device cuda`` on a tiny target: features captured on the GPU,
    the head trained there (bf16 autocast), the loss falls and the saved head drafts in SD."""
    import random

    from builders import build_tiny_checkpoint

    from specfork.training import pipeline
    from specfork.training.data import Example
    from specfork.training.settings import Eagle3Settings, TrainDraftJob, TrainSettings
    from specfork.training.trainer import is_eval_example

    target = build_tiny_checkpoint("llama-gqa-tied", tmp_path, seed=11).path
    ids = [f"ex{i}" for i in range(200)]
    held_out = [i for i in ids if is_eval_example(Example("test", i, [], []))][:3]
    chosen = [i for i in ids if i not in held_out][:21] + held_out
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(4, 12))] for _ in chosen]
    outputs = LLM(str(target), device="cuda").generate(prompts, SamplingParams(temperature=0.0, max_tokens=24,
                                                                               ignore_eos=True))
    examples = [Example("test", i, p, o.token_ids) for i, p, o in zip(chosen, prompts, outputs, strict=True)]
    job = TrainDraftJob(
        target=str(target), kind="eagle3", output=tmp_path / "head", work_dir=tmp_path / "work", device="cuda",
        train=TrainSettings(epochs=6.0, batch_tokens=128, max_seq_len=48, lr=3e-3, warmup_steps=2,
                            checkpoint_every=8),
        eagle3=Eagle3Settings(ttt_steps=3, draft_vocab=128, feature_batch=4, shard_size=8),
        eval_prompts=0, progress=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "generate_data", lambda job, llm: examples)
        result = pipeline.train_draft(job, command="test")
    assert result["machine"]["device"] == "cuda" and result["head"]["matmul_dtype"] == "torch.bfloat16"
    assert result["last_loss"] < result["first_loss"] - 0.5, result
    sd = LLM(str(target), device="cuda", mode="sd", draft=str(job.output), k=3, deterministic=True)
    ar = LLM(str(target), device="cuda", deterministic=True)
    assert [o.token_ids for o in sd.generate(prompts[:4], HEAD_GREEDY)] == [
        o.token_ids for o in ar.generate(prompts[:4], HEAD_GREEDY)]


GRAPH_PROMPTS = [[1, 5, 9, 13, 2, 7], [1, 44, 3], [1, 8, 8, 8, 8, 8, 8, 20, 21, 3, 4, 5, 6, 7]]


@pytest.mark.parametrize("windows", [[[4], [9], [2]], [[4, 5, 6, 7], [9, 9, 9, 1], [2, 3, 1, 0]],
                                     [[4, 5], [9], [2, 3, 1]]])
@pytest.mark.parametrize("deterministic", [True, False])
def test_cuda_graph_replay_equals_the_eager_step(tiny_checkpoints, windows, deterministic):
    """A decode step (one row per sequence), a verify window (four) and windows of different
    lengths (padded to the longest), three sequences: the
    first step of the shape runs eagerly and is captured, the next ones replay the graph over
    the same cache slots and give the same logits bit for bit. Against the runner without
    graphs (unpadded context, no static buffers): bit for bit in deterministic mode, within
    rounding otherwise."""
    path = str(tiny_checkpoints["llama-gqa-tied"].path)
    graphed = LLM(path, device="cuda", deterministic=deterministic)
    (first, *replays), caches = step_logits(graphed, GRAPH_PROMPTS, windows, repeat=3)
    assert len(graphed.engine.runner.graphs.graphs) == 1
    assert all(torch.equal(first, r) for r in replays)
    eager = LLM(path, device="cuda", deterministic=deterministic, cuda_graphs=False)
    assert eager.engine.runner.graphs is None
    (want,), want_caches = step_logits(eager, GRAPH_PROMPTS, windows)
    if deterministic:  # the last block is the scratch block padded rows write; no sequence reads it
        assert torch.equal(first, want)
        assert all(torch.equal(a[:, :-1], b[:, :-1]) for a, b in zip(caches, want_caches, strict=True))
    else:
        torch.testing.assert_close(first, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["ar", "sd-ngram", "sd-draft"])
def test_cuda_greedy_on_graphs_equals_eager_ar(tiny_checkpoints, mode):
    """Whole generations, batch 3, steps replayed from graphs: token for token the eager AR
    output (deterministic mode)."""
    path = str(tiny_checkpoints["llama-gqa-tied"].path)
    draft = str(tiny_checkpoints["llama3-rope-untied-sharded"].path)
    ar = LLM(path, device="cuda", deterministic=True, cuda_graphs=False).generate(GRAPH_PROMPTS, GREEDY)
    options = {"ar": {}, "sd-ngram": {"mode": "sd", "drafter": "ngram", "k": 4},
               "sd-draft": {"mode": "sd", "draft": draft, "k": 3}}[mode]
    llm = LLM(path, device="cuda", deterministic=True, **options)
    out = llm.generate(GRAPH_PROMPTS, GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in ar]
    assert llm.engine.runner.graphs.graphs, "no step was graphed"


def test_cuda_head_steps_replay_their_graph(head_pair):
    """An EAGLE-3 head's drafting step (hidden states in, outputs and draft logits out), three
    sequences: captured on first use, replayed after with the same results bit for bit, and
    within rounding of the head run eagerly."""
    llm = LLM(head_pair["target"], device="cuda", mode="sd", draft=head_pair["draft"], k=3)
    drafts, states, context, tokens, hidden = head_step_inputs(llm, "cuda")
    first, *replays = [drafts.decode_step(states, context, tokens, hidden) for _ in range(3)]
    assert len(drafts.graphs.graphs) == 1
    assert all(torch.equal(a, b) for r in replays for a, b in zip(first, r, strict=True))
    graphs, drafts.graphs = drafts.graphs, None
    eager = drafts.decode_step(states, context, tokens, hidden)
    drafts.graphs = graphs
    for a, b in zip(first, eager, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
