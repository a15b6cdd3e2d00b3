"""What a training thread beside serving does to the target's forward on a CPU (why the adapter
gives serving fewer threads while an update runs; ``runtime/adapt.py``).

Times T(1) (one-token tree forward after a 128-token prefill) of the eager target: alone at the
serving thread count, alone at one thread less, then the same two while a background thread runs a
training loop at one thread (Adam on a drafter-head-sized MLP, 576 -> 1536 -> 8192, batch 256: the
shape of a heads update, not the adapter's own loss). Medians of ``--reps`` calls, interleaved
over ``--runs`` rounds.

    python experiments/adapt_cores.py --target smollm2-135m-instruct --dtype packed-fp16 --threads 2 \
        --out experiments/results/adapt_cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch

from specblock.policies.tree import DraftTree
from specblock.runtime.config import validate
from specblock.runtime.target import TargetModel, resolve_dtype


def t1_ms(target: TargetModel, reps: int) -> float:
    tree = DraftTree.from_parents(np.array([5]), np.array([-1]))
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        target.tree_forward(tree)
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def trainer(stop: threading.Event, threads: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(576, 1536), torch.nn.SiLU(), torch.nn.Linear(1536, 8192))
    opt = torch.optim.Adam(net.parameters())
    x = torch.randn(256, 576)
    while not stop.is_set():
        loss = net(x).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="packed-fp16")
    ap.add_argument("--threads", type=int, default=2, help="serving's threads (the one-less case uses threads - 1)")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="experiments/results/adapt_cores")
    args = ap.parse_args()
    if args.threads < 2:
        raise SystemExit("adapt_cores.py: --threads must be at least 2 (it compares with one thread less)")
    path = validate({"target": args.target}).target_dir
    args.dtype = resolve_dtype(args.dtype, "cpu")  # the results name what ran, never "auto"
    torch.set_num_threads(args.threads)
    target = TargetModel.load(path, args.dtype, "cpu")
    target.prefill(np.arange(100, 228))
    t1_ms(target, 5)  # warm-up
    rows: dict[str, list[float]] = {}

    def measure(label: str, threads: int) -> None:
        torch.set_num_threads(threads)
        rows.setdefault(label, []).append(t1_ms(target, args.reps))
        torch.set_num_threads(args.threads)

    one_less = args.threads - 1
    n, m = f"{args.threads} threads", f"{one_less} thread{'s' if one_less > 1 else ''}"
    for _ in range(args.runs):
        measure(f"alone, {n}", args.threads)
        measure(f"alone, {m}", one_less)
        stop = threading.Event()
        th = threading.Thread(target=trainer, args=(stop, 1), daemon=True)
        th.start()
        time.sleep(0.5)
        measure(f"beside a 1-thread training loop, {n}", args.threads)
        measure(f"beside a 1-thread training loop, {m}", one_less)
        stop.set()
        th.join()
    result = {"config": vars(args), "t1_ms": {k: round(statistics.median(v), 2) for k, v in rows.items()},
              "runs_ms": {k: [round(x, 2) for x in v] for k, v in rows.items()}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = ["| serving | T(1) ms, median of runs |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in result["t1_ms"].items()]
    text = "\n".join(lines) + "\n"
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
