"""Print the flags that take a sweep's best configuration of a policy class into a live run.

    python examples/best_config.py experiments/results/sweeps/custom_branching/results.json
        [--by speedup|tau] [--policy CLASS] [--bench NAME]

Reads the sweep's ``results.json`` (every point with its full config), keeps the points whose
``method.policy_class`` is ``--policy`` (default: any user class), takes the best by ``--by``
and prints, on one line, the runtime's flags (``--method specblock --budget N ... --policy CLASS
--policy-kwargs JSON``) or with ``--bench NAME`` the bench's ``--set NAME:KEY=VALUE`` items. The
JSON is printed without spaces, so the line can be split into words by the shell. Why a script:
copying kwargs from a CSV by hand is where a tuned value gets lost.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def best(results: list[dict], by: str, policy: str | None) -> dict:
    pts = [r for r in results if r["config"]["method"].get("policy_class")
           and (policy is None or r["config"]["method"]["policy_class"] == policy)]
    if not pts:
        raise SystemExit(f"error: no point with {'a policy_class' if policy is None else policy} in the sweep")
    return max(pts, key=lambda r: r[by])


def flags(m: dict, bench: str | None) -> list[str]:
    """The runtime's spelling of the sim's method section (the settings the sweep varied or fixed)."""
    items = [("budget", m.get("budget")), ("M", m["M"]), ("max_seeds", m["max_seeds"]),
             ("policy", m["policy_class"]), ("policy_kwargs", json.dumps(m["policy_kwargs"], separators=(",", ":")))]
    if m.get("seed_class"):
        items += [("seed_policy", m["seed_class"]), ("seed_policy_kwargs", json.dumps(m["seed_kwargs"], separators=(",", ":")))]
    items = [(k, v) for k, v in items if v is not None]
    if bench:
        return [w for k, v in items for w in ("--set", f"{bench}:{k}={v}")]
    return ["--method", m["name"]] + [w for k, v in items for w in ("--" + k.replace("_", "-"), str(v))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--by", choices=["speedup", "tau"], default="speedup")
    ap.add_argument("--policy", help="only points of this policy_class")
    ap.add_argument("--bench", metavar="NAME", help="print bench --set items for method NAME (e.g. specblock@custom)")
    a = ap.parse_args(argv)
    if not a.results.is_file():
        print(f"error: no sweep results at {a.results}; run the sweep first", file=sys.stderr)
        return 2
    r = best(json.loads(a.results.read_text()), a.by, a.policy)
    print(" ".join(flags(r["config"]["method"], a.bench)))
    print(f"# best by {a.by}: simulated Spd {r['speedup']:.3f}, tau {r['tau']:.3f}, tree {r['tree_size']:.1f}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
