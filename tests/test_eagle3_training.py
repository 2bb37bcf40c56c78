"""``train-draft --kind eagle3`` on a tiny random target: the loss falls, a rerun resumes (same
weights as an uninterrupted run, finished feature shards kept), provenance is written, the saved
head loads in the ecosystem's layout and computes the EAGLE-3 formula (step 0 and an unrolled
step, recomputed plainly here), and the draft vocabulary is the smallest size reaching the
coverage."""

from __future__ import annotations

import json
import math
import random
import shutil
from dataclasses import replace

import pytest
import torch
from builders import build_tiny_checkpoint

from specfork import LLM, SamplingParams
from specfork.errors import SpecforkError
from specfork.loading.eagle3 import draft_to_target, load_eagle3_tensors, read_eagle3_config
from specfork.speculative.corpus import load_corpus, save_corpus
from specfork.training import eagle3_pipeline, eagle3_trainer, pipeline
from specfork.training.data import Example
from specfork.training.eagle3_features import FeatureStore, choose_draft_vocab, count_response_tokens
from specfork.training.eagle3_head import Eagle3TrainHead, build_head, head_config, target_head_rows, ttt_loss
from specfork.training.eagle3_trainer import Eagle3Trainer, collate_features
from specfork.training.pipeline import train_draft
from specfork.training.settings import Eagle3Settings, TrainDraftJob, TrainSettings
from specfork.training.trainer import is_eval_example

DRAFT_VOCAB = 128  # of the tiny target's 256: the head maps its ids back to the target's
TTT_STEPS = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_checkpoint("llama-gqa-tied", tmp_path_factory.mktemp("eagle3_target"), seed=11).path


@pytest.fixture(scope="module")
def examples(target) -> list[Example]:
    """The target's greedy responses to random prompts: 21 training examples and 3 held out."""
    ids = [f"ex{i}" for i in range(200)]
    held_out = [i for i in ids if is_eval_example(Example("test", i, [], []))][:3]
    chosen = [i for i in ids if i not in held_out][:21] + held_out
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(4, 12))] for _ in chosen]
    outputs = LLM(str(target)).generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    return [Example("test", i, p, o.token_ids) for i, p, o in zip(chosen, prompts, outputs, strict=True)]


def _job(target, root) -> TrainDraftJob:
    return TrainDraftJob(
        target=str(target), kind="eagle3", output=root / "head", work_dir=root / "work",
        train=TrainSettings(epochs=6.0, batch_tokens=128, max_seq_len=48, lr=3e-3, warmup_steps=2, checkpoint_every=8),
        eagle3=Eagle3Settings(ttt_steps=TTT_STEPS, draft_vocab=DRAFT_VOCAB, feature_batch=4, shard_size=8,
                              precision="fp32"),
        threads=2, eval_prompts=0, progress=False,
    )


