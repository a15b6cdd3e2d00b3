"""Is the q4 target's forward the same for a sequence alone and in a batch? (Why ``featcache --dtype q4``
runs one sequence a forward.)

Two random sequences of ``--tokens`` tokens go through the served model (``TargetModel.load(..., dtype)``)
as one batch of two and each alone. Per hidden state (the input of each layer, then the last) it
prints the largest difference between the batched row and the lone forward, and the share of
positions whose argmax differs. bf16 is the control.

    python experiments/q4_batch_invariance.py --dtypes q4,bfloat16 --out experiments/results/q4_batch_invariance_s75
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from specblock.models import resolve_target  # noqa: E402
from specblock.runtime.target import TargetModel  # noqa: E402
from results_io import write_results  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="q4,bfloat16")
    ap.add_argument("--tokens", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "q4_batch_invariance")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = resolve_target(args.target)
    rows = []
    for dtype in args.dtypes.split(","):
        model = TargetModel.load(path, dtype, "cpu").model
        rng = np.random.default_rng(args.seed)
        seqs = rng.integers(100, min(30000, model.config.vocab_size), (2, args.tokens))
        with torch.no_grad():
            both = model(input_ids=torch.as_tensor(seqs), output_hidden_states=True, use_cache=False)
            alone = [model(input_ids=torch.as_tensor(s)[None], output_hidden_states=True, use_cache=False) for s in seqs]
        diffs = [max(float((both.hidden_states[i][r].float() - alone[r].hidden_states[i][0].float()).abs().max()) for r in range(2))
                 for i in range(len(both.hidden_states))]
        first = next((i for i, d in enumerate(diffs) if d > 0), None)
        argmax = [float((both.logits[r].argmax(-1) != alone[r].logits[0].argmax(-1)).float().mean()) for r in range(2)]
        rows.append({"dtype": dtype, "first_differing_state": first, "max_diff_by_state": [round(d, 5) for d in diffs],
                     "argmax_differs": [round(a, 3) for a in argmax]})
    lines = [f"`python experiments/q4_batch_invariance.py --dtypes {args.dtypes} --tokens {args.tokens} --seed {args.seed} "
             f"--threads {args.threads} --out {args.out}`: two random sequences as one batch against each alone. "
             "Hidden state i is the input of layer i (HF's hidden_states); the last is after the final norm.", "",
             "| dtype | first differing state | its max difference | largest difference | positions whose argmax differs (row 1 / row 2) |",
             "|---|---|---|---|---|"]
    for r in rows:
        f = r["first_differing_state"]
        lines.append(f"| {r['dtype']} | {'none' if f is None else f} | {0 if f is None else r['max_diff_by_state'][f]} | "
                     f"{max(r['max_diff_by_state'])} | {r['argmax_differs'][0]:.0%} / {r['argmax_differs'][1]:.0%} |")
    write_results(args.out, args, rows, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
