"""Draft training end to end on a tiny random target, resume, and GGUF export round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import prefill_logits as runner_prefill_logits
from transformers import LlamaConfig, LlamaForCausalLM

from specfork import LLM, SamplingParams
from specfork.errors import SpecforkError
from specfork.loading.gguf_file import GGUFFile
from specfork.loading.resolve import resolve_checkpoint
from specfork.loading.tokenizer import load_gguf_tokenizer
from specfork.speculative.corpus import load_corpus
from specfork.training.data import load_examples, training_prompts
from specfork.training.pipeline import train_draft
from specfork.training.settings import DataSettings, DraftArch, Eagle3Settings, TrainDraftJob, TrainSettings
from specfork.training.trainer import DraftTrainer, build_draft, is_eval_example


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A random 2-layer Llama with SmolLM2's tokenizer (vocabulary 49152, chat template)."""  # noqa: D401
    path = tmp_path_factory.mktemp("tiny_target")
    gguf = resolve_checkpoint("smollm2-135m").path
    # The tokenizer as specfork builds it from the GGUF, saved the way train-draft saves a draft's.
    load_gguf_tokenizer(GGUFFile(gguf)).hf.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, eos_token_id=2, bos_token_id=1,
                         max_position_embeddings=1024, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # untied and peaked, so its greedy text is not just a copy of its input
        model.model.embed_tokens.weight.normal_(0, 0.5)
        model.lm_head.weight.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


def _job(target, tmp_path, epochs=12.0, **train):
    return TrainDraftJob(
        target=str(target),
        output=tmp_path / "draft",
        work_dir=tmp_path / "work",
        data=DataSettings(num_prompts=8, max_new_tokens=12, max_prompt_tokens=24, shard_size=3, seed=0),
        arch=DraftArch(hidden_size=32, num_layers=1, intermediate_size=64, num_heads=2, num_kv_heads=1),
        train=TrainSettings(epochs=epochs, batch_tokens=512, max_seq_len=40, lr=1e-2, warmup_steps=2,
                            checkpoint_every=4, **train),
        threads=2,
        generation_batch=4,
        eval_prompts=1,
        eval_tokens=8,
        progress=False,
    )


def test_training_prompts_come_from_the_train_split_only():
    from specfork.datasets import load_prompts

    prompts = training_prompts(200, seed=0, code_fraction=0.5)
    assert len(prompts) == 200
    kinds = {p.dataset for p in prompts}
    assert kinds == {"sharegpt", "sharegpt-code"}
    eval_ids = {p.id for p in load_prompts("sharegpt", "eval")}
    assert not eval_ids & {p.id.split("/")[0] for p in prompts}
    assert training_prompts(200, seed=0, code_fraction=0.5) == prompts  # reproducible
    assert training_prompts(200, seed=1, code_fraction=0.5) != prompts


def test_train_draft_end_to_end_and_resume(tiny_target, tmp_path):
    job = _job(tiny_target, tmp_path)
    result = train_draft(job, command="test")
    assert result["last_loss"] < result["first_loss"] - 0.5, result
    saved = json.loads((job.output / "specfork_draft.json").read_text())
    assert saved["train_steps"] == result["train_steps"] > 0
    assert saved["kind"] == "draft" and saved["machine"]["device"] == "cpu"  # as the EAGLE-3 record has them
    assert set(saved["acceptance"]) == {"humaneval", "sharegpt"}
    responses = [e.response_ids for e in load_examples(job.work_dir / "data")]
    corpus = load_corpus(job.work_dir / "lookup_corpus.npz", 49152)
    assert saved["lookup_corpus"]["tokens"] == len(corpus) == sum(map(len, responses)) > 0
    assert (job.output / "config.json").is_file() and (job.output / "model.safetensors").is_file()
    assert (job.output / "tokenizer.json").is_file() or (job.output / "tokenizer_config.json").is_file()

    # The draft loads as an SD draft and SD reproduces AR exactly.
    prompt = [1, 504, 3458, 28, 1345, 17, 30, 201]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ar = LLM(str(tiny_target), deterministic=True).generate([prompt], params)[0].token_ids
    sd = LLM(str(tiny_target), mode="sd", draft=str(job.output), k=3, deterministic=True).generate([prompt], params)[0]
    assert sd.token_ids == ar
    assert sd.metrics["spec_rounds"] > 0

    # A rerun reuses the data shards and the final checkpoint: no new generation, no new steps.
    shards = {p: p.stat().st_mtime_ns for p in (job.work_dir / "data").glob("shard_*.pt")}
    assert len(shards) == 3
    again = train_draft(job, command="test")
    assert {p: p.stat().st_mtime_ns for p in (job.work_dir / "data").glob("shard_*.pt")} == shards
    assert again["train_steps"] == result["train_steps"]

    # Different data settings in the same work dir are refused, not silently mixed.
    from dataclasses import replace

    from specfork.errors import SpecforkError

    with pytest.raises(SpecforkError, match="other settings"):
        train_draft(replace(job, data=replace(job.data, max_new_tokens=13)))