def _train(job, examples) -> dict:
    """The whole pipeline, the target's responses being ``examples`` (the tiny target has no
    tokenizer for ShareGPT prompts)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "generate_data", lambda job, llm: examples)
        return train_draft(job, command="test")


@pytest.fixture(scope="module")
def trained(target, examples, tmp_path_factory):
    job = _job(target, tmp_path_factory.mktemp("eagle3_run"))
    return job, _train(job, examples)


def test_training_lowers_the_loss_and_records_provenance(trained, examples):
    job, result = trained
    assert result["train_steps"] == 36  # 21 sequences of 13-35 tokens: 6 batches of <= 128 tokens per epoch, 6 epochs
    assert result["last_loss"] < result["first_loss"] - 0.5, result
    history = torch.load(job.work_dir / "eagle3-checkpoints" / "last.pt", weights_only=True)["history"]
    assert sum(r["top1"] for r in history[-8:]) / 8 > sum(r["top1"] for r in history[:4]) / 4 + 0.3
    saved = json.loads((job.output / "specfork_draft.json").read_text())
    assert saved["kind"] == "eagle3" and saved["command"] == "test"
    assert saved["draft_vocab"] == {"size": DRAFT_VOCAB, "target_vocab": 256, "coverage": pytest.approx(
        result["draft_vocab"]["coverage"])}
    assert 0.5 < saved["draft_vocab"]["coverage"] <= 1.0
    assert saved["examples"] == {"train": 21, "held_out": 3}
    # The target's responses are also written as a lookup corpus (--lookup-corpus).
    corpus = load_corpus(job.work_dir / "lookup_corpus.npz", 256)
    assert saved["lookup_corpus"]["tokens"] == len(corpus) == sum(len(e.response_ids) for e in examples)
    assert [c["step"] for c in saved["curve"]] == [8, 16, 24, 32, 36]  # one evaluation per checkpoint
    final = saved["eval"]
    assert len(final["top1_by_step"]) == TTT_STEPS and final["positions"] > 0
    assert all(0.0 <= x <= 1.0 for x in final["top1_by_step"])
    assert 0.0 <= final["mean_accepted_run"] <= TTT_STEPS
    assert saved["eagle3"]["ttt_steps"] == TTT_STEPS and saved["train"]["lr"] == 3e-3
    assert {"data_seconds_this_run", "feature_seconds_this_run", "train_seconds_this_run"} <= set(saved)


def test_rerun_keeps_feature_shards_and_the_finished_checkpoint(trained, examples):
    job, result = trained
    shards = {p: p.stat().st_mtime_ns for p in (job.work_dir / "features").glob("shard_*.pt")}
    assert len(shards) == 3  # 24 sequences, 8 per shard
    again = _train(job, examples)
    assert {p: p.stat().st_mtime_ns for p in (job.work_dir / "features").glob("shard_*.pt")} == shards
    assert again["train_steps"] == result["train_steps"]
    assert again["last_loss"] == result["last_loss"]  # the history came back from the checkpoint


def test_more_examples_compute_only_the_new_features(trained, examples, tmp_path):
    """A run over more examples in the same work dir keeps every stored shard and computes only
    the new sequences; every example then reads the features a fresh work dir computes for it."""
    job, _ = trained
    work = tmp_path / "work"
    shutil.copytree(job.work_dir / "features", work / "features")
    before = {p.name: p.stat().st_mtime_ns for p in (work / "features").glob("shard_*.pt")}
    rng = random.Random(5)
    extra = [Example("test", f"new{i}", [rng.randrange(3, 256) for _ in range(6)], [rng.randrange(3, 256) for _ in range(9)])
             for i in range(3)]
    grown = examples[:10] + extra + examples[10:]
    _train(replace(job, work_dir=work, output=tmp_path / "head", train=replace(job.train, epochs=0.01)), grown)
    after = {p.name: p.stat().st_mtime_ns for p in (work / "features").glob("shard_*.pt")}
    assert {n: t for n, t in after.items() if n in before} == before
    assert len(after) == len(before) + 1  # the 3 new sequences fill one more shard
    fresh = tmp_path / "fresh"
    _train(replace(job, work_dir=fresh, output=tmp_path / "fresh-head", train=replace(job.train, epochs=0.01)), grown)
    kept = FeatureStore(work / "features", grown, job.train.max_seq_len)
    alone = FeatureStore(fresh / "features", grown, job.train.max_seq_len)
    for i in range(len(grown)):
        a, b = kept.record(i), alone.record(i)
        assert torch.equal(a["ids"], b["ids"]) and a["prompt_len"] == b["prompt_len"]
        # Batched differently, the prefill rounds differently: a unit in the last fp16 place at most.
        torch.testing.assert_close(a["features"], b["features"], rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(a["hidden"], b["hidden"], rtol=2e-3, atol=2e-3)
    with pytest.raises(SpecforkError, match="lacks the features of 3 of"):
        FeatureStore(job.work_dir / "features", grown, job.train.max_seq_len)


def test_the_trained_head_drafts_in_sd_and_greedy_output_equals_ar(trained, examples, target):
    """The saved head is an SD draft (``--draft``): greedy SD reproduces AR, and on a prompt it
    was trained on it gets drafts accepted."""
    job, _ = trained
    prompt = examples[0].prompt_ids
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ar = LLM(str(target), deterministic=True).generate([prompt], params)[0].token_ids
    sd = LLM(str(target), mode="sd", draft=str(job.output), k=3, deterministic=True,
             weights="fp32").generate([prompt], params)[0]
    assert sd.token_ids == ar == examples[0].response_ids
    assert sd.metrics["spec_rounds"] > 0 and sd.metrics["draft_tokens_accepted"] > 0, sd.metrics


def test_init_head_goes_on_from_a_saved_head_with_its_vocabulary(trained, examples, tmp_path):
    """``--init-head``: a second run starts from the first run's saved head (its draft
    vocabulary, not one chosen again), so its first loss is near where the first run ended."""
    job, result = trained
    again = replace(job, output=tmp_path / "head", work_dir=tmp_path / "work",
                    train=replace(job.train, epochs=1.0),
                    eagle3=replace(job.eagle3, draft_vocab="auto", init_head=job.output))
    rows_used = []
    with pytest.MonkeyPatch.context() as patch:  # the loss's target rows: the target's, not the saved head's
        patch.setattr(eagle3_pipeline, "Eagle3Trainer",
                      lambda head, store, ex, s, e, rows, *rest: rows_used.append(rows) or Eagle3Trainer(
                          head, store, ex, s, e, rows, *rest))
        second = _train(again, examples)
    saved = draft_to_target(load_eagle3_tensors(job.output), read_eagle3_config(job.output))
    continued = draft_to_target(load_eagle3_tensors(again.output), read_eagle3_config(again.output))
    assert torch.equal(continued, saved) and second["draft_vocab"]["size"] == DRAFT_VOCAB
    target_model = LLM(str(job.target)).engine.loaded.model
    assert torch.equal(rows_used[0], target_head_rows(target_model, saved))
    first_steps = torch.load(again.work_dir / "eagle3-checkpoints" / "last.pt", weights_only=True)["history"]
    middle = (result["first_loss"] + result["last_loss"]) / 2  # a fresh head starts at first_loss
    assert first_steps[0]["loss"] < middle, (first_steps[0], result["first_loss"], result["last_loss"])
    assert json.loads((again.output / "specfork_draft.json").read_text())["eagle3"]["init_head"] == str(job.output)
    with pytest.raises(SpecforkError, match="--init-head keeps"):
        Eagle3Settings(draft_vocab=64, init_head=job.output)


def test_reselected_draft_vocab_keeps_trained_rows_and_maps_the_target_rows_of_new_ids(trained, examples, tmp_path):
    """``--reselect-draft-vocab`` with ``--draft-vocab-corpus``: the head's vocabulary is chosen
    again (same size) from the responses' and the corpus's counts; the ids it keeps start from
    the saved head's trained rows, new ids from the target's rows mapped by the least-squares map
    of the target's rows of the saved ids to the saved rows."""
    job, _ = trained
    saved_config, saved = read_eagle3_config(job.output), load_eagle3_tensors(job.output)
    saved_ids = draft_to_target(saved, saved_config)
    outside = [i for i in range(3, 256) if i not in set(saved_ids.tolist())][:40]
    corpus = tmp_path / "corpus.npz"  # 40 ids the saved head lacks, each frequent enough to enter
    save_corpus(corpus, [outside * 50], vocab_size=256)
    again = replace(job, output=tmp_path / "head", work_dir=tmp_path / "work", train=replace(job.train, epochs=1.0),
                    eagle3=replace(job.eagle3, draft_vocab="auto", init_head=job.output, reselect_draft_vocab=True,
                                   draft_vocab_corpus=corpus))
    starts = []
    with pytest.MonkeyPatch.context() as patch:  # the LM head as training starts
        patch.setattr(eagle3_pipeline, "Eagle3Trainer",
                      lambda head, *rest: starts.append(head.lm_head.weight.detach().clone()) or Eagle3Trainer(
                          head, *rest))
        second = _train(again, examples)
    counts = count_response_tokens([x for x in examples if not is_eval_example(x)], 256)
    counts += torch.bincount(torch.tensor(outside * 50), minlength=256)
    new_ids = draft_to_target(load_eagle3_tensors(again.output), read_eagle3_config(again.output))
    assert torch.equal(new_ids, choose_draft_vocab(counts, DRAFT_VOCAB).ids) and second["draft_vocab"]["size"] == DRAFT_VOCAB
    assert set(outside) <= set(new_ids.tolist())
    kept = torch.isin(new_ids, saved_ids)
    assert 0 < int(kept.sum()) < DRAFT_VOCAB
    start = starts[0]
    assert torch.equal(start[kept], saved["lm_head.weight"].float()[torch.searchsorted(saved_ids, new_ids[kept])])
    target_model = LLM(str(job.target)).engine.loaded.model
    mapping = torch.linalg.lstsq(target_head_rows(target_model, saved_ids).double(),
                                 saved["lm_head.weight"].double()).solution
    assert torch.allclose(start[~kept].double(), target_head_rows(target_model, new_ids[~kept]).double() @ mapping,
                          atol=1e-5)
    with pytest.raises(SpecforkError, match="--reselect-draft-vocab re-chooses"):
        Eagle3Settings(reselect_draft_vocab=True)
    with pytest.raises(SpecforkError, match="no such file"):  # refused before any data is generated
        Eagle3Settings(draft_vocab_corpus=tmp_path / "missing.npz")


