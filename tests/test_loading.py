"""Loading paths not covered elsewhere: Mistral configs, HF directories with tokenizer files and
a chat template, explicit attention masks through the paged cache, and checkpoint settings the model
does not implement (refused, never run without)."""

import json

import gguf
import pytest
import torch
from builders import randomize_
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from specfork import LLM, ModelLoadError, SamplingParams
from specfork.engine.sequence import Sequence
from specfork.loading.gguf import read_gguf_config
from specfork.loading.gguf_file import GGUFFile
from specfork.loading.resolve import resolve_checkpoint
from specfork.models.config import ModelArchConfig


def test_mistral_without_window_matches_transformers(tmp_path):
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        sliding_window=None, tie_word_embeddings=False)
    model = MistralForCausalLM(cfg).float().eval()
    randomize_(model, 3)
    model.save_pretrained(tmp_path)
    prompt = [1, 5, 9, 30, 7, 2, 99]
    out = LLM(str(tmp_path)).generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12)
    assert out.token_ids == ref[0, len(prompt):].tolist()


def test_hf_directory_with_tokenizer_and_chat_template(tmp_path):
    gguf = resolve_checkpoint("smollm2-135m").path
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(tmp_path)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, eos_token_id=2,
                                 bos_token_id=1)).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path))
    assert llm.tokenizer is not None and llm.tokenizer.has_chat_template()
    messages = [{"role": "user", "content": "Hi there"}]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = llm.encode_chat(messages)
    assert tokenizer.decode(ids) == expected
    assert llm.encode("Hello world") == tokenizer("Hello world")["input_ids"]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and isinstance(out.text, str)


def test_explicit_mask_equals_causal_default(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["qwen2-bias-untied"].path), block_size=4)
    eng = llm.engine
    seqs = [Sequence(100 + i, p, SamplingParams(), torch.Generator()) for i, p in enumerate([[1, 2, 3, 4, 5], [6, 7]])]
    for s in seqs:
        eng.block_manager.grow(s, len(s.token_ids))
    tokens = [s.token_ids for s in seqs]
    rows = list(range(7))
    default = eng.runner.forward(seqs, [0, 0], tokens, rows, decode=False)
    mask = torch.zeros(2, 5, 5, dtype=torch.bool)
    mask[0] = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    mask[1, :2, :2] = torch.tril(torch.ones(2, 2, dtype=torch.bool))
    mask[1, 2:, 0] = True  # padded query rows
    explicit = eng.runner.forward(seqs, [0, 0], tokens, rows, attn_mask=mask, decode=False)
    torch.testing.assert_close(explicit, default)
    # A mask that hides the first token from the last query of sequence 0 changes its output only.
    mask[0, 4, 0] = False
    changed = eng.runner.forward(seqs, [0, 0], tokens, rows, attn_mask=mask, decode=False)
    assert not torch.allclose(changed[4], default[4])
    torch.testing.assert_close(changed[:4], default[:4])
    torch.testing.assert_close(changed[5:], default[5:])
    for s in seqs:
        eng.block_manager.free(s)


def _llama_dict(**changes) -> dict:
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256).to_dict()
    return {**cfg, **changes}


@pytest.mark.parametrize("changes, message", [
    # each of these ran, with the feature left out: logits off by 1-6 against transformers
    ({"mlp_bias": True}, "mlp_bias is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor is not supported"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
     "qwen2 models with a sliding window"),
    ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8}, "sliding window"),
    # tracebacks before (TypeError, ValueError, ZeroDivisionError)
    ({"hidden_size": None}, "lacks the field 'hidden_size'"),
    ({"hidden_size": "sixty-four"}, "hidden_size must be an integer, got 'sixty-four'"),
    ({"num_attention_heads": 0, "head_dim": None}, "num_attention_heads must be positive"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be positive"),
    ({"rope_scaling": "llama3"}, "rope_scaling must be an object"),
])
def test_config_settings_the_model_does_not_implement_are_refused(changes, message):
    with pytest.raises(ModelLoadError, match=message):
        ModelArchConfig.from_hf_dict(_llama_dict(**changes))


