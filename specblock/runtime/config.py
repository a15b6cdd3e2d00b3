"""The CLI's configuration: validated once at the boundary, plain values inside."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from specblock.errors import SpecBlockError
from specblock.flags import bad_text
from specblock.models import DEFAULT_TARGET_NAME, MODELS, resolve_target
from specblock.models.registry import measured_here, recorded_method
from specblock.runtime.chat import parse_messages

#: The lab model and its drafters (the fast fixture); the default target is a name in
#: specblock.models (the real chat model), resolved by ``RunConfig.target_dir``.
ASSETS = Path(__file__).resolve().parents[1] / "assets"
DEFAULT_TARGET = MODELS["lab"].shipped
DEFAULT_DRAFTERS = MODELS["lab"].drafters


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: str | None = None  # a name in specblock.models (default: the real chat model) or a directory
    method: str = "auto"  # the target's fastest method by measurement (models.registry.best_method)
    prompt: str | None = None
    system: str | None = None  # a system message before --prompt (chat templates only)
    raw: bool = False  # send --prompt as is, without the chat template
    prompt_file: Path | None = None
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int = Field(0, ge=0, lt=2**63)  # numpy and torch generators take 0 .. 2^63 - 1
    json_out: bool = False
    compare: Literal["ar"] | None = None
    dtype: Literal["auto", "bfloat16", "float32", "packed-fp16", "packed-q4", "packed-q4-amx", "q4"] = "auto"  # auto: runtime.target.resolve_dtype, at load
    device: Literal["auto", "cpu", "cuda"] = "auto"
    attn: Literal["sdpa", "eager"] = "sdpa"
    budget: int | None = Field(None, ge=0, le=256)  # None: the drafter's serving.json, else 24
    trace: Path | None = None
    trust_remote_code: bool = False
    ngram: int = Field(3, ge=1)
    min_ngram: int = Field(1, ge=1)  # lookup: the shortest n-gram that may propose
    lookup_depth: int = Field(8, ge=1)
    branches: int = Field(1, ge=1)
    warmup: bool = True
    compile: bool = False  # static shapes + torch.compile per tree bucket (specblock/compiled)
    compile_mode: Literal["regions", "whole"] = "whole"  # one shared layer step, or the whole forward
    drafter: Path | None = None
    # None: the drafter's measured best (serving.json beside it), else the drafter's own default
    M: int | None = Field(None, ge=1, le=8)
    max_seeds: int | None = Field(None, ge=1, le=16)
    widths: tuple[int, int, int, int] | None = None
    adapt: bool = False  # serving-time adaptation of the SpecBlock drafter (runtime/adapt.py)
    # prompt lookup's chain of up to N tokens grafted onto the drafter's tree (drafters/lookup_branch.py)
    lookup_branch: int | None = Field(None, ge=1, le=64)
    # with it and --budget: the budget stays the drafter's own and the chain comes on top, instead of
    # the whole tree's and shared (a measured budget always stays the drafter's own)
    lookup_on_top: bool = False
    # with it: where the prompt has no match, the chain from a datastore of the target's own answers,
    # "shipped" or a path (drafters/datastore.py)
    lookup_datastore: str | None = Field(None, min_length=1)
    # the drafter's step stays eager where its serving.json names drafter_compiled, or --compile would compile it
    eager_drafter: bool = False
    adapt_window: int = Field(128, ge=2)  # decoding iterations per adaptation window
    adapt_lambda: float = Field(0.1, ge=0.0, allow_inf_nan=False)  # weight of the KL anchor to the pretrained drafter
    adapt_arms: tuple[str, ...] = ("skip", "heads", "full")  # one arm: always play it
    # bf16 autocast of each update: auto = where bf16 products are native (CUDA, AMX / AVX512-BF16)
    adapt_amp: Literal["auto", "bf16", "off"] = "auto"
    adapt_lr_heads: float = Field(1e-4, gt=0.0, allow_inf_nan=False)  # Adam's learning rate in a heads update
    adapt_lr_full: float = Field(1e-5, gt=0.0, allow_inf_nan=False)  # in a full update
    # A user's classes, "package.module:Class" or "path/file.py:Class" (specblock.policies.loading,
    # the simulator's loader too); kwargs are JSON objects. Loading one runs its module's code.
    policy: str | None = None  # TreePolicy subclass: widths per parent (replaces --widths)
    policy_kwargs: dict = Field(default_factory=dict)
    seed_policy: str | None = None  # SeedPolicy subclass: which nodes start the next block
    seed_policy_kwargs: dict = Field(default_factory=dict)
    adapt_policy: str | None = None  # CostAwareBandit subclass: the adaptation arm per window
    adapt_policy_kwargs: dict = Field(default_factory=dict)
    rollback_policy: str | None = None  # ThreeWindowRollback subclass: keep / rollback / commit
    rollback_policy_kwargs: dict = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_prompt_source(self) -> "RunConfig":
        if self.prompt is not None and self.prompt_file is not None:
            raise ValueError("give either --prompt or --prompt-file, not both")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("the prompt is empty; give some text with --prompt")
        if self.min_ngram > self.ngram:
            raise ValueError(f"--min-ngram {self.min_ngram} is above --ngram {self.ngram}; give at most --ngram")
        return self

    @field_validator("prompt", "system")
    @classmethod
    def _utf8(cls, text: str | None) -> str | None:
        if text is not None and (why := bad_text(text)):
            raise ValueError(why)
        return text

    @model_validator(mode="after")
    def _resolve_method(self) -> "RunConfig":
        if self.method == "auto":
            # The fastest method of the target's measured main table (best.json beside its drafters,
            # experiments/best_method.py), else lookup. The lab has no record: lookup measured 1.51x
            # there against SpecBlock's 1.22x (bench_main.md). A record of another dtype does not count.
            # At q4 plain decoding measured fastest, eager (Medusa tied at 1.00x) and compiled (ar@c 1.66x
            # against medusa@c's 1.57x, every method matching it; bench_smollm2_compiled_q4_fp32.md). On torch's
            # kernel (no AVX512) it is also the one method that is exactly the q4 model's greedy decoding.
            # A record measured on this kind of CPU (tune's, best.json's overrides) comes first, at q4 too.
            # A record "METHOD+lookup" (the table's row with prompt lookup's branch) runs METHOD with
            # --lookup-branch at its default length, unless the user gave one.
            from specblock.runtime.drafters.lookup_branch import DEFAULT_NODES, SUFFIX
            from specblock.runtime.q4 import Q4
            from specblock.runtime.target import resolve_dtype

            dtype = resolve_dtype(self.dtype, self.device, self.target if self.target is not None else DEFAULT_TARGET_NAME)
            method = (measured_here(self.target, dtype, self.compile)  # on this kind of CPU, q4 included
                      or ("ar" if dtype == Q4 else recorded_method(self.target, dtype, self.compile)))
            self.method = method.removesuffix(SUFFIX)
            if self.method != method and self.lookup_branch is None:
                self.lookup_branch = DEFAULT_NODES
        return self

    @field_validator("adapt_arms")
    @classmethod
    def _arms(cls, arms: tuple[str, ...]) -> tuple[str, ...]:
        bad = [a for a in arms if a not in ("skip", "heads", "full")]
        if bad or not arms or len(set(arms)) != len(arms):
            raise ValueError("give distinct arms among skip, heads, full, e.g. skip,heads,full")
        return arms

    @model_validator(mode="after")
    def _adapt_needs_specblock(self) -> "RunConfig":
        if self.adapt and self.method != "specblock":
            raise ValueError("--adapt adapts the SpecBlock drafter; use it with --method specblock")
        if self.lookup_on_top and not self.lookup_branch:
            raise ValueError("--lookup-on-top places prompt lookup's branch; give --lookup-branch N with it")
        if self.lookup_datastore and not self.lookup_branch:
            raise ValueError("--lookup-datastore feeds prompt lookup's branch; give --lookup-branch N with it")
        return self

    @model_validator(mode="after")
    def _user_policies(self) -> "RunConfig":
        """Load and build every named class now, so a bad name fails before any model loads."""
        for name in ("policy", "seed_policy", "adapt_policy", "rollback_policy"):
            if getattr(self, f"{name}_kwargs") and not getattr(self, name):
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag}-kwargs without {flag}: name the class they are for")
        if (self.adapt_policy or self.rollback_policy) and not self.adapt:
            raise ValueError("--adapt-policy / --rollback-policy replace parts of --adapt; add --adapt")
        if self.policy or self.seed_policy:
            from specblock.runtime.drafters.user_policies import user_policies

            user_policies(self.method, self.policy_options())
        if self.adapt_policy or self.rollback_policy:
            from specblock.runtime.adapt import AdaptSettings, adaptation_policies

            adaptation_policies(AdaptSettings(**self.adapt_settings()))
        return self

    def policy_options(self) -> dict:
        return {"policy": self.policy, "policy_kwargs": self.policy_kwargs,
                "seed_policy": self.seed_policy, "seed_policy_kwargs": self.seed_policy_kwargs}

    def adapt_settings(self) -> dict:
        return {"window": self.adapt_window, "lam": self.adapt_lambda, "arms": self.adapt_arms, "seed": self.seed,
                "amp": self.adapt_amp, "lr_heads": self.adapt_lr_heads, "lr_full": self.adapt_lr_full,
                "bandit_class": self.adapt_policy, "bandit_kwargs": self.adapt_policy_kwargs,
                "rollback_class": self.rollback_policy, "rollback_kwargs": self.rollback_policy_kwargs}

    @property
    def target_dir(self) -> Path:
        """The model directory: a name is built on first use (specblock.models)."""
        return resolve_target(self.target)

    def drafter_options(self) -> dict:
        return {
            "ngram": self.ngram, "min_ngram": self.min_ngram, "lookup_depth": self.lookup_depth, "branches": self.branches, "seed": self.seed,
            "drafter": self.drafter, "M": self.M, "max_seeds": self.max_seeds, "widths": self.widths, "budget": self.budget,
            **self.policy_options(),
        }


def validate(values: dict) -> RunConfig:
    """Build a RunConfig or raise a one-line SpecBlockError naming the flag to fix."""
    try:
        return RunConfig(**values)
    except ValidationError as e:
        err = e.errors()[0]
        flag = "--" + "-".join(str(p) for p in err["loc"]).replace("_", "-") if err["loc"] else "config"
        flag = flag.replace("--json-out", "--json")
        msg = err["msg"].removeprefix("Value error, ")
        raise SpecBlockError(f"{flag}: {msg}" if err["loc"] else msg) from None


def read_prompt_file(path: Path) -> list[dict]:
    """JSONL, one object per line with a ``prompt`` or OpenAI-style ``messages`` (and optionally
    ``domain``, ``id``); messages are checked here and kept as a tuple under ``messages``."""
    if not path.is_file():
        raise SpecBlockError(f"no prompt file at {path}")
    rows = []
    for i, raw in enumerate(path.read_bytes().splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SpecBlockError(f"{path}:{i}: byte {e.start + 1} is not UTF-8; save the file as UTF-8") from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise SpecBlockError(f"{path}:{i}: not valid JSON; each line must be an object with a 'prompt'") from None
        if isinstance(obj, dict) and "messages" in obj:
            obj["messages"] = parse_messages(obj["messages"], f"{path}:{i}")
        elif not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
            raise SpecBlockError(f"{path}:{i}: each line needs a non-empty string 'prompt' or a 'messages' list")
        if why := bad_text(obj):
            raise SpecBlockError(f"{path}:{i}: {why}")
        rows.append(obj)
    if not rows:
        raise SpecBlockError(f"{path} holds no prompts")
    return rows
