"""Three-window sliding rollback (paper: serving-time adaptation's safety net).

The caller feeds one acceptance figure per closed window (tau, or accepted tokens per target
forward) and tells the policy when an update was swapped in. The mean of the ``n_windows`` windows
closed before the swap is the *baseline* (one window alone is too noisy to judge against). During the next ``n_windows`` windows (probation), after each one:

* if the mean over the probation windows so far is below ``baseline * (1 - tolerance)``, answer
  ``"rollback"``: restore the last good drafter. A clearly bad update is caught after one window,
  a marginal one by the sliding mean within three;
* after ``n_windows`` windows without that, answer ``"commit"``: the update becomes the last
  good drafter.

Otherwise the answer is ``"keep"``. Our choices where the paper says only "three-window sliding
rollback": the mean over the probation windows (not each window alone, which a noisy window
would trip) and a relative tolerance. A domain shift with no update in flight never rolls back:
there is nothing better to restore. Torch-free; subclass and override :meth:`decide`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass
class ThreeWindowRollback:
    n_windows: int = 3
    tolerance: float = 0.03
    history: deque = field(default_factory=lambda: deque(maxlen=64))
    baseline: float | None = None
    probation: list[float] | None = None  # None: no update on probation
    good_version: object = None  # what "rollback" means to restore
    rollbacks: int = 0
    commits: int = 0

    @property
    def in_probation(self) -> bool:
        return self.probation is not None

    def on_update(self, previous: object = None) -> None:
        """An update was swapped in; ``previous`` is the drafter it replaced.

        If an earlier update is still on probation, the baseline and the good version stay
        those from before it: restoring must never land on an unproven drafter.
        """
        if not self.in_probation:
            self.good_version = previous
            recent = list(self.history)[-self.n_windows:]
            self.baseline = float(np.mean(recent)) if recent else None
        self.probation = []

    def observe(self, value: float) -> str:
        """Close a window with acceptance ``value``; returns "keep", "rollback" or "commit"."""
        value = float(value)
        self.history.append(value)
        if not self.in_probation:
            return "keep"
        self.probation.append(value)
        decision = "commit" if self.baseline is None else self.decide(self.baseline, self.probation)
        if decision == "rollback":
            self.rollbacks += 1
            self.history[-1] = self.baseline  # the restored drafter is the baseline's
        if decision != "keep":
            self.commits += decision == "commit"
            self.probation = None
            self.baseline = None
        return decision

    def decide(self, baseline: float, probation: list[float]) -> str:
        if float(np.mean(probation)) < baseline * (1.0 - self.tolerance):
            return "rollback"
        if len(probation) >= self.n_windows:
            return "commit"
        return "keep"
