"""Shared fixtures and hooks: the tiny random HF checkpoints of `builders.py` (built once per
session), the lossless tests' target with an EAGLE-3 head and with a draft model (built once per
session), transformers' model of the embedded GGUF, CUDA skips, and the process's cores and
threads restored after every test."""

from __future__ import annotations

import pytest
import torch
from builders import TINY_NAMES, TinyCheckpoint, build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, TinyCheckpoint]:
    """Every tiny checkpoint, built once per session: name -> TinyCheckpoint."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    return {name: build_tiny_checkpoint(name, root, seed=1234 + i) for i, name in enumerate(TINY_NAMES)}


@pytest.fixture(scope="session", params=TINY_NAMES)
def tiny_checkpoint(request, tiny_checkpoints) -> TinyCheckpoint:
    """Parametrized over every tiny checkpoint."""
    return tiny_checkpoints[request.param]


@pytest.fixture(scope="session")
def head_pair(tmp_path_factory) -> dict:
    """The lossless tests' 8-token target and a tiny reduced-vocabulary EAGLE-3 head
    (``eagle3_heads.head_models``): paths "target", "draft", and the HF model "hf_target"."""
    from eagle3_heads import head_models

    return head_models(tmp_path_factory.mktemp("head_pair"))


@pytest.fixture(scope="session")
def draft_pair(tmp_path_factory) -> dict:
    """The same target (seed 11) and a noisy copy of it as draft model (``lossless.ssd_models``)."""
    from lossless import ssd_models

    return ssd_models(tmp_path_factory.mktemp("draft_pair"))


@pytest.fixture(scope="session")
def embedded_hf_model():
    """transformers' fp32 model of the embedded GGUF (the reference), loaded once per session."""
    from transformers import AutoModelForCausalLM

    from specfork.loading.resolve import resolve_checkpoint

    path = resolve_checkpoint("smollm2-135m").path
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skip them, with the reason, where there is none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on a GPU machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_cores_and_threads():
    """An SSD engine pins this process to the target's cores until it is closed; a test that fails
    before closing one must not leave the rest of the suite on a single core."""
    import os

    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    yield
    if os.sched_getaffinity(0) != cores:
        os.sched_setaffinity(0, cores)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
