"""Prompt lookup's shortest n-gram (``--min-ngram``): a context whose last tokens recur only as a
shorter n-gram proposes nothing, so a target whose tree rows cost (q4's int8 kernel) verifies only
the surer drafts; a bad setting is one line naming the fix."""

import numpy as np
import pytest

from specblock.errors import SpecBlockError
from specblock.runtime.bench_config import method_options
from specblock.runtime.config import validate
from specblock.runtime.drafters import LookupDrafter, build
from specblock.runtime.drafters.base import DraftRequest

# ... 7 8 9 | 5 7 9 4 | 1 9: the last token (9) recurs alone; "1 9" never came before.
TOKENS = np.array([7, 8, 9, 5, 7, 9, 4, 1, 9], dtype=np.int64)


def request(tokens: np.ndarray, budget: int = 4) -> DraftRequest:
    return DraftRequest(tokens=tokens, budget=budget, max_depth=8)


@pytest.mark.parametrize("branches", [1, 2])
def test_a_shorter_match_than_min_ngram_proposes_nothing(branches):
    assert LookupDrafter(min_ngram=1, branches=branches).propose(request(TOKENS)).size > 1  # "9" -> 4 ...
    assert LookupDrafter(min_ngram=2, branches=branches).propose(request(TOKENS)).size == 1


@pytest.mark.parametrize("branches", [1, 2])
def test_a_match_as_long_as_min_ngram_still_proposes(branches):
    tokens = np.concatenate([TOKENS, [5, 7]])  # "5 7" came before, followed by 9 4 1 9
    tree = LookupDrafter(min_ngram=2, branches=branches).propose(request(tokens))
    assert tree.tokens[1:].tolist()[:2] == [9, 4]


def test_the_registry_passes_it():
    drafter = build("lookup", None, {"ngram": 3, "min_ngram": 2})
    assert (drafter.max_ngram, drafter.min_ngram) == (3, 2)


def test_above_ngram_is_one_line_naming_the_fix():
    with pytest.raises(SpecBlockError, match="--min-ngram 4 is above --ngram 3"):
        validate({"method": "lookup", "min_ngram": 4})
    with pytest.raises(SpecBlockError, match="min_ngram=3 is above its ngram 2"):
        method_options(["lookup@x:ngram=2", "lookup@x:min_ngram=3"], ["lookup@x"])
    assert method_options(["lookup@x:min_ngram=2"], ["lookup@x"]) == {"lookup@x": {"min_ngram": 2}}
