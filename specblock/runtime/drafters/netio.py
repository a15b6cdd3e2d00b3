"""Saving and loading small drafter networks: config.json + model.safetensors, nothing pickled.

Shared by the baseline drafters (EAGLE-3-style, Medusa-1). Weights copied from the target
(embedding, LM head) are frozen, never saved, and copied back from the target at load time, so a
drafter directory holds only what training moved. A drafter trained for another vocabulary or
hidden size is refused with a message that says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pydantic import BaseModel, ValidationError
from safetensors.torch import load_file, save
from torch import nn

from specblock.atomic import AtomicFiles
from specblock.errors import SpecBlockError
from specblock.runtime.drafters.draftvocab import DraftVocab

#: Module attribute -> how to get the tensor from the target model.
TARGET_TENSORS = {
    "embed.weight": lambda m: m.get_input_embeddings().weight,
    "lm_head.weight": lambda m: m.get_output_embeddings().weight,
}


def from_target(net: nn.Module, name: str, target_model) -> torch.Tensor:
    """The target's tensor for ``net``'s parameter ``name``: a reduced head takes rows ``W[d2t]``."""
    t = TARGET_TENSORS[name](target_model)
    return net.head_rows(t) if name == "lm_head.weight" and isinstance(net, DraftVocab) else t


def tie_frozen(net: nn.Module, target_model, names: tuple[str, ...]) -> None:
    """Copy (not share) the named target tensors into ``net`` and freeze them."""
    params = dict(net.named_parameters())
    with torch.no_grad():
        for name in names:
            params[name].copy_(from_target(net, name, target_model))
            params[name].requires_grad_(False)


def save_net(net: nn.Module, cfg: BaseModel, kind: str, path: str | Path, frozen: tuple[str, ...]) -> None:
    """Weights (bfloat16, like the SpecBlock drafter) and config replace the old pair together,
    so an interrupted export never leaves new weights beside an old config."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).contiguous()
             for k, v in net.state_dict().items() if k not in frozen}  # index maps (d2t) stay integers
    with AtomicFiles(path) as files:
        files.get("model.safetensors", "wb").write(save(state, metadata={"format": "pt", "kind": f"{kind}-drafter"}))
        files.get("config.json").write(json.dumps({"kind": kind, **cfg.model_dump()}, indent=1))


def name_keys(keys) -> str:
    """A few weight names and how many more: enough to see what is wrong, still one line."""
    keys = sorted(keys)
    return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def read_config(path: str | Path, kind: str, cfg_cls: type[BaseModel], label: str) -> BaseModel:
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise SpecBlockError(f"no {label} drafter at {path} (need config.json and model.safetensors)")
    try:
        raw = json.loads((path / "config.json").read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise SpecBlockError(f"{path / 'config.json'} is not valid JSON ({e}); re-export the drafter") from None
    if not isinstance(raw, dict) or raw.pop("kind", None) != kind:
        raise SpecBlockError(f"{path} is not a {label} drafter")
    try:
        return cfg_cls(**raw)
    except (ValidationError, TypeError, ValueError) as e:
        first = e.errors()[0] if isinstance(e, ValidationError) else {"loc": (), "msg": str(e)}
        where = ".".join(str(x) for x in first["loc"])
        raise SpecBlockError(f"{path / 'config.json'}: {where + ': ' if where else ''}{first['msg']}; "
                             "re-export the drafter") from None


def load_weights(net: nn.Module, path: str | Path, extra: dict[str, torch.Tensor], label: str) -> None:
    """Fill ``net`` from ``path/model.safetensors`` plus ``extra`` (tensors taken from the target).
    Missing, unexpected or misshapen weights are refused by name: a net that silently kept its
    random init would still decode losslessly, only slowly, and nobody would notice."""
    f = Path(path) / "model.safetensors"
    try:
        state = load_file(str(f))
    except Exception as e:  # noqa: BLE001 - truncated, empty or not safetensors at all
        raise SpecBlockError(f"cannot read {f} ({type(e).__name__}: {e}); re-export the {label} drafter") from None
    state.update(extra)
    own = net.state_dict()
    missing, unexpected = set(own) - set(state), set(state) - set(own)
    if missing or unexpected:
        what = "; ".join(x for x in (missing and f"missing {name_keys(missing)}",
                                     unexpected and f"unexpected {name_keys(unexpected)}") if x)
        raise SpecBlockError(f"{f} does not fit its config.json ({what}); re-export the {label} drafter")
    bad = [k for k, v in state.items() if tuple(v.shape) != tuple(own[k].shape)]
    if bad:
        k = bad[0]
        raise SpecBlockError(f"{f}: {k} has shape {tuple(state[k].shape)}, config.json says {tuple(own[k].shape)}"
                             f"{f' ({len(bad) - 1} more)' if len(bad) > 1 else ''}; re-export the {label} drafter")
    net.load_state_dict(state)


def load_net(net_cls, cfg_cls, path: str | Path, kind: str, label: str, target_model, frozen: tuple[str, ...]):
    """Build ``net_cls(cfg)`` from ``path`` and fill the frozen tensors from ``target_model``."""
    cfg = read_config(path, kind, cfg_cls, label)
    emb = target_model.get_input_embeddings().weight
    if cfg.vocab_size != emb.shape[0] or cfg.hidden_size != emb.shape[1]:
        raise SpecBlockError(
            f"{label} drafter at {path} was trained for vocab {cfg.vocab_size} / hidden {cfg.hidden_size}, "
            f"the target has {emb.shape[0]} / {emb.shape[1]}; train a drafter for this target"
        )
    net = net_cls(cfg)
    if isinstance(net, DraftVocab):
        net.load_vocab(path, label)  # the head rows below are gathered with the saved map
    load_weights(net, path, {name: from_target(net, name, target_model).detach().float() for name in frozen}, label)
    for name, p in net.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    return net.eval()