def test_windows_that_never_apply_are_not_refused():
    qwen = ModelArchConfig.from_hf_dict(_llama_dict(model_type="qwen2", use_sliding_window=True, sliding_window=8,
                                                    max_window_layers=2))  # from layer 2 on: none of 2
    mistral = ModelArchConfig.from_hf_dict(_llama_dict(model_type="mistral", sliding_window=256))
    assert qwen.num_layers == mistral.num_layers == 2
    assert ModelArchConfig.from_hf_dict(_llama_dict(partial_rotary_factor=None, mlp_bias=False)).num_layers == 2


def _gguf_metadata(path, **extra):
    """A llama GGUF's metadata (no tensors): enough for the config reader."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"llama.attention.head_count": 4, "llama.embedding_length": 64, "llama.vocab_size": 128,
                       "llama.feed_forward_length": 128, "llama.block_count": 2, "llama.context_length": 256,
                       "llama.attention.layer_norm_rms_epsilon": 1e-5, **extra}.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return GGUFFile(path)


@pytest.mark.parametrize("extra, message", [
    ({}, None),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, None),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, "rope scaling 'yarn' is not supported"),
    ({"llama.rope.dimension_count": 8}, "RoPE on 8 of each head's 16 dimensions"),
    ({"llama.expert_count": 8}, "mixture-of-experts"),
    ({"llama.attention.head_count_kv": [2, 4]}, "head_count_kv is a list of 2 values"),
    ({"llama.attention.head_count": 0}, "head_count must be positive"),
])
def test_gguf_settings_the_model_does_not_implement_are_refused(tmp_path, extra, message):
    """A YaRN-scaled GGUF ran with no scaling at all, and per-layer head counts were a TypeError."""
    reader = _gguf_metadata(tmp_path / "m.gguf", **extra)
    if message is None:
        cfg = read_gguf_config(reader, tmp_path / "m.gguf")
        assert (cfg.head_dim, cfg.num_kv_heads) == (16, 4)
        return
    with pytest.raises(ModelLoadError, match=message):
        read_gguf_config(reader, tmp_path / "m.gguf")


def test_paths_that_are_almost_a_checkpoint_say_which_one_to_pass(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="it holds m.gguf: pass the .gguf file itself"):
        resolve_checkpoint(str(tmp_path))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"\x10" * 16)
    with pytest.raises(ModelLoadError, match="for an HF model pass its directory"):
        resolve_checkpoint(str(hf / "model.safetensors"))


@pytest.mark.parametrize("changes, message", [
    ({"intermediate_size": 256}, "the MLP weights have 128 units where the config says intermediate_size 256"),
    ({"num_hidden_layers": 1}, "weights for 2 layers but the config says 1"),
])
def test_a_config_that_describes_other_weights_is_refused(tmp_path, changes, message):
    """Both ran before: with the weights' MLP width, or with the first layers only."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in _llama_dict().items() if k != "model_type"})).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(tmp_path))


def test_an_unused_tensor_of_a_configured_layer_is_only_warned_of(tmp_path, caplog):
    """Old rotary buffers or biases the config does not use are ignored with a warning, as before
    the layer-count check (which looks at layers past the config's count only)."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in _llama_dict().items() if k != "model_type"})).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.cos_cached"] = torch.zeros(4, 4)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    LLM(str(tmp_path))
    assert "ignored 1 unexpected tensors" in caplog.text


def test_nan_weights_are_warned_of_by_name(tmp_path, caplog):
    """A checkpoint with a NaN weight loads (as in transformers) but generates noise: said once,
    naming the tensor; a clean one says nothing."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in _llama_dict().items() if k != "model_type"})).save_pretrained(tmp_path)
    LLM(str(tmp_path))
    assert "NaN or infinite" not in caplog.text
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    LLM(str(tmp_path))
    assert "1 weight tensors hold NaN or infinite values (layers.1.mlp.down_proj" in caplog.text


def test_a_missing_tensor_is_named_as_the_file_spells_it(tmp_path):
    """The message named the HF spelling with no path, also for a GGUF file."""
    from safetensors.torch import load_file, save_file

    from specfork.loading.gguf import gguf_name, hf_name

    for name in ("blk.1.ffn_up.weight", "blk.0.attn_q.bias", "token_embd.weight", "output_norm.weight"):
        assert gguf_name(hf_name(name)) == name
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in _llama_dict().items() if k != "model_type"})).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=f"{tmp_path} lacks the tensor 'model.layers.1.mlp.up_proj.weight'"):
        LLM(str(tmp_path))
