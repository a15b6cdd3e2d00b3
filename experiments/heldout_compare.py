"""Exported drafters side by side on the same held-out windows (issue 14): did a fine-tune help?

Each ``--drafter NAME=METHOD:DIR`` is loaded and evaluated by its training recipe on the same
``--windows`` windows of the feature cache's held-out shards (the target's own answers, never trained
on), more than the 8 that training logs. The figure to compare is ``accepted``: the expected drafts
a top-1 chain gets accepted (SpecBlock: block 1's chain; EAGLE-3 / ParallelSpec / Falcon: the chain
over depths), with its parts by position; Medusa's heads are not a chain, so its row shows each
head's top-1, and SpS's its top-1 agreement with the target (alpha).

    python experiments/heldout_compare.py --features ~/.cache/specblock/features/smollm2-135m-instruct \
        --drafter shipped=specblock:specblock/assets/drafters/smollm2-135m-instruct/specblock \
        --drafter ft=specblock:/tmp/specblock-ft --out experiments/results/heldout_finetune_smollm2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: vocab_sweep is a sibling

from specblock.atomic import write_atomic  # noqa: E402
from specblock.errors import SpecBlockError  # noqa: E402
from specblock.models import resolve_target  # noqa: E402
from specblock.runtime.target import load_causal_lm  # noqa: E402
from specblock.training.featcache import FeatureCache  # noqa: E402
from vocab_sweep import evaluate, load  # noqa: E402


def load_drafter(method: str, path: Path, model):
    """Any exported drafter: SpS is an HF model of its own, the rest are re-headable nets."""
    if method != "sps":
        return load(method, path, model)
    from specblock.training.sps_step import SpsNet

    return SpsNet(load_causal_lm(path, "float32", "cpu", "sdpa", False)).eval()  # as the runtime loads it


def parse(spec: str) -> tuple[str, str, Path]:
    name, _, rest = spec.partition("=")
    method, _, path = rest.partition(":")
    if not (name and method and path):
        raise SpecBlockError(f"--drafter {spec!r}: write NAME=METHOD:DIR, e.g. shipped=specblock:specblock/assets/drafters/...")
    if not (Path(path) / "config.json").is_file():
        raise SpecBlockError(f"--drafter {name}: no drafter at {path} (config.json missing)")
    return name, method, Path(path)


def accepted(row: dict) -> tuple[float, list[float]]:
    """The chain's expected accepted drafts and its parts; Medusa: its heads' top-1; SpS: alpha."""
    for key in ("block1_acc", "chain_acc"):
        if isinstance(row.get(key), list):
            return float(sum(row[key])), row[key]
    if "alpha" in row:
        return float("nan"), [row["alpha"]]
    return float("nan"), row.get("head_top1", [])


def markdown(rows: list[dict], windows: int, window: int) -> str:
    lines = [f"Held-out: {windows} windows of {window} tokens of the target's own answers (chatgen shard 0, never trained on).", "",
             "| drafter | method | accepted per chain | by position / depth | coverage |", "|---|---|---|---|---|"]
    for r in rows:
        total, parts = accepted(r)
        lines.append(f"| {r['name']} | {r['method']} | {total:.3f} | {' / '.join(f'{x:.3f}' for x in parts)} | {r['coverage']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--features", type=Path, required=True)
    ap.add_argument("--drafter", action="append", required=True, metavar="NAME=METHOD:DIR")
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--window", type=int, default=257, help="tokens per held-out window (training's --window)")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    try:
        specs = [parse(s) for s in a.drafter]
        target_dir = resolve_target(a.target)
        model = load_causal_lm(target_dir, "float32", "cpu", "sdpa", False).eval()
        cache = FeatureCache(a.features, target_dir)
        rows = []
        for name, method, path in specs:
            row = {"name": name, "method": method, "drafter": str(path),
                   **evaluate(method, load_drafter(method, path, model), cache, a.windows, a.window)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    except SpecBlockError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    a.out.parent.mkdir(parents=True, exist_ok=True)
    md = markdown(rows, a.windows, a.window)
    write_atomic(a.out.with_suffix(".json"), json.dumps({"windows": a.windows, "window": a.window, "rows": rows}, indent=1) + "\n")
    write_atomic(a.out.with_suffix(".md"), md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
