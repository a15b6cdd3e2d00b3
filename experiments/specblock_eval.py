"""SpecBlock's measurements beyond the benchmark table (issue: the SpecBlock drafter).

1. Held-out, per training domain: acceptance per in-block position for block 1 and block 2
   (chain acceptance under the valid-prefix rule: the share of blocks whose first k drafts are
   all the target's argmax), the rank head's accuracy and its confusion matrix over b0..b3.
2. With a bench JSON and a latency JSON: the physical limit per domain,
   ``tau * T(1) / T_verify(n_tree)`` (drafting free), next to the measured Spd.

    python experiments/specblock_eval.py --drafter specblock/assets/drafters/specblock \
        [--bench experiments/results/bench.json --latency specblock/sim/data/latency_cpu.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from specblock.runtime.config import validate
from specblock.runtime.drafters.specblock_net import SpecBlockNet
from specblock.runtime.target import load_causal_lm
from specblock.training.corpus import DOMAINS
from specblock.training.specblock_step import specblock_step, target_pass
from specblock.training.windows import WindowSource


@torch.no_grad()
def heldout(target_dir: Path, drafter: Path, windows: int, dtype: str = "bfloat16") -> dict:
    model = load_causal_lm(target_dir, dtype, "cpu", "sdpa", False).eval()
    net = SpecBlockNet.load(drafter, model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    src = WindowSource("lab", target_dir, 257)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for d in DOMAINS:
        s = src.held[d]
        starts = np.linspace(0, s.size - 258, windows).astype(np.int64)
        x = torch.from_numpy(np.stack([np.asarray(s[a : a + 257], dtype=np.int64) for a in starts]))
        acc, conf = [[], []], np.zeros((2, 4, 4))
        for chunk in x.split(4):
            res = specblock_step(net, target_pass(model, chunk, net.cfg.tap_layers, net), gen, 1.0)  # net: its draft vocabulary
            for i, bl in enumerate(res.blocks):
                reach = bl.mask[..., 0].sum().clamp_min(1)
                acc[i].append(((bl.mask * bl.top1.float()).flatten(0, -2).sum(0) / reach).numpy())
                m = bl.mask.bool()
                np.add.at(conf[i], (bl.true_bucket[m].numpy(), bl.pred_bucket[m].numpy()), 1)
        out[d] = {
            f"block{i + 1}": {
                "acceptance_by_position": np.round(np.mean(acc[i], axis=0), 4).tolist(),
                "rank_accuracy": round(float(np.trace(conf[i]) / max(conf[i].sum(), 1)), 4),
                "confusion_true_by_pred": conf[i].astype(int).tolist(),
            }
            for i in range(len(acc))
        }
        print(d, json.dumps(out[d]["block1"]["acceptance_by_position"]), flush=True)
    return out


def physical_limit(bench: dict, latency: dict) -> list[dict]:
    from specblock.sim.latency import CalibratedLatency, LatencyMeasurements

    lat = CalibratedLatency(LatencyMeasurements.model_validate(latency))
    rows = []
    for r in bench["rows"]:
        if r["method"] == "ar" or r.get("tau") is None:  # peers: HF's generate reports no tau
            continue
        ctx = 256  # the prompts' typical context; T(1) and T(n) are read at the same ctx
        t1, tn = lat.target_ms(1, ctx), lat.target_ms(max(1, round(r["mean_tree_size"])), ctx)
        limit = r["tau"] * t1 / tn
        # The goal (2.0x with T_D% <= 20%) read backwards.
        tau_needed = lat.tau_needed(max(1, round(r["mean_tree_size"])), ctx)
        rows.append({"method": r["method"], "domain": r["domain"], "measured_speedup": r["speedup"],
                     "tau": r["tau"], "mean_tree_size": r["mean_tree_size"], "limit_drafting_free": round(limit, 3),
                     "tau_needed_2x_at_td20": round(tau_needed, 3)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="a model name (see `models`) or directory; default: the real chat model")
    ap.add_argument("--drafter", type=Path, default=Path("specblock/assets/drafters/specblock"))
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "packed-fp16"],
                    help="the target's, for the held-out features (float32 where the drafter was trained on a float32 "
                         "feature cache, and where bf16 is not native: ~5x faster on an AVX2 CPU)")
    ap.add_argument("--bench", type=Path)
    ap.add_argument("--latency", type=Path)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/specblock_eval.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    target_dir = validate({"target": args.target}).target_dir
    result = {"heldout": heldout(target_dir, args.drafter, args.windows, args.dtype)}
    if args.bench and args.latency:
        result["physical_limit"] = physical_limit(json.loads(args.bench.read_text()), json.loads(args.latency.read_text()))
        for r in result["physical_limit"]:
            print(json.dumps(r))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
