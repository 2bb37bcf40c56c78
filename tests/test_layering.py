"""The package's layers, checked on the import statements of every module (including imports
inside functions): models know nothing of speculation, speculation knows nothing of HTTP, the
engine holds no speculative code, and the configuration schema depends on nothing above it."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "specfork"

# package (or module) -> specfork packages it must never import
FORBIDDEN = {
    "layers": ("engine", "speculative", "serve", "bench", "training", "cli", "llm"),
    "models": ("engine", "speculative", "serve", "bench", "training", "cli", "llm"),
    "loading": ("engine", "speculative", "serve", "bench", "training", "cli", "llm"),
    "engine": ("speculative", "serve", "bench", "training", "cli", "llm"),
    "speculative": ("serve", "bench", "training", "cli", "llm"),
    # torch.distributed: runs the ranks' roles (shards, a drafter) by import path, knowing none of them
    "parallel": ("engine", "loading", "speculative", "serve", "bench", "training", "cli", "llm"),
    "serve": ("speculative", "bench", "training", "cli"),
    "config": ("speculative", "engine", "models", "layers", "serve", "bench", "training", "cli", "llm"),
    "options": ("speculative", "engine", "models", "layers", "serve", "bench", "training", "cli", "llm"),
    "fanout": ("speculative", "engine", "models", "layers", "serve", "bench", "training", "cli", "llm"),
    # the compiled kernels' loader: layers and sampling both call into it
    "native_kernels": ("sampling", "speculative", "engine", "models", "layers", "loading", "serve", "bench", "training",
                       "cli", "llm"),
    "sampling": ("speculative", "engine", "models", "layers", "serve", "bench", "training", "cli", "llm"),
    "output_paths": ("speculative", "engine", "models", "layers", "serve", "bench", "training", "cli", "llm"),
    "datasets": ("speculative", "engine", "models", "layers", "serve", "bench", "training", "cli", "llm"),
    "training": ("bench", "serve", "cli"),  # prompt sets come from specfork.datasets, shared with bench
}


def _specfork_imports(source: str, package: tuple[str, ...]) -> set[str]:
    """The first component under specfork of everything a module of ``package`` imports."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = package[: len(package) - node.level + 1]
                names = [".".join((*base, node.module or ""))]
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "specfork" and len(parts) > 1:
                found.add(parts[1])
    return found


def _modules(owner: str) -> list[Path]:
    target = SRC / owner
    return sorted(target.rglob("*.py")) if target.is_dir() else [target.with_suffix(".py")]


@pytest.mark.parametrize("owner", sorted(FORBIDDEN))
def test_layers_import_only_downwards(owner):
    modules = _modules(owner)
    assert modules and all(m.exists() for m in modules), owner
    bad = {
        str(m.relative_to(SRC)): sorted(
            _specfork_imports(m.read_text(), m.relative_to(SRC.parent).parts[:-1]) & set(FORBIDDEN[owner])
        )
        for m in modules
    }
    assert {m: b for m, b in bad.items() if b} == {}


def test_the_checker_sees_lazy_and_relative_imports():
    """The rule would pass trivially if the parser missed imports inside functions or relative
    ones: it must not."""
    source = "def f():\n    from specfork.speculative import sd_step\nfrom ..serve import app\n"
    assert _specfork_imports(source, ("specfork", "engine")) == {"speculative", "serve"}
