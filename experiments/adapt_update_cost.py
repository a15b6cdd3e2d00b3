"""What one serving-time update costs, and where its time goes: heads and full, fp32 and bf16.

The shipped SpecBlock drafter serves ``--prompts`` queries per domain (chat template, as the
bench) with the adapter recording and never training. Then each (arm, amp) update is timed alone
on the machine, on the worker's one thread, ``--reps`` times after one untimed call (the first
heads update also caches the frozen backbone's states), and one more call runs under the torch
profiler: the share of ``aten::mm`` and the top ops by self CPU time.

    .venv/bin/python experiments/adapt_update_cost.py --out experiments/results/adapt_update_cost
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))  # results_io beside it, however it is loaded

from adapt_offline import recording_adapter  # noqa: E402
from results_io import write_results  # noqa: E402
from specblock.runtime.adapt import AdaptSettings  # noqa: E402
from specblock.runtime.cli import quiet_transformers  # noqa: E402
from specblock.prompts import load_prompts  # noqa: E402
from specblock.runtime.adapt_update import UpdateTrainer  # noqa: E402
from specblock.runtime.chat import encode_prompt  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="packed-fp16")
    ap.add_argument("--domains", default="qa,mtbench,chat")
    ap.add_argument("--prompts", type=int, default=3, help="queries per domain in the buffer")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="serving's threads; updates run on the worker's 1")
    ap.add_argument("--out", type=Path, default=ROOT / "experiments/results/adapt_update_cost")
    args = ap.parse_args()
    quiet_transformers()
    torch.set_num_threads(args.threads)
    adapter, engine, tok = recording_adapter(args.target, args.dtype, AdaptSettings(window=10**9))
    for d in args.domains.split(","):
        for p in load_prompts(d, args.prompts):
            engine.generate(encode_prompt(tok, p), args.max_new_tokens)
    records = list(adapter.buffer)
    torch.set_num_threads(1)  # the worker's one thread
    rows = []
    for amp in ("off", "bf16"):
        trainer = UpdateTrainer(adapter.theta_0, AdaptSettings(amp=amp))
        for arm in ("heads", "full"):
            trainer.step(arm, records, adapter.master, 0)  # untimed: caches the backbone's states
            secs = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                trainer.step(arm, records, adapter.master, 0)
                secs.append(time.perf_counter() - t0)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                trainer.step(arm, records, adapter.master, 0)
            ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
            total = sum(e.self_cpu_time_total for e in ops)
            mm = sum(e.self_cpu_time_total for e in ops if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
            rows.append({"arm": arm, "amp": amp, "seconds": round(statistics.median(secs), 3),
                         "mm_share": round(mm / total, 3),
                         "top_ops": [(e.key, round(e.self_cpu_time_total / total, 3), e.count) for e in ops[:6]]})
            print(rows[-1], file=sys.stderr, flush=True)
    lines = ["python experiments/adapt_update_cost.py " + " ".join(sys.argv[1:]), "",
             f"One update on {len(records)} buffered queries ({args.dtype} target; the worker's 1 thread, alone on the "
             f"machine), median of {args.reps}; mm share: aten::mm/addmm/bmm of the self CPU time.", "",
             "| arm | amp | s | mm share | top ops (share, calls) |", "|---|---|---|---|---|"]
    lines += [f"| {r['arm']} | {r['amp']} | {r['seconds']:.3f} | {r['mm_share']:.0%} | "
              + ", ".join(f"{k} {s:.0%} ({n})" for k, s, n in r["top_ops"][:4]) + " |" for r in rows]
    write_results(args.out, args, rows, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