def test_carried_over_rows_of_new_ids_follow_the_heads_linear_readout():
    """When a head's trained rows are exactly a linear map of the target's, a new id's row is that
    map of its target row; rows of ids the head had stay as they are, other weights untouched."""
    gen = torch.Generator().manual_seed(3)
    target_rows = torch.randn(40, 8, generator=gen)  # the target's LM head, 40 ids of width 8
    readout = torch.randn(8, 8, generator=gen)
    old_ids, new_ids = torch.arange(0, 20), torch.tensor([2, 5, 7, 21, 30, 33, 39])
    init = eagle3_pipeline.InitialHead(None, old_ids, {"lm_head.weight": target_rows[old_ids] @ readout,
                                                        "norm.weight": torch.ones(8)})
    out = eagle3_pipeline.carried_over(init, new_ids, target_rows[new_ids], target_rows[old_ids])
    assert torch.equal(out["lm_head.weight"][:3], init.tensors["lm_head.weight"][[2, 5, 7]])
    assert torch.allclose(out["lm_head.weight"][3:], target_rows[[21, 30, 33, 39]] @ readout, atol=1e-5)
    assert out["norm.weight"] is init.tensors["norm.weight"]
    assert eagle3_pipeline.carried_over(init, old_ids, target_rows[old_ids], target_rows[old_ids]) is init.tensors