def test_more_prompts_generate_only_the_new_responses(tiny_target, tmp_path):
    """Asking for more prompts in the same work dir keeps the data shards and answers only the
    new prompts; the examples equal those of a fresh work dir, in the prompts' order."""
    from dataclasses import replace

    from specfork.training import pipeline

    job = _job(tiny_target, tmp_path)
    llm = pipeline.target_llm(job)
    first = pipeline.generate_data(job, llm)
    shards = {p.name: p.stat().st_mtime_ns for p in (job.work_dir / "data").glob("shard_*.pt")}
    asked = []
    generate = llm.generate
    llm.generate = lambda ids, params: asked.extend(ids) or generate(ids, params)
    grown = replace(job, data=replace(job.data, num_prompts=12))
    more = pipeline.generate_data(grown, llm)
    after = {p.name: p.stat().st_mtime_ns for p in (job.work_dir / "data").glob("shard_*.pt")}
    assert {n: t for n, t in after.items() if n in shards} == shards and len(after) == len(shards) + 2
    old = {tuple(e.prompt_ids) for e in first}
    assert len(asked) == 4 and not old & {tuple(i) for i in asked}
    llm.generate = generate
    fresh = pipeline.generate_data(replace(grown, work_dir=tmp_path / "fresh"), llm)
    assert [(e.id, e.prompt_ids, e.response_ids) for e in more] == [(e.id, e.prompt_ids, e.response_ids) for e in fresh]
    assert [e.id for e in more] == [p.id for p in training_prompts(12, seed=0, code_fraction=0.5)]


def test_skipped_prompts_are_an_earlier_runs_and_are_not_answered(tiny_target, tmp_path):
    """--skip-prompts N leaves out exactly the prompts a run with --num-prompts N had (the
    selection grows by prefixes), so a run resumed from that run's head trains on new prompts
    only; a skip outside [0, num_prompts) is refused."""
    from dataclasses import replace

    from specfork.errors import SpecforkError
    from specfork.training import pipeline
    from specfork.training.settings import DataSettings

    job = _job(tiny_target, tmp_path)
    llm = pipeline.target_llm(job)
    asked = []
    generate = llm.generate
    llm.generate = lambda ids, params: asked.extend(ids) or generate(ids, params)
    later = pipeline.generate_data(replace(job, data=replace(job.data, num_prompts=12, skip_prompts=8)), llm)
    earlier = training_prompts(8, seed=0, code_fraction=0.5)
    want = [p for p in training_prompts(12, seed=0, code_fraction=0.5) if p not in earlier]
    assert [e.id for e in later] == [p.id for p in want] and len(want) == 4
    assert len(asked) == 4
    for bad in (12, -1):
        with pytest.raises(SpecforkError, match="skip_prompts"):
            DataSettings(num_prompts=12, skip_prompts=bad)


