"""What the drafters of a target must reach: for tree sizes n, the target's T(n)/T(1) from a
calibrate JSON and the tau that ``--speedup`` needs when drafting takes ``--draft-share`` of
each iteration (``CalibratedLatency.tau_needed``). Writes JSON and a markdown table.

    python experiments/physical_limit.py specblock/sim/data/latency_cpu_smollm2.json \
        --out experiments/results/physical_limit_smollm2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specblock.atomic import write_atomic
from specblock.sim.latency import CalibratedLatency, LatencyMeasurements


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("latency", type=Path)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--speedup", type=float, default=2.0)
    ap.add_argument("--draft-share", type=float, default=0.2)
    ap.add_argument("--sizes", default="4,8,12,16,20,24,32")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    meas = json.loads(args.latency.read_text())
    lat = CalibratedLatency(LatencyMeasurements.model_validate(meas))
    t1 = lat.target_ms(1, args.ctx)
    rows = [{"n": n, "T_n_ms": round(lat.target_ms(n, args.ctx), 3), "T_n_over_T1": round(lat.target_ms(n, args.ctx) / t1, 3),
             "tau_needed": round(lat.tau_needed(n, args.ctx, args.speedup, args.draft_share), 3)}
            for n in (int(x) for x in args.sizes.split(","))]
    result = {"latency": str(args.latency), "device": meas.get("device"), "ctx": args.ctx, "T1_ms": round(t1, 3),
              "overhead_ms": lat.overhead_ms, "speedup": args.speedup, "draft_share": args.draft_share, "rows": rows}
    md = [f"T(1) = {t1:.2f} ms at context {args.ctx} ({meas.get('device')}); engine glue {lat.overhead_ms:.2f} ms; "
          f"tau needed for {args.speedup:.1f}x with T_D% {100 * args.draft_share:.0f}%:", "",
          "| tree tokens n | T(n) ms | T(n)/T(1) | tau needed |", "|---|---|---|---|"]
    md += [f"| {r['n']} | {r['T_n_ms']:.2f} | {r['T_n_over_T1']:.2f} | {r['tau_needed']:.2f} |" for r in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps(result, indent=1) + "\n"), (".md", "\n".join(md) + "\n")):
        write_atomic(args.out.with_name(args.out.name + suffix), text)
    print("\n".join(md))


if __name__ == "__main__":
    main()
