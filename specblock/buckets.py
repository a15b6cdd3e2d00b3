"""The tree sizes the compiled target pads to (``--compile``), in a module without torch.

Why here: the compiled runtime pads each tree up to one of these sizes (``compiled/target.py``),
so its verify cost is a step function of the tree size, and the simulator, which never imports
torch, prices trees the same way when it is fitted on a compiled run (``sim/tracelat.py``).
"""

from __future__ import annotations

#: Tree sizes compiled for (each on first use). Fine at the small end because padded rows are not
#: free here: on this 2-core CPU the real model's compiled T(3) / T(4) / T(6) were 1.02-1.11x T(1)
#: but T(8) 1.39x (``experiments/results/compiled_rows.md``), so the 3-5-node trees the shipped
#: drafters serve paid 12-16 ms a step padded to 8. Above 8 a bucket is at most 1.5x its smallest
#: tree. More buckets cost compile time only for the sizes a run meets.
BUCKETS: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def bucket_of(n: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    """Smallest bucket holding ``n`` nodes; past the largest, the next multiple of it."""
    for b in buckets:
        if n <= b:
            return b
    top = buckets[-1]
    return -(-n // top) * top