def test_interrupted_training_resumes_to_the_same_weights(tiny_target, tmp_path):
    job = _job(tiny_target, tmp_path, epochs=10.0)
    from specfork.training.pipeline import generate_data, target_llm

    llm = target_llm(job)
    examples = generate_data(job, llm)
    assert len(load_examples(job.work_dir / "data")) == len(examples) == 8
    target = llm.engine.loaded

    def trainer(directory):
        torch.manual_seed(0)
        return DraftTrainer(build_draft(target, job.arch), examples, job.train, directory, pad_id=2,
                            device=torch.device("cpu"))

    straight = trainer(tmp_path / "straight")
    straight.run(progress=False)

    first = trainer(tmp_path / "interrupted")
    first.run(progress=False, until_step=5)  # checkpoints at 4 and at the stop, 5
    resumed = trainer(tmp_path / "interrupted")
    assert resumed.try_resume() and resumed.step == 5
    resumed.run(progress=False)
    assert resumed.step == straight.step == straight.total_steps
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in straight.history]
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_resume_loads_tensors_and_plain_data_only(tmp_path):
    """A checkpoint that would run code when unpickled is refused, not loaded."""
    from specfork.errors import SpecforkError
    from specfork.training.data import Example
    from specfork.training.trainer import DraftTrainer, TrainSettings

    examples = [Example("test", f"e{i}", [1, 2, 3], [4, 5, 6]) for i in range(8)]
    settings = TrainSettings(epochs=1.0, batch_tokens=64, max_seq_len=16)

    def trainer():
        return DraftTrainer(torch.nn.Linear(4, 4), examples, settings, tmp_path, pad_id=0, device=torch.device("cpu"))

    first = trainer()
    first.step = 3
    first.save_checkpoint()
    resumed = trainer()
    assert resumed.try_resume() and resumed.step == 3  # our own checkpoints load
    state = torch.load(tmp_path / "last.pt", weights_only=True)
    state["history"] = [_Payload()]
    torch.save(state, tmp_path / "last.pt")
    _Payload.ran = False
    with pytest.raises(SpecforkError, match="other than tensors and plain data"):
        trainer().try_resume()
    assert not _Payload.ran


def test_a_checkpoint_resumes_only_on_its_data_and_settings_and_a_damaged_one_is_named(tmp_path):
    """More prompts in the same work dir used to resume the old run's checkpoint silently, on a
    training set it was not trained on."""
    from specfork.training.data import Example
    from specfork.training.trainer import DraftTrainer, TrainSettings

    examples = [Example("test", f"e{i}", [1, 2, 3], [4, 5, i]) for i in range(8)]
    settings = TrainSettings(epochs=1.0, batch_tokens=64, max_seq_len=16)

    def trainer(data, train=settings):
        return DraftTrainer(torch.nn.Linear(4, 4), data, train, tmp_path, pad_id=0, device=torch.device("cpu"))

    first = trainer(examples)
    first.step = 3
    first.save_checkpoint()
    assert trainer(list(examples)).try_resume()  # the same sequences, another list
    more = examples + [Example("test", "e8", [1, 2], [3, 4])]
    assert not trainer(more).try_resume()  # starts afresh, the old checkpoint kept aside
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.other-data-3-steps.pt"]
    first.save_checkpoint()
    with pytest.raises(SpecforkError, match=r"other training settings \(lr 0.002 -> 0.001\)"):
        trainer(examples, TrainSettings(epochs=1.0, batch_tokens=64, max_seq_len=16, lr=1e-3)).try_resume()
    (tmp_path / "last.pt").write_bytes((tmp_path / "last.pt").read_bytes()[:100])
    with pytest.raises(SpecforkError, match="last.pt cannot be read .* damaged"):
        trainer(examples).try_resume()


def test_a_warm_up_longer_than_the_run_is_reported(caplog):
    from specfork.training.data import Example
    from specfork.training.trainer import DraftTrainer, TrainSettings

    examples = [Example("test", f"e{i}", [1, 2, 3], [4, 5, i]) for i in range(8)]
    DraftTrainer(torch.nn.Linear(4, 4), examples, TrainSettings(epochs=1.0, batch_tokens=64, max_seq_len=16),
                 Path("unused"), pad_id=0, device=torch.device("cpu"))
    assert "--warmup-steps 30 is not shorter than this run's 1 steps" in caplog.text


