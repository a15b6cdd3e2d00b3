"""Prefill: the eager forward over the whole prompt against chunks through the compiled tree step.

Why ask: with ``--compile`` the prompt still runs eagerly (``StaticTarget.prefill``), and on the
real model that is 40-140 ms of a 48-token request (``prefill_ms`` in the compiled benches), up to
a fifth of its wall time. The compiled step already takes any tree up to 64 nodes, and a prompt is
a chain: feeding it in chunks of ``C`` tokens through that step (the last chunk padded to a
bucket) would need no new code path, only one more graph per chunk size and span. The question is
whether a compiled 32- or 64-row forward beats one eager forward over the prompt: compiling
removes per-op dispatch, which a many-row forward already amortises.

Each row times, on the same static target and interleaved: the eager prefill of ``n`` prompt
tokens, and the compiled chunks (after a one-token prefill: the step's past must be non-empty).
Medians of ``--reps``. Compiling the chunk graphs (first use, once per span) is reported apart.

    python experiments/prefill_paths.py --lengths 64,128,256 --chunks 32,64 --reps 5 \\
        --out experiments/results/prefill_paths
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from specblock.compiled.target import StaticTarget
from specblock.models.registry import resolve_target
from specblock.policies.tree import DraftTree
from specblock.runtime.target import load_causal_lm


def eager_ms(st: StaticTarget, ids: np.ndarray) -> float:
    t0 = time.perf_counter()
    st.prefill(ids)
    return 1e3 * (time.perf_counter() - t0)


def chunked_ms(st: StaticTarget, ids: np.ndarray, chunk: int) -> float:
    """The prompt after its first token, ``chunk`` tokens per compiled tree forward (a chain)."""
    st.prefill(ids[:1])
    t0 = time.perf_counter()
    for start in range(1, len(ids), chunk):
        part = ids[start:start + chunk]
        st.tree_forward(DraftTree.from_parents(part, np.arange(-1, len(part) - 1)))
        st.commit(np.arange(len(part)))
    return 1e3 * (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="packed-fp16")
    ap.add_argument("--lengths", default="64,128,256", help="prompt lengths (tokens)")
    ap.add_argument("--chunks", default="32,64", help="chunk sizes (tree buckets)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("experiments/results/prefill_paths"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    lengths = [int(x) for x in a.lengths.split(",")]
    chunks = [int(x) for x in a.chunks.split(",")]
    st = StaticTarget(load_causal_lm(resolve_target(a.target), a.dtype, "cpu", "sdpa", False), None, compile=True)
    rng = np.random.default_rng(0)
    prompt = lambda n: rng.integers(0, st.vocab_size, n)  # noqa: E731 - token ids only set the cost
    first = {}
    for n in lengths:  # every (chunk, span) graph this run meets, compiled (or loaded) before timing
        for c in chunks:
            t0 = time.perf_counter()
            chunked_ms(st, prompt(n), c)
            first[f"{n}/{c}"] = round(time.perf_counter() - t0, 1)
    rows = []
    with torch.no_grad():
        for n in lengths:
            t = {"eager": [], **{f"chunks of {c}": [] for c in chunks}}
            for _ in range(a.reps):  # interleaved: the machine's drift hits every path alike
                t["eager"].append(eager_ms(st, prompt(n)))
                for c in chunks:
                    t[f"chunks of {c}"].append(chunked_ms(st, prompt(n), c))
            rows.append({"tokens": n, **{k: round(statistics.median(v), 1) for k, v in t.items()}})
    cols = list(rows[0])[1:]
    lines = [f"Prefill on {a.target} ({a.dtype}, {a.threads} threads), ms, median of {a.reps} interleaved runs "
             f"(`python experiments/prefill_paths.py --lengths {a.lengths} --chunks {a.chunks} --reps {a.reps} "
             f"--out {a.out}`):", "", "| prompt tokens | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {r['tokens']} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + " |" for r in rows]
    lines += ["", "First pass per (prompt, chunk), s, compiling or loading the chunk graphs: "
              + ", ".join(f"{k} {v}" for k, v in first.items())]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    a.out.with_suffix(".json").write_text(json.dumps({"args": vars(a) | {"out": str(a.out)}, "rows": rows,
                                                      "first_pass_s": first}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
