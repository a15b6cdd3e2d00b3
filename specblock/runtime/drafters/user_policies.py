"""A user's tree and seed policy classes for the runtime's drafters (``--policy``, ``--seed-policy``).

The names and kwargs come in the drafter options (CLI flags, the bench's ``--set
METHOD:policy=...``); the classes are built by :mod:`specblock.policies.loading`, the loader the
simulator's ``policy_class`` / ``seed_class`` use, so one spelling means one class in both.
"""

from __future__ import annotations

from specblock.errors import SpecBlockError
from specblock.policies import loading
from specblock.policies.branching import TreePolicy
from specblock.policies.seeds import SeedPolicy

#: Methods whose drafter takes a tree policy (--policy) and a seed policy (--seed-policy).
TAKES_POLICY = ("specblock", "eagle3", "sps", "falcon", "parallelspec")
TAKES_SEEDS = ("specblock", "eagle3", "sps", "falcon")


def user_policies(method: str, opt: dict) -> dict:
    """``{"policy": TreePolicy, "seeds": SeedPolicy}`` for what ``opt`` names (``policy``,
    ``seed_policy``; kwargs in ``policy_kwargs`` / ``seed_policy_kwargs``, a dict or a JSON
    object string); empty when it names none. A method without that slot is refused."""
    out = {}
    for key, arg, base, takes in (("policy", "policy", TreePolicy, TAKES_POLICY),
                                  ("seed_policy", "seeds", SeedPolicy, TAKES_SEEDS)):
        spec = opt.get(key)
        if not spec:
            continue
        flag = "--" + key.replace("_", "-")
        if method not in takes:
            raise SpecBlockError(f"{flag}: method {method} takes no {base.__name__}; use it with {', '.join(takes)}")
        out[arg] = loading.build(spec, opt.get(f"{key}_kwargs"), base, flag)
    return out