def test_interrupted_training_resumes_to_the_same_weights(trained, examples, target, tmp_path):
    job, _ = trained
    loaded = LLM(str(target)).engine.loaded
    store = FeatureStore(job.work_dir / "features", examples, job.train.max_seq_len)
    config = head_config(loaded.arch, DRAFT_VOCAB, (2, 1, 0))
    draft_ids = torch.arange(0, 256, 2)

    def trainer(directory):
        torch.manual_seed(0)
        head = build_head(loaded, config, draft_ids)
        return Eagle3Trainer(head, store, examples, job.train, job.eagle3, head.lm_head.weight.detach().clone(),
                             directory, torch.device("cpu"))

    straight = trainer(tmp_path / "straight")
    straight.run(progress=False, until_step=12)
    first = trainer(tmp_path / "interrupted")
    first.run(progress=False, until_step=5)  # a checkpoint at the stop, step 5
    resumed = trainer(tmp_path / "interrupted")
    assert resumed.try_resume() and resumed.step == 5
    resumed.run(progress=False, until_step=12)
    assert resumed.step == straight.step == 12
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in straight.history]
    for (name, a), b in zip(straight.head.state_dict().items(), resumed.head.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    other_vocab = build_head(loaded, config, torch.arange(1, 256, 2))  # same size, other ids: rows for other tokens
    assert not Eagle3Trainer(other_vocab, store, examples, job.train, job.eagle3,  # afresh, not on the old rows
                             other_vocab.lm_head.weight.detach().clone(), tmp_path / "interrupted",
                             torch.device("cpu")).try_resume()
    assert (tmp_path / "interrupted" / "last.other-data-12-steps.pt").is_file()


@pytest.mark.parametrize("instructions", [(), ("_is_avx512_bf16_supported",), ("_is_amx_tile_supported",)])
def test_auto_precision_takes_bfloat16_only_where_the_cpu_has_bf16_instructions(monkeypatch, instructions):
    # oneDNN alone says yes on any AVX-512 CPU, emulating bf16 at a third of float32's speed
    for name in eagle3_trainer.BF16_INSTRUCTIONS:
        monkeypatch.setattr(torch.cpu, name, lambda has=name in instructions: has, raising=False)
    expected = torch.bfloat16 if instructions else None
    assert eagle3_trainer.autocast_dtype("auto", torch.device("cpu")) == expected
    assert eagle3_trainer.autocast_dtype("fp32", torch.device("cpu")) is None
    assert eagle3_trainer.autocast_dtype("bf16", torch.device("cpu")) == torch.bfloat16


def test_bfloat16_matrix_products_train_close_to_float32(trained, examples, target, tmp_path):
    job, _ = trained
    loaded = LLM(str(target)).engine.loaded
    store = FeatureStore(job.work_dir / "features", examples, job.train.max_seq_len)
    config = head_config(loaded.arch, DRAFT_VOCAB, (2, 1, 0))

    def trainer(precision, directory):
        torch.manual_seed(0)
        head = build_head(loaded, config, torch.arange(DRAFT_VOCAB))
        return Eagle3Trainer(head, store, examples, job.train, replace(job.eagle3, precision=precision),
                             head.lm_head.weight.detach().clone(), directory, torch.device("cpu"))

    fp32, bf16 = trainer("fp32", tmp_path / "fp32"), trainer("bf16", tmp_path / "bf16")
    assert (fp32.autocast, bf16.autocast) == (None, torch.bfloat16)
    for a, b in zip(fp32.evaluate()["loss_by_step"], bf16.evaluate()["loss_by_step"], strict=True):
        assert a != b and b == pytest.approx(a, rel=2e-2)
    bf16.run(progress=False, until_step=3)
    assert all(math.isfinite(r["loss"]) for r in bf16.history) and bf16.head.fc.weight.dtype == torch.float32


# ---- the saved head computes the EAGLE-3 formula ------------------------------------------------------------------


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, position: int, theta: float):
    """x [heads, head_dim] rotated to ``position`` (rotate-half)."""
    half = x.shape[-1] // 2
    angles = position * (1.0 / theta ** (torch.arange(0, half, dtype=torch.float32) * 2 / x.shape[-1]))
    cos, sin = torch.cat([angles.cos()] * 2), torch.cat([angles.sin()] * 2)
    return x * cos + torch.cat([-x[:, half:], x[:, :half]], dim=-1) * sin


