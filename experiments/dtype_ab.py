"""The README's main command (``make run``: ``--method auto --compare ar`` on the default model) at several
``--dtype``s, each run a fresh process, the dtypes interleaved: what a user of each would see.

Why: whether ``auto`` should pick another dtype is a question about this command first. Each run reports the
chosen method's and plain decoding's tokens/s (one process times both), so the table has medians of both.

    python experiments/dtype_ab.py --dtypes packed-fp16,packed-q4-amx --runs 3 --out experiments/results/dtype_ab
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specblock.atomic import write_atomic  # noqa: E402


def one_run(dtype: str, extra: list[str]) -> dict:
    """``python -m specblock.runtime --dtype DTYPE --compare ar --json`` (the default prompt and method)."""
    cmd = [sys.executable, "-m", "specblock.runtime", "--dtype", dtype, "--compare", "ar", "--json", *extra]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        raise SystemExit(f"dtype_ab: --dtype {dtype} exited {done.returncode}: {lines[-1]}")
    return json.loads(done.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="packed-fp16,packed-q4-amx")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--extra", default="", help="more CLI flags for every run, e.g. '--max-new-tokens 64'")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    runs: dict[str, list[dict]] = {d: [] for d in dtypes}
    for _ in range(args.runs):
        for d in dtypes:
            runs[d].append(one_run(d, args.extra.split()))
    rows = []
    for d in dtypes:
        rs = runs[d]
        rows.append({"dtype": d, "method": rs[0]["method"] + ("+lookup" if rs[0].get("lookup_branch") else ""),
                     "tokens_per_s": float(np.median([r["tokens_per_s"] for r in rs])),
                     "ar_tokens_per_s": float(np.median([r["ar_tokens_per_s"] for r in rs])),
                     "speedup": float(np.median([r["speedup"] for r in rs])),
                     "tau": float(np.median([r["tau"] for r in rs])),
                     "new_tokens": [r["new_tokens"] for r in rs],
                     "identical_to_ar": all(r["identical_to_ar"] for r in rs)})
    cmd = " ".join(["python experiments/dtype_ab.py", "--dtypes", args.dtypes, "--runs", str(args.runs),
                    *(["--extra", repr(args.extra)] if args.extra else []), "--out", args.out.as_posix()])
    lines = [f"`make run`'s command at each dtype, fresh processes, interleaved, medians of {args.runs} runs (`{cmd}`).", "",
             "| dtype | method (auto) | tokens/s | plain decoding tokens/s | speedup | tau | new tokens | identical to plain |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['method']} | {r['tokens_per_s']:.1f} | {r['ar_tokens_per_s']:.1f} | {r['speedup']:.2f}x "
                     f"| {r['tau']:.2f} | {', '.join(map(str, r['new_tokens']))} | {r['identical_to_ar']} |")
    write_atomic(args.out.with_suffix(".json"), json.dumps({"rows": rows, "runs": runs}, indent=1))
    write_atomic(args.out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
