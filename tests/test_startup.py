"""Start-up: the GGUF is parsed once, the tokenizer is built from its metadata without
transformers yet tokenizes exactly as transformers does, and `specfork --help` imports no torch.

Timing goals live in `benchmarks/bench_startup.py`; these tests pin the causes of slowness (a
second parse, a transformers conversion, torch imported for --help) as counts, not seconds."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest
from transformers import AutoTokenizer

from specfork import LLM
from specfork.bench.datasets import load_prompts
from specfork.loading import gguf_file, resolve_checkpoint
from specfork.loading.gguf_file import GGUFFile
from specfork.loading.tokenizer import byte_alphabet, load_gguf_tokenizer

TEXTS = [
    "Hello world",
    "  leading spaces\n\n\ttabs and trailing   ",
    "def f(x):\n    return x**2  # ünïcödé 日本語 🙂",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "it's 12345678 don't I'LL",
    "",
]


@pytest.fixture(scope="module")
def embedded():
    return resolve_checkpoint("smollm2-135m").path


def _count_parses(monkeypatch) -> list[str]:
    parsed: list[str] = []
    real_init = GGUFFile.__init__

    def counting_init(self, path):
        parsed.append(str(path))
        real_init(self, path)

    monkeypatch.setattr(gguf_file.GGUFFile, "__init__", counting_init)
    return parsed


def test_loading_parses_each_gguf_once(monkeypatch, embedded):
    parsed = _count_parses(monkeypatch)
    llm = LLM()
    assert parsed == [str(embedded)]
    assert llm.tokenizer is not None and llm.engine.encode_chat([{"role": "user", "content": "Hi"}])
    parsed.clear()
    with LLM(mode="sd", k=2) as sd:
        assert sd.generate(["Hi"])[0].token_ids
    assert sorted(parsed) == sorted(set(parsed)) and len(parsed) == 2  # the target and the draft, once each


def test_embedded_model_loads_without_transformers_and_help_without_torch():
    code = ("import sys\nfrom specfork import LLM\nLLM()\n"
            "print(sorted(m for m in ('transformers', 'gguf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
    code = ("import sys\nfrom specfork.cli import main\n"
            "for argv in (['--help'], ['generate', '--help'], ['serve', '--help'], ['bench', '--help'],\n"
            "             ['train-draft', '--help'], ['export-gguf', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert err.strip().splitlines()[-1] == "False"


def test_gguf_file_reads_what_the_gguf_package_reads(embedded):
    ours, theirs = GGUFFile(embedded), gguf.GGUFReader(str(embedded))
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        assert ours.get(key) == (value if not isinstance(value, float) else pytest.approx(value)), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.shape == tuple(int(d) for d in reversed(ref.shape)) and mine.type_name == ref.tensor_type.name
        assert np.array_equal(mine.data.reshape(-1).view(np.uint8), np.asarray(ref.data).reshape(-1).view(np.uint8))


def test_embedded_tokenizer_equals_transformers(embedded):
    ours = load_gguf_tokenizer(GGUFFile(embedded))
    ref = AutoTokenizer.from_pretrained(str(embedded.parent), gguf_file=embedded.name)
    texts = TEXTS + [p.text for p in load_prompts("humaneval", n=20)]
    texts += [m["content"] for p in load_prompts("sharegpt", n=40) for m in p.messages]
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    for p in load_prompts("sharegpt", n=20):
        messages = list(p.messages)
        expected = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert ours.apply_chat_template(messages) == list(expected)
    assert (ours.eos_token_id, ours.pad_token_id) == (ref.eos_token_id, ref.pad_token_id)
    assert ours.vocab == ref.get_vocab()


def _write_tiny_vocab_gguf(path, *, pre: str, add_bos: bool) -> None:
    """A GGUF with only a tokenizer: the byte alphabet, a few merges, two control tokens."""
    spelled = list(byte_alphabet().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġ w", "o r", "1 2", "12 3"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = spelled + merged + ["<|begin_of_text|>", "<|end_of_text|>", "<think>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 4]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 3)
    w.add_eos_token_id(len(tokens) - 2)
    w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("pre,add_bos", [("llama-bpe", True), ("qwen2", False), ("smollm", False)])
def test_tiny_vocabularies_tokenize_as_transformers(tmp_path, pre, add_bos):
    path = tmp_path / "vocab.gguf"
    _write_tiny_vocab_gguf(path, pre=pre, add_bos=add_bos)
    ours = load_gguf_tokenizer(GGUFFile(path))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    # transformers' GPT-2 class adds "<|endoftext|>" as an extra token (an id past the model's
    # vocabulary) to any vocabulary that lacks it: that artefact is not reproduced, so not compared.
    texts = [t.replace("<|endoftext|>", "") for t in TEXTS] + ["the other 123456 in a word<think> or <|end_of_text|>"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], (pre, text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert (ours.encode("the")[0] == len(byte_alphabet()) + 10) is add_bos  # BOS first only when asked


def test_malformed_gguf_is_a_clear_error(tmp_path, embedded):
    from specfork.errors import ModelLoadError

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(embedded.read_bytes()[:100_000])  # header intact, data missing
    with pytest.raises(ModelLoadError, match="malformed GGUF file"):
        GGUFFile(cut)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 40)
    with pytest.raises(ModelLoadError, match="GGUF"):
        GGUFFile(bad)
