"""Every bad input gets a clear error naming the problem: ValueError in the API, a non-zero
exit code and a one-line message on the CLI."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specfork import LLM, ModelLoadError, PromptError, SamplingParams, SpecforkError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny_bad")
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    return LLM(str(tiny_dir))


def run_cli(*args, timeout=120):
    """The `specfork` command in a fresh process (exit code and stderr as a user sees them)."""
    return subprocess.run([sys.executable, "-m", "specfork.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def run_main(*args):
    """The same command through `specfork.cli.main` in this process: the exit code and what it
    printed, without starting an interpreter each time (an exception would fail the test)."""
    import contextlib
    import io
    from types import SimpleNamespace

    from specfork.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse
            code = e.code
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


# ---- API ----------------------------------------------------------------------------------

def test_empty_prompts(tiny_llm):
    with pytest.raises(PromptError, match="empty"):
        tiny_llm.generate([[]])
    with pytest.raises(PromptError, match="empty"):
        tiny_llm.generate([""])
    with pytest.raises(PromptError, match="no prompts"):
        tiny_llm.generate([])


def test_stream_checks_its_input_as_generate_does(tiny_llm):
    with pytest.raises(PromptError, match="list of integers"):
        next(tiny_llm.stream([1.5, 2]))
    with pytest.raises(PromptError, match="list of integers"):
        next(tiny_llm.stream([True]))
    with pytest.raises(SpecforkError, match="SamplingParams"):
        next(tiny_llm.stream([1, 2], {"max_tokens": 3}))
    with pytest.raises(PromptError, match="no conversations"):
        tiny_llm.chat([])
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    list(tiny_llm.stream([1, 2], params))
    assert tiny_llm.last_output.token_ids == tiny_llm.generate([[1, 2]], params)[0].token_ids


def test_a_closed_llm_refuses_to_generate(tiny_dir):
    with LLM(str(tiny_dir)) as llm:
        llm.generate([[1, 2]], SamplingParams(max_tokens=2))
    for use in (lambda: llm.generate([[1, 2]]), lambda: next(llm.stream([1, 2])), lambda: llm.chat([[{"role": "user", "content": "x"}]])):
        with pytest.raises(SpecforkError, match="this LLM is closed"):
            use()


def test_an_engine_gives_the_process_its_threads_back_when_closed_or_dropped(tiny_dir):
    """LLM(threads=N) (and tensor parallelism's share of the cores) set the process's torch
    threads for good: the next engine, or the user's own torch code, ran on them."""
    import gc

    import torch

    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    with LLM(str(tiny_dir), threads=other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
    llm = LLM(str(tiny_dir), threads=other)
    del llm
    gc.collect()
    assert torch.get_num_threads() == before


def test_a_refused_request_leaves_no_part_of_its_batch_queued(tiny_llm):
    ok, too_long = SamplingParams(max_tokens=4), SamplingParams(max_tokens=100)
    with pytest.raises(PromptError, match="max_model_len 64"):
        tiny_llm.generate([[1, 2], [1, 2]], [ok, too_long])
    assert not tiny_llm.engine.has_unfinished()
    assert len(tiny_llm.generate([[1, 2]], ok)[0].token_ids) >= 1


def test_prompt_longer_than_context(tiny_llm):
    with pytest.raises(PromptError, match="64"):
        tiny_llm.generate([[1] * 64])


def test_token_ids_outside_vocabulary(tiny_llm):
    with pytest.raises(PromptError, match="vocabulary"):
        tiny_llm.generate([[1, 64]])
    with pytest.raises(PromptError, match="integers"):
        tiny_llm.generate([[1, "a"]])


def test_text_prompt_without_tokenizer(tiny_llm):
    with pytest.raises(PromptError, match="no tokenizer"):
        tiny_llm.generate(["hello"])


def test_a_failed_request_does_not_poison_the_engine(tiny_llm):
    with pytest.raises(PromptError):
        tiny_llm.generate([[1, 2], []])
    out = tiny_llm.generate([[1, 2]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out) == 1 and len(out[0].token_ids) == 3


def test_unknown_model(tmp_path):
    with pytest.raises(ModelLoadError, match="neither a known alias"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(str(tmp_path))


def test_malformed_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="malformed GGUF"):
        LLM(str(bad))
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"hello world")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        LLM(str(not_gguf))


def test_malformed_safetensors(tmp_path, tiny_dir):
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ModelLoadError, match="malformed safetensors"):
        LLM(str(tmp_path))


def test_bad_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported model_type"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("options, field", [
    ({"block_size": 0}, "block_size"), ({"device": "tpu"}, "device"), ({"max_num_seqs": -1}, "max_num_seqs"),
    ({"dtype": "bfloat16"}, "dtype"), ({"bogus": 1}, "bogus"),
    ({"threads": 100_000}, "threads must be at most"),  # OpenMP segfaulted
    ({"mode": "ssd", "target_cores": "0", "draft_cores": "0-1"}, "overlap"),
    ({"mode": "ssd", "drafter_timeout_s": 0}, "--drafter-timeout"),
    ({"mode": "sd", "drafter": "ngram", "lookup_first": 2}, "already is prompt lookup"),
    # options of another mode were silently ignored
    ({"draft": "x", "lookup_corpus": "none"}, "--draft, --lookup-corpus only apply to --mode sd or ssd; this run is "
     "--mode ar"),
    ({"mode": "sd", "fan_out": 7}, "--fan-out only applies to --mode ssd"),
])
def test_bad_engine_options(tiny_dir, options, field):
    with pytest.raises(SpecforkError, match=field):
        LLM(str(tiny_dir), **options)


