"""Target features computed once, shared by every feature-based drafter's training."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def target_identity(target_dir: Path) -> dict:
    """Name and weights checksum of a target: from ``specblock_model.json`` when the registry
    built it (its ``weights_sha256``), else the sha256 of its safetensors files."""
    target_dir = Path(target_dir)
    card = target_dir / "specblock_model.json"
    if card.is_file():
        meta = json.loads(card.read_text())
        if meta.get("weights_sha256"):
            return {"name": meta.get("name", target_dir.name), "weights_sha256": meta["weights_sha256"]}
    h = hashlib.sha256()
    for f in sorted(target_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return {"name": target_dir.name, "weights_sha256": h.hexdigest()}
