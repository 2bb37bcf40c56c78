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

from specfork import LLM, PromptError
from specfork.datasets import load_prompts
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
    with LLM(mode="sd", k=2, draft="smollm2-135m-draft") as sd:
        assert sd.generate(["Hi"])[0].token_ids
    assert sorted(parsed) == sorted(set(parsed)) and len(parsed) == 2  # the target and the draft, once each
    parsed.clear()
    with LLM(mode="sd", k=2) as sd:  # the default draft, an EAGLE-3 head (safetensors), reads no GGUF
        assert sd.generate(["Hi"])[0].token_ids
    assert parsed == [str(embedded)]


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
        closed = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=False, return_dict=False)
        assert ours.apply_chat_template(messages, add_generation_prompt=False) == list(closed)
        opened = [*messages, {"role": "assistant", "content": "  Sure, here is "}]
        expected = ref.apply_chat_template(opened, tokenize=True, add_generation_prompt=False,
                                           continue_final_message=True, return_dict=False)
        assert ours.apply_chat_template(opened, add_generation_prompt=False, continue_final_message=True) == list(expected)
    assert (ours.eos_token_id, ours.pad_token_id) == (ref.eos_token_id, ref.pad_token_id)
    assert ours.vocab == ref.get_vocab()



def test_continuing_the_last_message_does_not_also_open_a_new_turn(embedded):
    tokenizer = load_gguf_tokenizer(GGUFFile(embedded))
    opened = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(PromptError, match="add_generation_prompt"):
        tokenizer.apply_chat_template(opened, continue_final_message=True)
    ids = tokenizer.apply_chat_template(opened, add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("assistant\nHello")
    # content that also occurs in the end-of-turn markup: found backwards, it was cut inside the markup
    for content in ("im", "\n", "end"):
        ids = tokenizer.apply_chat_template([*opened[:1], {"role": "assistant", "content": content}],
                                            add_generation_prompt=False, continue_final_message=True)
        assert tokenizer.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n" + content), content

def _write_vocab_gguf(path, tokens: list[str], types: list[int], merges: list[str], *, arch: str, pre: str,
                      bos: int, eos: int, add_bos: bool) -> None:
    """A GGUF with a tokenizer and no tensors."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_tiny_vocab_gguf(path, *, pre: str, add_bos: bool) -> None:
    """The byte alphabet, a few merges, two control tokens and a user-defined one."""
    spelled = list(byte_alphabet().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġ w", "o r", "1 2", "12 3"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = spelled + merged + ["<|begin_of_text|>", "<|end_of_text|>", "<think>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 4]
    _write_vocab_gguf(path, tokens, types, merges, arch="llama", pre=pre, bos=len(tokens) - 3, eos=len(tokens) - 2,
                      add_bos=add_bos)


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
    cut.write_bytes(embedded.read_bytes()[:100_000])  # cut inside the vocabulary
    with pytest.raises(ModelLoadError, match="truncated or corrupt header"):
        GGUFFile(cut)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 40)
    with pytest.raises(ModelLoadError, match="GGUF"):
        GGUFFile(bad)


def test_special_tokens_outside_the_byte_alphabet_go_through_transformers(tmp_path):
    """DeepSeek-style BOS/EOS are not spelled in the byte alphabet: such vocabularies are built by
    transformers, so they tokenize exactly as transformers does (which re-spells those tokens)."""
    spelled = list(byte_alphabet().values())
    merges = ["h e", "Ġ t"]
    tokens = spelled + ["he", "Ġt", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]
    _write_vocab_gguf(tmp_path / "v.gguf", tokens, [1] * (len(tokens) - 2) + [3, 3], merges, arch="qwen2",
                      pre="deepseek-r1-qwen", bos=len(tokens) - 2, eos=len(tokens) - 1, add_bos=True)
    ours = load_gguf_tokenizer(GGUFFile(tmp_path / "v.gguf"))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="v.gguf")
    assert ours.encode("he the") == ref("he the")["input_ids"]
    assert (ours.eos_token_id, ours.special_tokens["bos_token"]) == (ref.eos_token_id, ref.bos_token)


def test_chat_templates_render_as_transformers_does(embedded):
    from specfork import PromptError
    from specfork.loading.tokenizer import Tokenizer

    base = load_gguf_tokenizer(GGUFFile(embedded))

    def tokenizer(template: str, **special) -> Tokenizer:
        return Tokenizer(base._backend, chat_template=template, special_tokens={"bos_token": None, **special})

    messages = [{"role": "user", "content": "hi"}]
    unset = tokenizer("[{{ bos_token }}]{% for m in messages %}{{ m.content }}{% endfor %}")
    assert base.decode(unset.apply_chat_template(messages)) == "[]hi"  # an unset token renders as nothing
    marked = tokenizer("{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}")
    assert base.decode(marked.apply_chat_template(messages)) == "<hi>"
    strict = tokenizer("{% if messages[0].role != 'system' %}{{ raise_exception('a system turn comes first') }}"
                       "{% endif %}")
    with pytest.raises(PromptError, match="a system turn comes first"):
        strict.apply_chat_template(messages)


def test_every_metadata_type_alignment_and_tensor_type(tmp_path):
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    scalars = {"u8": (gguf.GGUFValueType.UINT8, 200), "i8": (gguf.GGUFValueType.INT8, -100),
               "u16": (gguf.GGUFValueType.UINT16, 60000), "i16": (gguf.GGUFValueType.INT16, -30000),
               "u32": (gguf.GGUFValueType.UINT32, 4_000_000_000), "i32": (gguf.GGUFValueType.INT32, -2_000_000_000),
               "u64": (gguf.GGUFValueType.UINT64, 2**63 + 5), "i64": (gguf.GGUFValueType.INT64, -(2**62)),
               "f32": (gguf.GGUFValueType.FLOAT32, 0.5), "f64": (gguf.GGUFValueType.FLOAT64, 1e-300),
               "bool": (gguf.GGUFValueType.BOOL, True), "str": (gguf.GGUFValueType.STRING, "ünï")}
    for key, (vtype, value) in scalars.items():
        w.add_key_value(f"t.{key}", value, vtype)
    w.add_key_value("t.f64s", [1.5, -2.25], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT64)
    w.add_key_value("t.bools", [True, False, True], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL)
    w.add_key_value("t.strs", ["a", "", "日本"], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)
    rng = np.random.default_rng(0)
    tensors = {"f32": rng.standard_normal((3, 5)).astype(np.float32),
               "f16": rng.standard_normal((4, 6)).astype(np.float16)}
    for name, array in tensors.items():
        w.add_tensor(name, array)
    bf16 = rng.standard_normal((2, 8)).astype(np.float32)
    bits = (bf16.view(np.uint32) >> 16).astype(np.uint16)
    w.add_tensor("bf16", bits.view(np.uint8).reshape(2, 16), raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = GGUFFile(path)
    for key, (_, value) in scalars.items():
        assert ours.get(f"t.{key}") == value, key
    assert ours.get("t.f64s") == [1.5, -2.25] and ours.get("t.bools") == [True, False, True]
    assert ours.get("t.strs") == ["a", "", "日本"] and ours.array_length("t.strs") == 3
    assert ours.get("general.alignment") == 64
    from specfork.loading.gguf import dequantize_tensor

    for name, array in tensors.items():
        t = ours.tensor(name)
        assert t.shape == array.shape and np.array_equal(t.data, array)
    got = dequantize_tensor(ours.tensor("bf16")).numpy()
    assert got.shape == (2, 8) and np.array_equal(got, (bits.astype(np.uint32) << 16).view(np.float32))
    raw = path.read_bytes()
    last = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "bf16")
    (tmp_path / "end.gguf").write_bytes(raw[: last.data_offset + 8])  # metadata whole, the last tensor cut short
    from specfork.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="extends past the end"):
        GGUFFile(tmp_path / "end.gguf")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specfork.cli", *args], capture_output=True, text=True, timeout=300)


def test_first_contact_commands(embedded):
    r = _cli("models")
    assert r.returncode == 0 and r.stdout.splitlines()[0] == f"smollm2-135m\t{embedded}"
    lines = r.stdout.splitlines()
    assert lines[1].startswith("  default draft\tsmollm2-135m-eagle3\t")
    assert lines[2].startswith("  draft\tsmollm2-135m-draft\t") and lines[2].endswith(".gguf")
    assert lines[3].startswith("  lookup corpus\tsmollm2-135m-corpus\t") and lines[3].endswith(".npz")
    from specfork import native_kernels

    if native_kernels.kernels() is not None:  # built by install.sh: a second build is instant
        r = _cli("build-kernels")
        assert r.returncode == 0 and "already built" in r.stdout
    r = _cli("generate", "--max-tokens", "2")
    assert r.returncode == 0 and "no --prompt given; using the demo prompt" in r.stderr and r.stdout.strip()


def test_a_build_killed_by_a_signal_leaves_no_lock_that_later_builds_wait_on(tmp_path):
    """torch's build lock is a plain file: a build killed while holding it left every later
    `specfork` command waiting forever, silently. The build's own lock goes with its process."""
    import threading

    from specfork.native_kernels import exclusive_build

    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from specfork.native_kernels import exclusive_build\n"
        "with exclusive_build(Path(sys.argv[1])):\n"
        "    (Path(sys.argv[1]) / 'lock').write_text('torch')\n"
        "    print('holding', flush=True); time.sleep(60)\n"), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    entered = threading.Event()

    def build():
        with exclusive_build(tmp_path):
            entered.set()

    waiter = threading.Thread(target=build, daemon=True)
    waiter.start()
    assert not entered.wait(1.0)  # a live build holds it: wait
    assert (tmp_path / "lock").exists()
    holder.kill()  # the build dies holding both locks (SIGKILL: nothing of its own runs)
    holder.wait()
    assert entered.wait(10.0)  # the next build goes on at once, torch's stale lock removed
    waiter.join()
    assert not (tmp_path / "lock").exists()