def test_a_damaged_data_shard_is_named(tmp_path):
    from specfork.training.data import load_examples

    (tmp_path / "shard_00000.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(SpecforkError, match="shard_00000.pt cannot be read .* damaged: remove it"):
        load_examples(tmp_path)


class _Payload:
    """Unpickling this object would call ``_Payload.run``."""

    ran = False

    def __reduce__(self):
        return (_payload_run, ())


def _payload_run():
    _Payload.ran = True


def test_held_out_examples_are_a_fixed_share():
    from specfork.training.data import Example

    examples = [Example("sharegpt", f"id{i}", [1], [2]) for i in range(4000)]
    share = sum(is_eval_example(e) for e in examples) / len(examples)
    assert 0.03 < share < 0.08


def prefill_logits(model_path, prompt: list[int]) -> torch.Tensor:
    """specfork's logits for every prompt position (the loader under test, no transformers; dense fp32
    execution, so the only difference is the storage type)."""
    return runner_prefill_logits(LLM(str(model_path), deterministic=True, weights="fp32"), prompt)


def rounded_checkpoint(source, directory, out_type: str):
    """A copy of ``source`` whose 2-D weights went through ``out_type`` storage and back."""
    import gguf
    import numpy as np

    qtype = {"f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[out_type]
    model = LlamaForCausalLM.from_pretrained(source)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                w = p.detach().numpy().astype(np.float32)
                p.copy_(torch.from_numpy(np.asarray(gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype))))
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("out_type", ["f32", "f16", "q8_0"])
def test_export_gguf_round_trip_logits(tiny_checkpoints, tmp_path, out_type):
    """Export → load back with specfork's GGUF loader → the logits of the HF checkpoint whose
    weights went through the same storage type: equal up to float rounding (1e-5 relative).
    Against the unrounded checkpoint they differ by the storage type's rounding only."""
    import gguf

    from specfork.loading.gguf_export import export_gguf

    source = tiny_checkpoints["llama-gqa-tied"].path
    path = export_gguf(source, tmp_path / f"draft-{out_type}.gguf", vocab_from=None, out_type=out_type)
    reader = gguf.GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    assert "token_embd.weight" in names and "output.weight" not in names  # tied stays tied
    assert "blk.2.attn_q.weight" in names
    prompt = [1, 17, 99, 4, 250, 31, 8, 64, 3]
    got = prefill_logits(path, prompt)
    original = prefill_logits(source, prompt)
    expected = original if out_type == "f32" else prefill_logits(rounded_checkpoint(source, tmp_path / "rounded", out_type), prompt)
    scale = float(expected.abs().max())
    assert float((got - expected).abs().max()) <= 1e-5 * scale
    assert float((got - original).abs().max()) <= {"f32": 1e-5, "f16": 1e-2, "q8_0": 0.1}[out_type] * scale


def test_export_gguf_refuses_a_vocabulary_that_does_not_match(tiny_checkpoints, tmp_path):
    from specfork.errors import SpecforkError
    from specfork.loading.gguf_export import export_gguf

    with pytest.raises(SpecforkError, match="49152 tokens but the model's vocabulary is 256"):
        export_gguf(tiny_checkpoints["llama-gqa-tied"].path, tmp_path / "x.gguf", vocab_from="smollm2-135m")
    assert not (tmp_path / "x.gguf").exists()


def test_an_output_that_saving_would_destroy_is_refused_before_any_work(tmp_path):
    foreign = tmp_path / "models"
    (foreign / "other").mkdir(parents=True)
    (foreign / "other" / "weights.bin").write_bytes(b"x")
    with pytest.raises(SpecforkError, match="not a train-draft result"):
        TrainDraftJob(output=foreign)
    (tmp_path / "file").write_text("x")
    with pytest.raises(SpecforkError, match="is a file"):
        TrainDraftJob(output=tmp_path / "file")
    earlier = tmp_path / "draft"  # an earlier result is replaced (a run resumed or redone)
    earlier.mkdir()
    (earlier / "specfork_draft.json").write_text("{}")
    assert TrainDraftJob(output=earlier).output == earlier
    assert TrainDraftJob(output=tmp_path / "empty").work_dir == tmp_path / "empty.work"
    (earlier / "NOTES.md").write_text("the user's")  # saving would delete it with the directory
    with pytest.raises(SpecforkError, match="also holds NOTES.md"):
        TrainDraftJob(output=earlier)
    for work_dir in (tmp_path / "new", tmp_path / "new" / "work"):  # deleted by every save
        with pytest.raises(SpecforkError, match="--work-dir .* is inside --output"):
            TrainDraftJob(output=tmp_path / "new", work_dir=work_dir)
    with pytest.raises(SpecforkError, match="--work-dir .* is a file"):
        TrainDraftJob(output=tmp_path / "new", work_dir=tmp_path / "file")
    with pytest.raises(SpecforkError, match="a name of its own"):
        TrainDraftJob(output=Path("."))
    with pytest.raises(SpecforkError, match="cannot create or write"):
        TrainDraftJob(output=Path("/proc/specfork-draft"), work_dir=tmp_path / "w")


def test_saving_without_progress_shows_no_transformers_bar(tmp_path, capsys):
    """--no-progress: transformers' "Writing model shards" bar stays off too, and on afterwards."""
    from transformers.utils import logging as hf_logging

    from specfork.training.trainer import save_draft

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    save_draft(model, None, tmp_path / "quiet", {}, progress=False)
    assert "Writing model shards" not in capsys.readouterr().err and hf_logging.is_progress_bar_enabled()
    save_draft(model, None, tmp_path / "shown", {})
    assert "Writing model shards" in capsys.readouterr().err


def test_saving_replaces_the_output_and_touches_no_other_directory(tmp_path):
    from specfork.training.trainer import publish_directory

    output, neighbour = tmp_path / "draft", tmp_path / "draft.tmp"  # the name the save once used for itself
    neighbour.mkdir()
    (neighbour / "notes.txt").write_text("the user's")
    publish_directory(output, lambda d: (d / "config.json").write_text("1"))
    publish_directory(output, lambda d: (d / "config.json").write_text("2"))
    assert (output / "config.json").read_text() == "2" and (neighbour / "notes.txt").is_file()
    with pytest.raises(RuntimeError):  # a save that fails leaves the earlier result and no temporary directory
        publish_directory(output, lambda d: (_ for _ in ()).throw(RuntimeError("disk full")))
    assert (output / "config.json").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "draft.tmp"]