# ---- CLI ----------------------------------------------------------------------------------

def test_cli_unknown_model():
    r = run_cli("generate", "--model", "/no/such/model", "--prompt", "hi")
    assert r.returncode == 2 and "error:" in r.stderr and "neither a known alias" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_invalid_sampling_values(tiny_dir):
    for flags, field in ((["--temperature", "-1"], "temperature"), (["--temperature", "nan"], "temperature"),
                         (["--top-p", "0"], "top_p"),
                         (["--top-p", "1.5"], "top_p"), (["--max-tokens", "0"], "max_tokens")):
        r = run_main("generate", "--model", str(tiny_dir), "--prompt", "hi", *flags)
        assert r.returncode == 2 and field in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_cli_empty_prompt(tiny_dir):
    r = run_main("generate", "--model", str(tiny_dir), "--prompt", "")
    assert r.returncode == 2 and "prompt is empty" in r.stderr and "Traceback" not in r.stderr


def test_cli_refuses_an_empty_chat_prompt_and_too_many_tokens():
    """The embedded model has a chat template: an empty --prompt is refused there too (it used to
    be templated and answered), and --max-tokens follows the one length rule the server uses."""
    r = run_cli("generate", "--prompt", "")
    assert r.returncode == 2 and r.stderr.strip() == "error: prompt is empty"
    r = run_main("generate", "--prompt", "Hi", "--max-tokens", "1000000000")  # loads the model: in-process
    assert r.returncode == 2
    assert "plus max_tokens (1000000000)" in r.stderr and "max_model_len 8192" in r.stderr


def test_empty_chat_messages_are_refused():
    from specfork.loading.tokenizer import check_messages

    for messages in ([{"role": "user", "content": ""}], [{"role": "system", "content": "be brief"},
                                                          {"role": "user", "content": ""}]):
        with pytest.raises(PromptError, match="content is empty"):
            check_messages(messages)
    check_messages([{"role": "user", "content": " "}])  # whitespace is content


def test_cli_argument_errors_are_one_line_pointing_to_help():
    r = run_cli("generate", "--temperature", "warm")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "invalid float value: 'warm'" in r.stderr and "see `specfork generate --help`" in r.stderr
    r = run_cli("generate", "--prompt", "Hi", "--prompts-file", "x.jsonl")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not allowed with argument" in r.stderr


def test_cli_options_must_be_spelled_in_full_and_unknown_ones_name_their_nearest():
    """argparse's prefix matching read ``bench --output DIR`` as ``--output-len DIR`` and failed on
    an int; a prefix is now an unknown option, with the options it may have meant."""
    r = run_main("bench", "--output", "results")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "unrecognized option: --output (did you mean --output-len or --out?)" in r.stderr
    assert "see `specfork bench --help`" in r.stderr
    r = run_main("generate", "--prompt", "Hi", "--max-token=3", "--no-such-thing")
    assert r.returncode == 2
    assert "unrecognized options: --max-token (did you mean --max-tokens or --min-tokens?), --no-such-thing" in r.stderr