def _plain_layer(t, arch, embed, h, token, position):
    """One position of the head's layer: its query, key, value and a function of the attention
    weights' keys/values that finishes the layer."""
    eps, hd = arch.rms_norm_eps, arch.head_dim
    a = torch.cat([_rms(embed[token], t["midlayer.input_layernorm.weight"], eps),
                   _rms(h, t["midlayer.hidden_norm.weight"], eps)])
    q = _rope((t["midlayer.self_attn.q_proj.weight"] @ a).view(arch.num_heads, hd), position, arch.rope_theta)
    k = _rope((t["midlayer.self_attn.k_proj.weight"] @ a).view(arch.num_kv_heads, hd), position, arch.rope_theta)
    v = (t["midlayer.self_attn.v_proj.weight"] @ a).view(arch.num_kv_heads, hd)
    return q, k, v


def _plain_finish(t, arch, h, q, keys, values):
    """Attention of q over ``keys``/``values`` (lists of [kv_heads, head_dim]), then o_proj, MLP, norm, LM head."""
    group = arch.num_heads // arch.num_kv_heads
    heads = []
    for head in range(arch.num_heads):
        kv = head // group
        scores = torch.stack([q[head] @ k[kv] for k in keys]) / math.sqrt(arch.head_dim)
        heads.append(sum(w * v[kv] for w, v in zip(scores.softmax(0), values, strict=True)))
    h1 = h + t["midlayer.self_attn.o_proj.weight"] @ torch.cat(heads)
    x = _rms(h1, t["midlayer.post_attention_layernorm.weight"], arch.rms_norm_eps)
    mlp = t["midlayer.mlp.down_proj.weight"] @ (torch.nn.functional.silu(t["midlayer.mlp.gate_proj.weight"] @ x)
                                                * (t["midlayer.mlp.up_proj.weight"] @ x))
    out = h1 + mlp
    return out, t["lm_head.weight"] @ _rms(out, t["norm.weight"], arch.rms_norm_eps)


