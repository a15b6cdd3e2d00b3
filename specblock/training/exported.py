"""Starting a training run from a shipped (exported) drafter: ``--init-from specblock/assets/...``.

Why: the drafters in git are exported files (config, bf16 weights, model card); the run directories
that made them live outside git and are gone on a fresh machine. Fine-tuning a shipped drafter on
new data must not need them. An export writes ``training.json`` beside its weights (steps,
minutes, flags and the runs it descends from), so a fine-tune of it still knows its lineage and
its card can count all rounds.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from specblock.errors import SpecBlockError

TRAINING = "training.json"


def is_exported(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def training_record(run: dict) -> dict:
    """What an export keeps of its run: enough for a later fine-tune's lineage (``init``)."""
    return {"step": run["step"], "train_s": run["train_s"], "method": run["method"],
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in run["args"].items() if k != "d2t"},
            **({"init": run["init"]} if run.get("init") else {})}


def exported_start(path: Path, method: str) -> dict:
    """A start state like a checkpoint's: the saved weights (fp32) and the lineage, no optimizer.

    The weights copied from the target (embedding, LM head rows) are not in the file; the caller
    fills them from the freshly built network (``fill_frozen``)."""
    try:
        kind = json.loads((path / "config.json").read_text()).get("kind")
    except (ValueError, UnicodeDecodeError, AttributeError) as e:
        raise SpecBlockError(f"--init-from {path}: config.json is not a drafter config ({e})") from None
    if not kind:
        raise SpecBlockError(f"--init-from {path}: no drafter kind in its config.json (an SpS draft model is a "
                             "plain HF model: fine-tune it from its run directory)")
    if kind != method:
        raise SpecBlockError(f"--init-from {path} holds a {kind} drafter; pass --method {kind} or another directory")
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in load_file(str(path / "model.safetensors")).items()}
    rec = json.loads((path / TRAINING).read_text()) if (path / TRAINING).is_file() else {}
    return {"net": state, "method": method, "step": rec.get("step", 0), "train_s": rec.get("train_s", 0.0),
            "args": rec.get("args", {}), **({"init": rec["init"]} if rec.get("init") else {}),
            "exported": True, "record": bool(rec)}


def fill_frozen(net: torch.nn.Module, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``saved`` plus the network's frozen tensors it leaves out (the target's, copied at build
    time). Anything else missing stays missing: the caller's strict ``load_state_dict`` refuses it."""
    own = net.state_dict()
    frozen = (n for n, p in net.named_parameters() if not p.requires_grad and n not in saved)
    return {**{n: own[n] for n in frozen}, **saved}