def test_export_gguf_refuses_outputs_it_would_break_and_eagle3_heads(tiny_checkpoints, head_pair, tmp_path):
    from specfork.loading.gguf_export import export_gguf

    source = tiny_checkpoints["llama-gqa-tied"].path
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    for output, message in ((tmp_path / "dir", "is a directory"), (tmp_path / "file" / "x.gguf", "is a file"),
                            (Path("/proc/x.gguf"), "not writable")):
        with pytest.raises(SpecforkError, match=message):
            export_gguf(source, output, vocab_from=None)
    first = export_gguf(source, tmp_path / "a.gguf", vocab_from=None)
    with pytest.raises(SpecforkError, match="is the --vocab-from model itself"):
        export_gguf(source, first, vocab_from=first)
    with pytest.raises(SpecforkError, match="is an EAGLE-3 head"):
        export_gguf(head_pair["draft"], tmp_path / "h.gguf", vocab_from=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "dir", "file"]  # no temporary file left


def test_options_of_the_other_kind_and_a_missing_init_head_are_refused(tmp_path):
    with pytest.raises(SpecforkError, match="--ttt-steps only applies to --kind eagle3"):
        TrainDraftJob(output=tmp_path / "d", kind="draft", eagle3=Eagle3Settings(ttt_steps=3))
    with pytest.raises(SpecforkError, match="--layers only applies to --kind draft"):
        TrainDraftJob(output=tmp_path / "d", kind="eagle3", arch=DraftArch(num_layers=2))
    with pytest.raises(SpecforkError, match="not an EAGLE-3 head directory"):
        Eagle3Settings(init_head=tmp_path / "nonexistent")
    draft_model = tmp_path / "draft-model"  # a directory with a config.json, but a draft model's
    draft_model.mkdir()
    (draft_model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(SpecforkError, match="does not name the EAGLE-3 draft architecture"):
        Eagle3Settings(init_head=draft_model)


@pytest.mark.parametrize("settings, message", [
    ({"grad_clip": -1.0}, "--grad-clip must be a finite number > 0"),  # had trained by gradient ascent
    ({"epochs": float("inf")}, "--epochs must be a finite number"),  # an OverflowError after the data phase
    ({"min_lr_ratio": 5.0}, "--min-lr-ratio must be in"),
    ({"warmup_steps": -1}, "--warmup-steps must be >= 0"),
    ({"weight_decay": -0.1}, "--weight-decay must be"),
    ({"lr": float("nan")}, "--lr must be"),
])
def test_training_settings_out_of_range_are_refused(settings, message):
    with pytest.raises(SpecforkError, match=message):
        TrainSettings(**settings)


def test_train_draft_threads_out_of_range_are_refused(tmp_path):
    with pytest.raises(SpecforkError, match="--threads must be in 1..1024, got -1"):
        TrainDraftJob(output=tmp_path / "d", threads=-1)
