"""The bench's flags and its per-method ``--set METHOD:KEY=VALUE`` options, checked before
anything loads by the rules the decoding CLI applies: the shared fields *are* RunConfig's fields
(same bounds: ``M`` at most 8, ``ngram`` at least 1, a node budget in 0..256, ...), so the two
commands cannot drift apart. Unknown keys are refused by name instead of silently ignored.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from specblock.errors import SpecBlockError
from specblock.flags import check, one_line
from specblock.prompts import DOMAINS, TUNE_PROMPTS
from specblock.runtime.config import RunConfig
from specblock.runtime.drafters import TRAINED
from specblock.runtime.drafters.lookup_branch import SUFFIX as LOOKUP
from specblock.runtime.drafters.lookup_branch import has_lookup
from specblock.runtime.peers import is_peer

#: The settings of a ``specblock+adapt`` method's adaptation (refused on any other method).
ADAPT_KEYS = ("adapt_window", "adapt_amp", "adapt_lr_heads", "adapt_lr_full", "adapt_policy", "adapt_policy_kwargs",
              "rollback_policy", "rollback_policy_kwargs")
_SHARED = ("ngram", "min_ngram", "lookup_depth", "branches", "seed", "drafter", "M", "max_seeds", "widths", "budget",
           "policy", "policy_kwargs", "seed_policy", "seed_policy_kwargs", *ADAPT_KEYS)
_POSITIVE = (int | None, Field(None, ge=1))

#: What ``--set`` accepts: RunConfig's own fields, plus the drafters' serving knobs the decoding
#: CLI has no flag for (EAGLE-3's depth and top-k, SpS's gamma, Falcon's forwards and seeds, the
#: HF assisted peer's assistant tokens), and ``compiled`` (this method on the ``--compile`` target).
MethodOptions = create_model(
    "MethodOptions",
    __config__=ConfigDict(extra="forbid"),
    **{k: (RunConfig.model_fields[k].annotation, RunConfig.model_fields[k]) for k in _SHARED if k in RunConfig.model_fields},
    depth=_POSITIVE, top_k=_POSITIVE, gamma=_POSITIVE, forwards=_POSITIVE, falcon_seeds=_POSITIVE,
    num_assistant_tokens=_POSITIVE,
    lookup_nodes=_POSITIVE,  # METHOD+lookup: the most nodes prompt lookup's branch may take
    lookup_on_top=(bool | None, None),  # METHOD+lookup: the drafter keeps its budget, the chain on top
    # METHOD+lookup: where the prompt has no match, the chain from a datastore of the target's own
    # answers ("shipped" or a path)
    lookup_datastore=(str | None, None),
    # this method on the compiled target (specblock/compiled, one model shared with the eager one):
    # compiled against eager in one run, e.g. --methods ar,ar@c --set ar@c:compiled=true
    compiled=(bool | None, None),
    # SpecBlock's block forward compiled (compiled/drafter.py): by default with the target; true also
    # beside the eager target, false eager beside the compiled one (A/Bs in one run)
    drafter_compiled=(bool | None, None),
    # a trained drafter's linears beside a packed target: true on the int8 kernel where it runs,
    # false packed fp16; unset, drafters.wants_int8 decides (A/Bs in one run)
    drafter_int8=(bool | None, None),
    # an HF peer on the model loaded in another dtype (issue 16's baseline, HF's generate on the bf16
    # checkpoint, beside methods on --dtype q4): another model, so its outputs may part from ar's
    dtype=(RunConfig.model_fields["dtype"].annotation | None, None),
)


class BenchFlags(BaseModel):
    """The bench's own flags; the ones it shares with the decoding CLI take RunConfig's bounds."""

    model_config = ConfigDict(extra="ignore")

    methods: str
    domains: str
    prompts: int = Field(ge=1)
    runs: int = Field(ge=1)
    max_new_tokens: int = RunConfig.model_fields["max_new_tokens"]
    dtype: RunConfig.model_fields["dtype"].annotation
    budget: int | None = Field(None, ge=0, le=256)
    threads: int = Field(0, ge=0, le=1024)  # 0: torch's default
    drafter_dir: Path | None = None

    @field_validator("domains")
    @classmethod
    def _domains(cls, v: str) -> str:
        names = [d.strip() for d in v.split(",") if d.strip()]
        bad = [d for d in names if d not in DOMAINS]
        if bad or not names:
            raise ValueError(f"unknown domain {bad[0]!r}; choose among {','.join(DOMAINS)}" if bad else
                             f"name at least one domain among {','.join(DOMAINS)}")
        return v

    @field_validator("methods")
    @classmethod
    def _methods(cls, v: str) -> str:
        if not [m for m in v.split(",") if m.strip()]:
            raise ValueError("name at least one method")
        return v


def _value(key: str, text: str, item: str):
    """``--set`` values are strings; lists and JSON objects are split or parsed here, the rest
    is left to the field's type (pydantic turns "3" into 3 and refuses "a")."""
    if key == "widths":
        return [x.strip() for x in text.split(",")]
    if key.endswith("_kwargs"):
        try:
            return json.loads(text)
        except ValueError:
            raise SpecBlockError(f"--set {item}: {key} takes a JSON object, e.g. '{{\"threshold\": 0.2}}'") from None
    return text