def test_cli_prompts_file_errors(tmp_path, tiny_dir):
    cases = {
        b'{"token_ids": [1, 2]}\n\xff\xfe bad bytes\n': "line 2: line is not valid UTF-8",
        b'{"token_ids": [1, 2]}\n{not json\n': "2:2: not valid JSON: Expecting property name enclosed in double "
                                                 "quotes (line 2, column 2)",
        b'{"text": "x"}\n': "1: each line needs exactly one of",
        b'{"token_ids": []}\n': "1: prompt is empty",
        b'{"token_ids": [1, 9999]}\n': "outside the vocabulary",
        b"\n\n": "contains no prompts",
    }
    for i, (content, message) in enumerate(cases.items()):
        f = tmp_path / f"p{i}.jsonl"
        f.write_bytes(content)
        r = run_main("generate", "--model", str(tiny_dir), "--prompts-file", str(f))
        assert r.returncode == 2, (content, r.stderr)
        assert message.replace("line 2: ", "") in r.stderr and "Traceback" not in r.stderr, (message, r.stderr)
    r = run_main("generate", "--model", str(tiny_dir), "--prompts-file", str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and "cannot read prompts file" in r.stderr
    r = run_main("generate", "--model", str(tiny_dir), "--prompts-file", str(tmp_path / "p0.jsonl"), "--raw")
    assert r.returncode == 2 and "--raw is for --prompt" in r.stderr, r.stderr


@pytest.mark.parametrize("options, message", [
    # options of a proposer or loader the run does not use: ignored before, exit 0
    (dict(mode="sd", drafter="ngram", draft="smollm2-135m-draft"), "--draft is for a draft model"),
    (dict(mode="sd", drafter="ngram", draft_confidence=0.5), "--draft-confidence is for a draft model"),
    (dict(mode="ssd", corpus_tokens=3), "--corpus-tokens caps"),
    (dict(mode="sd", lookup_corpus="none", corpus_tokens=3), "--corpus-tokens caps"),
    (dict(quantize_group=64), "give --quantize int4 too"),
    (dict(mode="ssd", draft_confidence=0.2), "--draft-confidence is SD's floor"),
    (dict(mode="sd", ngram_min=2), "--ngram-min is the shortest n-gram that --drafter ngram matches"),
    (dict(mode="ssd", ngram_max=3), r"--ngram-max .* SSD's fast backup looks n-grams up with fixed bounds"),
    (dict(mode="sd", draft="path/to/my-draft", ngram_max=3), r"this run \(--mode sd, no lookup first\)"),
])
def test_options_the_run_would_ignore_are_refused(options, message):
    from specfork.config import Config

    with pytest.raises(SpecforkError, match=message):
        Config(**options)


def test_the_ngram_bounds_are_taken_where_a_lookup_reads_them():
    from specfork.config import Config

    for options in (dict(ngram_min=2), dict(ngram_max=3), dict(draft_confidence=0.2)):  # SD's alone, not SSD's
        with pytest.raises(SpecforkError, match="only applies to --mode sd;"):
            Config(**options)

    assert Config(mode="sd", drafter="ngram", ngram_min=2, ngram_max=3).ngram_min == 2
    assert Config(mode="sd", ngram_max=3).prompt_lookup  # the shipped head looks up first
    assert Config(mode="sd", draft="path/to/my-draft", lookup_first=2, ngram_max=3).ngram_max == 3


def test_a_draft_confidence_for_a_draft_model_and_a_context_past_the_cache_are_refused(tiny_dir):
    with pytest.raises(SpecforkError, match="--draft-confidence is the confidence floor of an EAGLE-3 head"):
        LLM(str(tiny_dir), mode="sd", draft=str(tiny_dir), draft_confidence=0.5)
    # max_model_len 60 of the model's 64 positions, in a cache of 2 blocks (32 tokens): was cut to 32 silently
    with pytest.raises(SpecforkError, match="max_model_len 60 does not fit in the KV cache, which holds 32 tokens"):
        LLM(str(tiny_dir), max_model_len=60, num_kv_blocks=2)
    assert LLM(str(tiny_dir), num_kv_blocks=2).max_model_len == 32  # not asked for: the cache's length


def test_cli_prompts_file_output_in_order(tmp_path, tiny_dir):
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"token_ids": [1, 2, 3]}\n{"token_ids": [4, 5], "extra": 1}\n')
    out = tmp_path / "out.jsonl"
    r = run_main("generate", "--model", str(tiny_dir), "--prompts-file", str(f), "--output", str(out),
                "--max-tokens", "4", "--ignore-eos", "--no-progress")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    llm = LLM(str(tiny_dir))
    expected = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [x["token_ids"] for x in lines] == [o.token_ids for o in expected]
    assert all(set(x) == {"token_ids", "text", "metrics"} for x in lines)
    assert lines[0]["metrics"]["num_generated_tokens"] == 4


