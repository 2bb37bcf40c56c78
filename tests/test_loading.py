"""Loading paths not covered elsewhere: Mistral configs, HF directories with tokenizer files and
a chat template, and explicit attention masks through the paged cache."""

import torch
from builders import randomize_
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from specfork import LLM, SamplingParams
from specfork.engine.sequence import Sequence
from specfork.loading.resolve import resolve_checkpoint


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