def test_saved_head_loads_and_computes_the_formula(trained, examples, target):
    job, _ = trained
    config = read_eagle3_config(job.output)
    tensors = {n: x.float() for n, x in load_eagle3_tensors(job.output).items() if n != "d2t"}
    draft_ids = draft_to_target(load_eagle3_tensors(job.output), config)
    assert config.draft_vocab_size == len(draft_ids) == DRAFT_VOCAB and config.feature_layers == (2, 1, 0)
    assert config.arch.hidden_size == config.target_hidden_size == 64 and config.arch.num_layers == 1
    embed = LLM(str(target)).engine.loaded.model.embed_tokens.weight.detach().float()
    head = Eagle3TrainHead(config.arch, config.target_hidden_size, embed, draft_ids)
    head.load_state_dict(tensors)  # every trained weight is saved, under the checkpoint's names

    store = FeatureStore(job.work_dir / "features", examples, job.train.max_seq_len)
    batch = collate_features(store, [0], torch.device("cpu"))
    n, arch = int(batch.lengths[0]), config.arch
    x = batch.ids[0].tolist()
    with torch.no_grad():
        hidden = head.project(batch.features)
        out0, kv0 = head.step(hidden[:, :-1], batch.ids[:, 1:], torch.arange(n - 1)[None], [])  # x_{t+1}, RoPE t
        out1, _ = head.step(out0[:, :-1], batch.ids[:, 2:], torch.arange(1, n - 1)[None],
                            [(kv0[0][:, :, :-1], kv0[1][:, :, :-1])])
        logits0, logits1 = head.logits(out0)[0], head.logits(out1)[0]
    # Step 0: h = fc(f_t), token x_{t+1}, RoPE t, causal over the sequence.
    keys, values, plain_out0 = [], [], []
    for pos in range(n - 1):
        h = tensors["fc.weight"] @ batch.features[0, pos]
        q, k, v = _plain_layer(tensors, arch, embed, h, x[pos + 1], pos)
        keys.append(k)
        values.append(v)
        out, logits = _plain_finish(tensors, arch, h, q, keys, values)
        plain_out0.append(out)
        torch.testing.assert_close(logits0[pos], logits, atol=1e-5, rtol=0)
    # Step 1: h = step 0's output at t, token x_{t+2}, RoPE t+1, step 0's keys <= t and its own.
    for pos in range(n - 2):
        q, k, v = _plain_layer(tensors, arch, embed, plain_out0[pos], x[pos + 2], pos + 1)
        _, logits = _plain_finish(tensors, arch, plain_out0[pos], q, [*keys[: pos + 1], k], [*values[: pos + 1], v])
        torch.testing.assert_close(logits1[pos], logits, atol=1e-5, rtol=0)


def test_ttt_loss_is_the_weighted_cross_entropy_against_the_target(trained, examples):
    """Step j at index t predicts x_{t+2+j} (response tokens inside the sequence only), against
    softmax over the draft vocabulary of the target's hidden state at t+1+j."""
    job, _ = trained
    config = read_eagle3_config(job.output)
    tensors = {n: x.float() for n, x in load_eagle3_tensors(job.output).items() if n != "d2t"}
    draft_ids = draft_to_target(load_eagle3_tensors(job.output), config)
    head = Eagle3TrainHead(config.arch, 64, torch.randn(256, 64), draft_ids)
    head.load_state_dict(tensors)
    rows = torch.randn(DRAFT_VOCAB, 64)
    store = FeatureStore(job.work_dir / "features", examples, job.train.max_seq_len)
    batch = collate_features(store, [3, 4], torch.device("cpu"))
    with torch.no_grad():
        result = ttt_loss(head, batch, rows, steps=2)
        expected, hidden = 0.0, head.project(batch.features)
        cache = []
        for j in range(2):
            out, kv = head.step(hidden, torch.nn.functional.pad(batch.ids, (0, 3))[:, 1 + j: 1 + j + batch.ids.shape[1]],
                                (torch.arange(batch.ids.shape[1]) + j).expand_as(batch.ids), cache)
            cache.append(kv)
            terms = []
            for b in range(2):
                for t in range(batch.ids.shape[1]):
                    if batch.prompt_lens[b] <= t + 2 + j < batch.lengths[b]:
                        p = (batch.hidden[b, t + 1 + j] @ rows.T).softmax(-1)
                        terms.append(-(p * head.logits(out[b, t]).log_softmax(-1)).sum())
            assert result.counted[j] == len(terms)
            expected += 0.8**j * torch.stack(terms).mean()
            hidden = out
    torch.testing.assert_close(result.loss, expected, atol=1e-5, rtol=1e-6)
    assert result.counted[0] == sum(len(examples[i].response_ids) for i in (3, 4))  # every response token


