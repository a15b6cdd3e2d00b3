"""Record a target's fastest method from its main bench table, for ``--method auto``.

The highest mean Spd over the bench's domains among the methods the CLI can run by name (no
``@`` variants, no HF peers; ``METHOD+lookup`` counts: ``--method auto`` runs it as METHOD with
``--lookup-branch``) and identical to plain decoding on every prompt (``tune.fastest``), written as ``best.json`` beside the target's shipped drafters:

    python experiments/best_method.py experiments/results/bench_smollm2_main.json \
        --write specblock/assets/drafters/smollm2-135m-instruct

``--compiled`` reads a compiled-against-eager bench instead (``real_drafters.sh compiled``: each
method as ``METHOD@c`` on the compiled target) and records its fastest ``@c`` method under
``"compiled"`` in the same file, what ``--method auto --compile`` runs; the rest is kept, as a new eager
record keeps the ``"compiled"`` one. A bench in another dtype than the file's record goes under
``"other_dtypes"`` (its eager record, or with ``--compiled`` its ``"compiled"`` one), e.g. packed-q4's:

    python experiments/best_method.py experiments/results/bench_smollm2_compiled_packed_q4_s67.json --compiled \
        --write specblock/assets/drafters/smollm2-135m-instruct

``--cpu KIND`` (``specblock.cpu.CPU_KINDS``) records a bench run on one kind of CPU under
``"overrides"``, for that kind, dtype and mode only: on a Zen 5 without AMX the trees' rows cost more
than on the Xeon's tiles the rest was measured on. ``experiments/cpu_auto.sh`` runs the candidates
eager and compiled; record both, e.g.

    python experiments/best_method.py experiments/results/bench_smollm2_zen5_auto_s70.json --compiled \
        --cpu avx512-bf16 --write specblock/assets/drafters/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specblock.atomic import write_atomic
from specblock.cpu import CPU_KINDS
from specblock.errors import SpecBlockError
from specblock.runtime.tune import fastest  # the one rule, shared with tune (exact candidates only)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", type=Path, help="a main-table bench JSON")
    ap.add_argument("--write", type=Path, required=True, metavar="DRAFTERS_DIR")
    ap.add_argument("--compiled", action="store_true", help="record the fastest METHOD@c row for --method auto --compile")
    ap.add_argument("--cpu", choices=CPU_KINDS, help="record it for this kind of CPU only (best.json's \"overrides\"), "
                    "where the bench ran on one: the CPU decides what a tree row costs")
    args = ap.parse_args(argv)
    bench = json.loads(args.bench.read_text())
    ran_on = bench.get("cpu")
    if args.cpu and ran_on not in (None, args.cpu):
        raise SystemExit(f"{args.bench} ran on a CPU of kind {ran_on}, not {args.cpu}")
    try:
        best, means = fastest(bench, args.compiled)
    except SpecBlockError as e:
        raise SystemExit(str(e)) from None
    rec = {"method": best, "mean_speedup": round(means[best], 3), "dtype": bench["config"]["dtype"],
           "measured": f"{args.bench.with_suffix('.md').as_posix()}: the highest mean Spd of "
                       + ", ".join(f"{m}{'@c' if args.compiled else ''} {v:.2f}x"
                                   for m, v in sorted(means.items(), key=lambda kv: -kv[1]))}
    out = args.write / "best.json"
    base = json.loads(out.read_text()) if out.is_file() else {}
    if args.cpu:  # one CPU kind's choice over the record: replaces one for the same CPU, dtype and mode
        if not base:
            raise SystemExit(f"{out} does not exist: record a table for every CPU first (without --cpu)")
        here = {"cpu": args.cpu, "dtype": rec["dtype"], "compiled": args.compiled}
        kept = [o for o in base.get("overrides", []) if {k: o.get(k) for k in here} != here]
        rec = {**base, "overrides": kept + [{**here, **{k: v for k, v in rec.items() if k != "dtype"}}]}
    elif base and base.get("dtype") not in (None, rec["dtype"]):  # another dtype: its own entry, the rest kept
        others = dict(base.get("other_dtypes") or {})
        entry = dict(others.get(rec["dtype"]) or {})
        if args.compiled:
            entry["compiled"] = rec
        else:
            entry.update({k: v for k, v in rec.items() if k != "dtype"})
        rec = {**base, "other_dtypes": {**others, rec["dtype"]: entry}}
    elif args.compiled:
        if not base:
            raise SystemExit(f"{out} does not exist: record the eager table first (without --compiled)")
        rec = {**base, "compiled": rec}
    else:  # a new eager table leaves the compiled record, the other dtypes' and the CPUs' alone
        rec.update({k: base[k] for k in ("compiled", "other_dtypes", "overrides") if k in base})
    write_atomic(out, json.dumps(rec, indent=1) + "\n")
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
