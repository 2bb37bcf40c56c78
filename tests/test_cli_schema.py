"""The command line is generated from the settings dataclasses: every field's option exists,
its default is the field's default, bad values are one-line errors, and parsed values build
the settings object."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from specfork.bench.serve_bench import ServeBenchSettings
from specfork.bench.settings import BenchSettings
from specfork.cli import build_parser, main, schema
from specfork.cli.parser import engine_options
from specfork.config import Config
from specfork.sampling_params import SamplingParams
from specfork.serve.server import ServerSettings
from specfork.training.settings import DataSettings, DraftArch, Eagle3Settings, TrainDraftJob, TrainSettings


def _parse(*argv):
    return build_parser().parse_args(list(argv))


def test_engine_defaults_are_configs_defaults():
    for command in ("generate", "serve"):
        assert Config(**engine_options(_parse(command))) == Config()


def test_every_config_field_is_an_option_of_generate_and_serve():
    for command in ("generate", "serve"):
        args = _parse(command)
        assert {f.name for f in dataclasses.fields(Config)} <= set(vars(args)), command


@pytest.mark.parametrize("argv, field, value", [
    (["--k", "auto"], "k", "auto"),
    (["--k", "3"], "k", 3),
    (["--mode", "ssd", "--drafter-timeout", "auto"], "drafter_timeout_s", None),
    (["--mode", "ssd", "--drafter-timeout", "2.5"], "drafter_timeout_s", 2.5),
    (["--deterministic"], "deterministic", True),
    (["--mode", "ssd", "--fan-out-list", "geometric:6"], "fan_out_list", "geometric:6"),
    (["--quantize", "int4", "--quantize-group", "64"], "quantize_group", 64),
    (["--seed", "11"], "seed", 11),
    (["--mode", "ssd", "--backup", "fast"], "backup", "fast"),
])
def test_engine_options_reach_the_config(argv, field, value):
    config = Config(**engine_options(_parse("generate", *argv)))
    assert getattr(config, field) == value


@pytest.mark.parametrize("argv, expected", [
    (["generate", "--mode", "tree"], "argument --mode: invalid choice: 'tree'"),
    (["generate", "--k", "many"], "must be an integer or auto, got 'many'"),
    (["serve", "--drafter-timeout", "soon"], "must be a number of seconds or auto, got 'soon'"),
    (["generate", "--quantize-group", "48"], "argument --quantize-group: invalid choice: 48"),
    (["bench", "--backup", "slow"], "argument --backup: invalid choice: 'slow'"),
    (["bench-serve", "--request-rate", "1,fast"], "takes comma-separated numbers or inf, got '1,fast'"),
    (["--log-level", "loud", "models"], "--log-level: 'loud' is not one of debug, info"),
    (["models", "--log-level", "loud"], "--log-level: 'loud' is not one of debug, info"),
])
def test_bad_option_values_are_one_line_errors(argv, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert expected in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv, level", [
    (["models"], "WARNING"),
    (["--log-level", "info", "models"], "info"),
    (["models", "--log-level", "debug"], "debug"),
    (["--log-level", "error", "generate", "--log-level", "info"], "info"),  # the later one wins
    (["--log-level", "error", "bench"], "error"),  # unset after the command: the one before stands
])
def test_the_log_level_is_read_before_or_after_the_command(argv, level):
    assert _parse(*argv).log_level == level


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`specfork ... | head`: the command's output meets a closed pipe; no traceback, exit 141."""
    script = ("import sys; from specfork.cli import COMMANDS, main; "
              "COMMANDS['models'].run = lambda args: [print('x' * 99) for _ in range(100000)] and 0; "
              "sys.exit(main(['models']))")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline() == b"x" * 99 + b"\n"
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141, err
    assert b"Traceback" not in err and b"Error" not in err, err