def test_ttt_loss_of_a_batch_matches_one_sequence_at_a_time(trained, examples):
    """Padding another sequence in changes nothing for a sequence (right padding, causal)."""
    job, _ = trained
    config = read_eagle3_config(job.output)
    torch.manual_seed(0)
    head = Eagle3TrainHead(config.arch, 64, torch.randn(256, 64), torch.arange(DRAFT_VOCAB))
    store = FeatureStore(job.work_dir / "features", examples, job.train.max_seq_len)
    rows = torch.randn(DRAFT_VOCAB, 64)
    with torch.no_grad():
        both = ttt_loss(head, collate_features(store, [1, 2], torch.device("cpu")), rows, steps=TTT_STEPS)
        alone = [ttt_loss(head, collate_features(store, [i], torch.device("cpu")), rows, steps=TTT_STEPS)
                 for i in (1, 2)]
    for j in range(TTT_STEPS):
        assert both.counted[j] == sum(r.counted[j] for r in alone)
        assert both.step_loss[j] == pytest.approx(sum(r.step_loss[j] for r in alone), rel=1e-5)


# ---- the draft vocabulary ---------------------------------------------------------------------------------------


def test_draft_vocab_is_the_smallest_size_reaching_the_coverage():
    # 32 ids; the four most frequent hold 90% of the tokens, the eight most frequent 99%.
    counts = torch.zeros(32, dtype=torch.long)
    counts[[7, 3, 20, 11]] = torch.tensor([300, 250, 200, 150])  # 900
    counts[[1, 30, 5, 9]] = torch.tensor([30, 30, 20, 10])  # 990 in all with the above
    counts[[2, 4, 6, 8, 10, 12, 14, 16, 18, 22]] = 1  # 1000
    sizes = (4, 8, 16)
    eight = choose_draft_vocab(counts, sizes=sizes, coverage=0.98)
    assert eight.ids.tolist() == [1, 3, 5, 7, 9, 11, 20, 30]  # the 8 most frequent, ascending
    assert eight.coverage == pytest.approx(0.99)
    assert choose_draft_vocab(counts, sizes=sizes, coverage=0.90).ids.tolist() == [3, 7, 11, 20]
    nothing_enough = choose_draft_vocab(counts, sizes=sizes, coverage=0.9999)  # falls back to the largest size
    assert len(nothing_enough.ids) == 16 and nothing_enough.coverage == pytest.approx(0.998)
    assert nothing_enough.ids.tolist()[:10] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # equal counts: lower ids first
    forced = choose_draft_vocab(counts, 5, sizes=sizes, coverage=0.98)
    assert forced.ids.tolist() == [1, 3, 7, 11, 20] and forced.coverage == pytest.approx(0.93)  # 1 before 30: a tie
    assert len(choose_draft_vocab(counts[:6], sizes=sizes, coverage=1.0).ids) == 6  # never more than the vocabulary


def test_draft_vocab_sizes_by_default():
    """A Zipf-like count over a 49152-token vocabulary: 98% is reached past 4096 ids and before 8192."""
    ranks = torch.arange(1, 49153, dtype=torch.float64)
    counts = (1e7 / ranks**1.35).long()
    share = counts.cumsum(0).double() / counts.sum()
    assert share[4095] < 0.98 <= share[8191]
    chosen = choose_draft_vocab(counts[torch.randperm(49152, generator=torch.Generator().manual_seed(0))])
    assert len(chosen.ids) == 8192 and chosen.coverage == pytest.approx(float(share[8191]))
