"""Start-up benchmark: how long a user waits, measured against `python -c "import torch"` on the
same machine in the same run (absolute times differ from machine to machine; the differences
to torch's import are what the goals are stated in).

    python benchmarks/bench_startup.py [--repeat 3] [--model smollm2-135m] [--skip-ssd] [--skip-phases]

Prints:
  1. whole commands, median of --repeat runs: `import torch`, `specfork --help`, `specfork
     generate` until its first streamed byte and until it exits, and an SSD server until /health
     answers 200;
  2. the phases of loading the model in one process (what the first token waits for).

It imports nothing from specfork, so it can time an older checkout through PYTHONPATH
(`--skip-phases`); its clock and median are those of `specfork/bench/timing.py`
(`time.perf_counter`; `statistics.median` equals the interpolated 50th percentile).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

PROMPT = "Write a Python function that checks whether a number is prime."


def _python_command(*args: str) -> list[str]:
    return [sys.executable, *args]


def time_command(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def time_first_token(model: str) -> tuple[float, float]:
    """(seconds until the first byte of the reply is on stdout, seconds until the process ends)."""
    cmd = _python_command("-m", "specfork.cli", "generate", "--model", model, "--prompt", PROMPT, "--max-tokens", "16")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)
    first = proc.stdout.read(1)
    first_at = time.perf_counter() - start
    proc.stdout.read()
    if proc.wait() != 0 or not first:
        raise SystemExit(f"generate failed (exit {proc.returncode})")
    return first_at, time.perf_counter() - start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_ssd_server(model: str, timeout_s: float = 300.0) -> float:
    port = _free_port()
    cmd = _python_command("-m", "specfork.cli", "serve", "--model", model, "--mode", "ssd", "--k", "2",
                          "--port", str(port))
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - start < timeout_s:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited early (exit {proc.returncode})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:
                time.sleep(0.05)
        raise SystemExit("the server did not become ready")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


PHASES_SCRIPT = r"""
import json, sys, time
t = time.perf_counter
marks = [("start", t())]
import torch
marks.append(("import torch", t()))
from specfork.llm import LLM
from specfork.sampling_params import SamplingParams
marks.append(("import specfork", t()))
from specfork.native_kernels import kernels
kernels()
marks.append(("native kernels (import the built library)", t()))
from specfork.loading.resolve import resolve_checkpoint
from specfork.loading.gguf import open_gguf, read_gguf_config, load_gguf_tensors
from specfork.loading.tokenizer import load_gguf_tokenizer
threads = torch.get_num_threads()
torch.set_num_threads(1)  # as load_model does while loading
location = resolve_checkpoint(sys.argv[1])
reader = open_gguf(location.path)
arch = read_gguf_config(reader, location.path)
marks.append(("parse the GGUF header and metadata", t()))
tensors = load_gguf_tensors(reader, arch, location.path, native=True)
marks.append(("tensor views -> quantised weights", t()))
tokenizer = load_gguf_tokenizer(reader)
marks.append(("tokenizer from the GGUF vocabulary", t()))
from specfork.models.llama import LlamaForCausalLM
LlamaForCausalLM(arch, lambda n: tensors.pop(n, None), 8192)
marks.append(("build the model (pack weights for the kernel)", t()))
torch.set_num_threads(threads)
llm = LLM(model=sys.argv[1])
marks.append(("whole LLM() (all of the above again, plus KV cache)", t()))
ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": sys.argv[2]}])
marks.append(("chat template + encode", t()))
next(iter(llm.stream(ids, SamplingParams(temperature=0.0, max_tokens=1))), None)
marks.append(("first token (prefill + sample)", t()))
print(json.dumps(marks))
"""


def phases(model: str) -> list[tuple[str, float]]:
    out = subprocess.run(_python_command("-c", PHASES_SCRIPT, model, PROMPT), check=True, capture_output=True,
                         text=True).stdout
    marks = json.loads(out.strip().splitlines()[-1])
    return [(name, marks[i][1] - marks[i - 1][1]) for i, (name, _) in enumerate(marks) if i > 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeat", type=int, default=3, help="runs per command; the median is shown (default 3)")
    parser.add_argument("--skip-ssd", action="store_true", help="do not time the SSD server")
    parser.add_argument("--skip-phases", action="store_true",
                        help="only the whole commands (e.g. to time an older checkout through PYTHONPATH)")
    args = parser.parse_args()
    env_threads = os.cpu_count()

    def median(fn, *a):
        return statistics.median(fn(*a) for _ in range(args.repeat))

    torch_s = median(time_command, _python_command("-c", "import torch"))
    help_s = median(time_command, _python_command("-m", "specfork.cli", "--help"))
    runs = [time_first_token(args.model) for _ in range(args.repeat)]
    first_s = statistics.median(r[0] for r in runs)
    total_s = statistics.median(r[1] for r in runs)
    print(f"start-up of {args.model} ({env_threads} cores), median of {args.repeat} runs")
    print(f"  {'command':<52} {'seconds':>8} {'- torch import':>15}")
    rows = [("python -c 'import torch'", torch_s), ("specfork --help", help_s),
            ("specfork generate: first streamed token", first_s), ("specfork generate: exit (16 tokens)", total_s)]
    if not args.skip_ssd:
        rows.append(("specfork serve --mode ssd: /health 200", median(time_ssd_server, args.model)))
    for name, seconds in rows:
        extra = "" if name.startswith("python") or name.endswith("--help") else f"{seconds - torch_s:+15.2f}"
        print(f"  {name:<52} {seconds:8.2f} {extra}")
    if args.skip_phases:
        return
    print("phases of one process (seconds):")
    for name, seconds in phases(args.model):
        print(f"  {name:<52} {seconds:8.3f}")


if __name__ == "__main__":
    main()