def method_options(items: list[str], methods: list[str]) -> dict[str, dict]:
    """``--set`` items, checked, by method: only the keys given (defaults stay where they live)."""
    raw: dict[str, dict] = {}
    for item in items:
        m, colon, kv = item.partition(":")
        key, eq, text = kv.partition("=")
        m, key = m.strip(), key.strip()
        if not (colon and eq and m and key):
            raise SpecBlockError(f"--set {item!r}: write METHOD:KEY=VALUE, e.g. specblock:M=1")
        if m not in methods:
            raise SpecBlockError(f"--set {item}: {m} is not among --methods ({','.join(methods)})")
        raw.setdefault(m, {})[key] = _value(key, text.strip(), item)
    out = {}
    for m, opts in raw.items():
        try:
            out[m] = MethodOptions.model_validate(opts).model_dump(mode="json", exclude_unset=True)
        except ValidationError as e:
            known = ", ".join(MethodOptions.model_fields)
            msg = one_line(e, lambda k: f"--set {m}:{k}")
            raise SpecBlockError(msg + (f" (known: {known})" if "unknown option" in msg else "")) from None
        shortest, longest = out[m].get("min_ngram", 1), out[m].get("ngram", RunConfig.model_fields["ngram"].default)
        if shortest > longest:
            raise SpecBlockError(f"--set {m}:min_ngram={shortest} is above its ngram {longest}; give at most {longest}")
    return out


#: Methods whose drafter ``--compile`` puts on static shapes (``compiled.compile_drafter``; SpS: chains).
COMPILED_DRAFTERS = ("specblock", "eagle3", "medusa", "sps")


def check_bench_flags(args) -> dict[str, dict]:
    """Every bench flag and ``--set`` item, before the bench loads anything. Returns the checked
    per-method options."""
    check(BenchFlags, vars(args))
    if getattr(args, "split", "eval") == "tune" and args.prompts > TUNE_PROMPTS:
        raise SpecBlockError(f"--split tune holds {TUNE_PROMPTS} prompts per domain; pass --prompts {TUNE_PROMPTS} or fewer")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if "+adapt" in m and "+lookup" in m and not has_lookup(m):
            raise SpecBlockError(f"{m}: the branch goes last, e.g. specblock+adapt{LOOKUP}")
    opts = method_options(args.set, methods)
    for m, o in opts.items():
        for key in ("lookup_nodes", "lookup_on_top", "lookup_datastore"):
            if o.get(key) is not None and not has_lookup(m):
                raise SpecBlockError(f"--set {m}:{key} is for a METHOD{LOOKUP} method, e.g. eagle3{LOOKUP}")
        if "+adapt" not in m and (given := [k for k in ADAPT_KEYS if o.get(k) is not None]):
            raise SpecBlockError(f"--set {m}:{given[0]} sets adaptation; it is for specblock+adapt (or specblock+adapt@LABEL)")
        base = m.split("@")[0].removesuffix(LOOKUP)
        if o.get("drafter_compiled") is not None and base not in COMPILED_DRAFTERS:
            raise SpecBlockError(f"--set {m}:drafter_compiled: only {', '.join(COMPILED_DRAFTERS)} have a compiled drafter "
                                 "(an adapting one has not); use it on one of them or its +lookup")
        if o.get("drafter_int8") is not None and base.removesuffix("+adapt") not in TRAINED:
            raise SpecBlockError(f"--set {m}:drafter_int8: only a trained drafter ({', '.join(TRAINED)}) has linears "
                                 "to run on the int8 kernel; use it on one of them")
        if o.get("dtype") is not None and not is_peer(m):
            raise SpecBlockError(f"--set {m}:dtype: every method of a bench runs on --dtype; only an HF peer "
                                 "(hf-greedy, hf-lookup, hf-assisted) takes a model of its own, e.g. --set hf-greedy@bf16:dtype=bfloat16")
        if o.get("compiled") and is_peer(m):
            raise SpecBlockError(f"--set {m}:compiled: HF generate peers run HF's own loop; "
                                 "compiled=true is for this project's methods")
    return opts
