"""The one definition of the metrics (DESIGN.md), used by the CLI, the benchmarks and the notes.

- tau: mean over target forwards of (accepted draft tokens + 1).
- Spd: tokens/s of a method over tokens/s of plain decoding, same target, prompts and run.
- T_D%: drafting time over decode-iteration time (prefill excluded from both).
- per-depth acceptance: of the iterations whose tree reached depth d, the share that accepted d.
Tokens are counted as token ids, never by re-tokenising text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class DecodeStats:
    new_tokens: int = 0
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens, per iteration
    tree_depth: list[int] = field(default_factory=list)  # deepest node drafted, per iteration
    tree_size: list[int] = field(default_factory=list)  # nodes verified (root included)
    draft_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0
    loop_s: float = 0.0  # all decode iterations, bookkeeping included
    prefill_s: float = 0.0
    wall_s: float = 0.0  # prefill + loop

    @property
    def iterations(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        return float(np.mean(np.asarray(self.accepted) + 1)) if self.accepted else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def draft_share(self) -> float:
        return self.draft_s / self.loop_s if self.loop_s > 0 else 0.0

    def per_depth_acceptance(self) -> list[float]:
        return per_depth_acceptance(self.accepted, self.tree_depth)

    def merge(self, other: "DecodeStats") -> "DecodeStats":
        """Totals over prompts: tau and T_D% of the merged stats weigh every iteration equally."""
        out = DecodeStats()
        for name in ("new_tokens", "draft_s", "verify_s", "commit_s", "loop_s", "prefill_s", "wall_s"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        for name in ("accepted", "tree_depth", "tree_size"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        return out

    def summary(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "iterations": self.iterations,
            "tau": round(self.tau, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "draft_share": round(self.draft_share, 4),
            "wall_s": round(self.wall_s, 4),
            "mean_tree_size": round(float(np.mean(self.tree_size)), 2) if self.tree_size else 0.0,
            "per_depth_acceptance": [round(a, 4) for a in self.per_depth_acceptance()],
        }


def per_depth_acceptance(accepted: list[int], depth: list[int]) -> list[float]:
    acc, dep = np.asarray(accepted), np.asarray(depth)
    if dep.size == 0 or dep.max() == 0:
        return []
    out = []
    for d in range(1, int(dep.max()) + 1):
        reached = dep >= d
        out.append(float((acc[reached] >= d).mean()))
    return out


def speedup(method: DecodeStats, baseline: DecodeStats) -> float:
    """Spd: the ratio of tokens/s, both measured in the same run."""
    return method.tokens_per_s / baseline.tokens_per_s if baseline.tokens_per_s > 0 else 0.0
