"""A branching policy of your own: widths from the drafter's confidence in the whole path.

The shipped SpecBlock rule (``RankBucketBranching``) reads the rank head's predicted bucket. This
one ignores the bucket's widths and asks the drafter's own probabilities instead, the idea behind
EAGLE-2's dynamic trees: a candidate is worth a node when the probability of the whole path to it
(its parent's cumulative draft probability times its own) is at least ``threshold``. Deep in a
block, or under an unsure parent, fewer candidates pass; where the drafter is sure, one does.

* ``max_width`` caps the candidates per position. The simulator reads this attribute to know how
  many candidates to offer the policy (declare it in your own class too);
* ``min_width`` = 1 keeps the spine (the top-1 candidate) going whatever its probability, so only
  siblings are thresholded; 0 lets a low-confidence spine end its branch there;
* ``bucket_cut``: a position the rank head predicts in b3 (the target's token outside the top
  ten) ends its branch, as the shipped widths (2, 4, 10, 0) do. Without a rank head (``bucket``
  is None) it has no effect.

It is a plain :class:`~specblock.policies.branching.TreePolicy`: ``raw_widths`` gets arrays for P
parents at once and answers P widths; the shared code fits them to the node budget and builds the
tree, in the runtime and in the simulator alike. No torch, no per-node Python loop.

    # live, against plain decoding:
    python -m specblock.runtime --target lab --method specblock \\
        --policy examples.custom_branching:PathConfidenceBranching \\
        --policy-kwargs '{"threshold": 0.05, "max_width": 3}' --compare ar
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specblock.policies.branching import TreePolicy

B3 = 3  # the rank head's "not in the top ten" bucket


@dataclass
class PathConfidenceBranching(TreePolicy):
    threshold: float = 0.05
    max_width: int = 3
    min_width: int = 1
    bucket_cut: bool = True
    name = "path-confidence"

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold is a probability in [0, 1], got {self.threshold}")
        if self.max_width < 1 or self.min_width not in (0, 1):
            raise ValueError(f"max_width >= 1 and min_width 0 or 1, got {self.max_width}, {self.min_width}")

    def raw_widths(self, parent_score: np.ndarray, cand_logprob: np.ndarray, bucket: np.ndarray | None) -> np.ndarray:
        """``parent_score`` [P]: each parent's cumulative draft log-prob; ``cand_logprob`` [P, k]:
        its candidates' log-probs, best first; ``bucket`` [P] or None: the predicted rank bucket
        (-1 where unknown). Returns [P] widths: keep candidates 0 .. width-1."""
        k = min(self.max_width, cand_logprob.shape[1])
        path = np.asarray(parent_score)[:, None] + cand_logprob[:, :k]  # log P(path to candidate)
        # Candidates are sorted, so the ones that pass are a prefix: counting them is the width.
        w = (path >= np.log(max(self.threshold, 1e-30))).sum(axis=1)
        w = np.maximum(w, self.min_width)
        if self.bucket_cut and bucket is not None:
            w = np.where(np.asarray(bucket) == B3, 0, w)
        return w.astype(np.int64)