def test_seed_is_the_engine_seed_in_generate_and_serve():
    """--seed means the same in every engine command: the engine's seed (Config.seed)."""
    from specfork.cli import build_parser
    from specfork.cli.parser import engine_options
    from specfork.config import Config

    parser = build_parser()
    for command in (["generate", "--prompt", "x"], ["serve"]):
        assert Config(**engine_options(parser.parse_args([*command, "--seed", "7"]))).seed == 7
        assert engine_options(parser.parse_args(command))["seed"] == Config().seed


def test_generate_with_a_seed_is_reproducible_and_follows_the_seed(tiny_dir, tmp_path):
    prompts = tmp_path / "ids.jsonl"
    prompts.write_text('{"token_ids": [1, 2, 3]}\n{"token_ids": [4, 5]}\n')

    def sample(seed):
        result = run_main("generate", "--model", str(tiny_dir), "--prompts-file", str(prompts), "--temperature", "1.0",
                          "--max-tokens", "12", "--ignore-eos", "--seed", str(seed))
        assert result.returncode == 0, result.stderr
        return [json.loads(line)["token_ids"] for line in result.stdout.splitlines()]

    assert len(sample(2**70)) == 2  # any integer seeds the engine (no overflow in the generator)
    first = sample(3)
    assert len(first) == 2 and all(len(ids) == 12 for ids in first)
    assert sample(3) == first
    assert any(sample(s) != first for s in (4, 5, 6))


def test_cli_output_paths_that_cannot_be_written_are_refused_before_any_work(tmp_path, tiny_dir):
    r = run_main("generate", "--model", str(tiny_dir), "--prompt", "hi", "--output", str(tmp_path / "no" / "o.jsonl"))
    assert r.returncode == 2 and "does not exist" in r.stderr and not r.stdout, (r.stdout, r.stderr)
    r = run_main("generate", "--model", str(tiny_dir), "--prompt", "hi", "--output", str(tmp_path))
    assert r.returncode == 2 and "is a directory" in r.stderr and not r.stdout
    (tmp_path / "file").write_text("x")
    r = run_main("bench", "--model", str(tiny_dir), "--modes", "ar", "--out", str(tmp_path / "file"))
    assert r.returncode == 2 and "is a file; give a directory" in r.stderr and not r.stdout


def test_cli_version_and_an_interrupt_on_its_own_line(monkeypatch):
    r = run_main("--version")
    assert r.returncode == 0 and r.stdout.startswith("specfork ") and r.stdout.split()[1][0].isdigit(), r.stdout
    from specfork.cli import COMMANDS

    def interrupted(args):
        print("a streamed text without its newline", end="")
        raise KeyboardInterrupt

    monkeypatch.setattr(COMMANDS["models"], "run", interrupted)
    r = run_main("models")
    assert r.returncode == 130 and r.stderr == "\ninterrupted\n"


@pytest.mark.parametrize("options, flag", [(dict(dist_timeout_s=5), "--dist-timeout"),
                                           (dict(distributed_launch="torchrun"), "--distributed-launch")])
def test_distributed_options_without_a_world_are_refused(options, flag):
    from specfork.config import Config

    with pytest.raises(SpecforkError, match=f"{flag} is for a torch.distributed world"):
        Config(**options)
    assert Config(tensor_parallel_size=2, **options).tensor_parallel_size == 2


def test_tensor_parallel_ranks_with_more_threads_than_cores_are_warned_of(tiny_dir, monkeypatch, caplog):
    """--tensor-parallel-size 2 --threads 2 on 2 cores ran 5x slower than the default, silently."""
    import os

    from specfork.parallel.world import World

    def stop(*args, **kwargs):
        raise RuntimeError("stopped before any rank starts")

    monkeypatch.setattr(World, "start", stop)
    cores, before = len(os.sched_getaffinity(0)), torch.get_num_threads()
    with caplog.at_level("WARNING"), pytest.raises(RuntimeError, match="stopped before"):
        LLM(str(tiny_dir), tensor_parallel_size=2, threads=cores + 1)
    assert f"2 ranks of {cores + 1} threads each on {cores} cores" in caplog.text
    assert torch.get_num_threads() == before  # a world that failed to start leaves the threads as they were