def test_the_other_commands_default_to_their_settings_defaults():
    args = _parse("bench")
    assert BenchSettings(**schema.values(args, BenchSettings)) == BenchSettings()
    args = _parse("bench-serve")
    assert ServeBenchSettings(**schema.values(args, ServeBenchSettings)) == ServeBenchSettings()
    args = _parse("serve")
    assert ServerSettings(**schema.values(args, ServerSettings)) == ServerSettings()
    args = _parse("train-draft", "--output", "d")
    for settings in (DataSettings, DraftArch, TrainSettings, Eagle3Settings):
        assert settings(**schema.values(args, settings)) == settings()
    assert TrainDraftJob(**schema.values(args, TrainDraftJob)).work_dir.name == "d.work"
    assert TrainDraftJob(**schema.values(args, TrainDraftJob)).kind == "draft"


def test_command_specific_defaults_and_lists():
    args = _parse("generate", "--stop", "a", "--stop", "b")
    params = SamplingParams(**schema.values(args, SamplingParams))
    assert (params.temperature, params.max_tokens, params.stop) == (0.0, 256, ("a", "b"))  # greedy by default
    assert SamplingParams(**schema.values(_parse("generate"), SamplingParams)).stop == ()
    args = _parse("bench", "--datasets", "all", "--input-len", "8", "--modes", "ar, sd", "--k", "auto")
    settings = BenchSettings(**schema.values(args, BenchSettings))
    assert (settings.datasets, settings.modes, settings.k) == (("humaneval", "sharegpt", "random"), ("ar", "sd"), "auto")
    args = _parse("train-draft", "--output", "d", "--layers", "2", "--kv-heads", "1")
    assert DraftArch(**schema.values(args, DraftArch)) == DraftArch(num_layers=2, num_kv_heads=1)
    args = _parse("train-draft", "--output", "d", "--kind", "eagle3", "--ttt-steps", "7", "--draft-vocab", "8192",
                  "--head-intermediate-size", "1024", "--intermediate-size", "512")
    assert TrainDraftJob(**schema.values(args, TrainDraftJob)).kind == "eagle3"
    assert Eagle3Settings(**schema.values(args, Eagle3Settings)) == Eagle3Settings(
        ttt_steps=7, draft_vocab=8192, head_intermediate_size=1024)
    assert DraftArch(**schema.values(args, DraftArch)).intermediate_size == 512  # the draft's, not the head's
    args = _parse("bench-serve", "--request-rate", "1,inf", "--base-url", "http://h:1/")
    settings = ServeBenchSettings(**schema.values(args, ServeBenchSettings))
    assert (settings.request_rates, settings.base_url) == ((1.0, float("inf")), "http://h:1")


def test_a_field_the_command_line_cannot_read_is_refused_when_the_parser_is_built():
    @dataclasses.dataclass
    class Odd:
        points: list[int] = dataclasses.field(default_factory=list)

    import argparse

    with pytest.raises(TypeError, match="points"):
        schema.add_options(argparse.ArgumentParser(), Odd)


def test_each_help_heading_appears_once():
    """train-draft's options come from several settings classes; a heading two of them share (its
    data group) was printed twice."""
    import re

    for command in ("train-draft", "generate", "serve", "bench"):
        text = build_parser()._subparsers._group_actions[0].choices[command].format_help()
        headings = re.findall(r"^(\S[^\n]*):$", text, re.M)
        assert len(headings) == len(set(headings)), (command, headings)


def test_no_help_shows_an_unfilled_placeholder():
    """A help text that lost its f-prefix printed "{SSD_DEFAULT_K}" to users."""
    import re

    from specfork.cli import COMMANDS

    for command in COMMANDS:
        text = build_parser()._subparsers._group_actions[0].choices[command].format_help()
        # (a constant's name; choices print in braces too, in lower case: --quantize {int4})
        assert not re.search(r"\{[A-Z_][A-Z0-9_]*\}", text), (command, re.findall(r"\{[A-Z_][A-Z0-9_]*\}", text))
