"""A four-turn conversation whose every turn resends the earlier ones, on the embedded model, with
and without prefix caching (two engines in one process, alternating turn by turn, --deterministic,
2 threads): each turn's prompt length, the tokens taken from the cache, the time to the first
token and to the end of the request, and whether the two engines' outputs are equal
(README, "Prefix caching"; docs/decisions.md):

    python docs/experiments/prefix_cache_conversation.py ar|sd
"""

import sys

from specfork import LLM, SamplingParams

SYSTEM = {"role": "system", "content": "You are a concise assistant for a software team. " * 12}
QUESTIONS = ["How do I reverse a list in Python?", "And how do I sort it in descending order?",
             "What is the difference between a list and a tuple?", "Give one example of each."]


def main(mode: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=64)
    llms = {cached: LLM(prefix_caching=cached, deterministic=True, threads=2, mode=mode) for cached in (True, False)}
    conversations = {cached: [SYSTEM] for cached in llms}
    for turn, question in enumerate(QUESTIONS, 1):
        outs = {}
        for cached, llm in llms.items():
            conversations[cached].append({"role": "user", "content": question})
            outs[cached] = llm.chat(conversations[cached], params)[0]
            conversations[cached].append({"role": "assistant", "content": outs[cached].text})
        on, off = outs[True], outs[False]
        print(f"turn {turn}: prompt {len(on.prompt_token_ids)} tokens, {on.metrics['num_cached_prompt_tokens']} cached | "
              f"first token {on.metrics['ttft_s'] * 1000:.0f} ms, without the cache {off.metrics['ttft_s'] * 1000:.0f} ms | "
              f"request {on.metrics['time_s']:.2f} s, without {off.metrics['time_s']:.2f} s | "
              f"outputs equal {on.token_ids == off.token_ids}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ar")
