"""External peers for the bench: HuggingFace transformers' own decoding, plain and speculative.

What a user would pick instead of this project, on the same target model object, prompts and
machine, timed like our engine (wall clock of the whole call, prefill included, over new token
ids):

- ``hf-assisted``: ``model.generate(..., assistant_model=<SpS draft model>)``: HF's assisted
  generation with the same small draft model our ``sps`` method serves (an ordinary HF model
  directory). HF's defaults are kept, since they are what a user gets: 20 assistant tokens, a
  constant schedule and the 0.4 confidence threshold (transformers 5.23); ``--set
  hf-assisted:num_assistant_tokens=N`` overrides the count. Without a draft model directory the
  method is skipped with a note (none is shipped today).
- ``hf-greedy``: ``model.generate(...)`` greedy, nothing drafted: HF's own decode loop on the same
  model object, weights and kernels as our ``ar`` (issue 16's baseline "HF generate's plain greedy",
  measured in the same run as the methods it is held against).
- ``hf-lookup``: ``model.generate(..., prompt_lookup_num_tokens=N, max_matching_ngram_size=M)``:
  HF's prompt-lookup decoding. N and M default to our ``lookup`` method's depth (8) and n-gram
  (3), so the pair compares implementations, not settings; ``--set hf-lookup:lookup_depth=10``
  and ``hf-lookup:ngram=2`` give HF's documented example settings.

Both decode greedily and stop at the target's EOS ids and ``max_new_tokens``, as the engine does.
Settings go to ``generate`` as keyword arguments, HF's highest priority: a ``GenerationConfig``
object would be merged with the checkpoint's ``generation_config.json`` (an unset EOS would come
back), and the logits processors such a file may ask for (repetition penalty, n-gram blocking) are
switched off, since our engine applies none. HF does not
report how many drafted tokens each target forward accepted nor how long drafting took, so tau,
T_D% and tree sizes are not observable: the bench reports them as null rather than inventing them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TextIO

import numpy as np
import torch
from transformers import PreTrainedModel

from specblock.errors import SpecBlockError
from specblock.runtime.engine import GenerationResult
from specblock.runtime.metrics import DecodeStats
from specblock.runtime.target import DTYPES, TargetModel, load_causal_lm

PEERS = ("hf-assisted", "hf-greedy", "hf-lookup")


class PeerUnavailable(SpecBlockError):
    """The peer cannot run here (e.g. no draft model): the bench skips it and says why."""


def is_peer(method: str) -> bool:
    return method.split("@")[0] in PEERS


class HFPeer:
    """Quacks like :class:`~specblock.runtime.engine.Engine` for the bench: ``generate`` returns a
    :class:`GenerationResult` whose stats hold only what HF lets us observe (tokens, wall time)."""

    def __init__(self, target: TargetModel, eos_ids: frozenset[int], assistant: PreTrainedModel | None = None,
                 lookup_tokens: int | None = None, ngram: int | None = None) -> None:
        if assistant is not None and lookup_tokens is not None:
            raise SpecBlockError("an HF peer takes an assistant model or prompt-lookup settings, not both")
        self.target, self.eos_ids = target, eos_ids
        self.assistant, self.lookup_tokens, self.ngram = assistant, lookup_tokens, ngram
        self.trace: TextIO | None = None  # the bench sets these on every engine; HF gives no per-iteration data
        self.trace_domain: str | None = None
        pad = getattr(target.config, "pad_token_id", None)
        eos = sorted(eos_ids) or None
        self.gen_kwargs = dict(
            do_sample=False, num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0, eos_token_id=eos,
            pad_token_id=pad if pad is not None else (eos[0] if eos else 0),
            prompt_lookup_num_tokens=lookup_tokens, max_matching_ngram_size=ngram,
        )

    def _now(self) -> float:
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)
        return time.perf_counter()

    @torch.no_grad()
    def generate(self, prompt_ids: list[int] | np.ndarray, max_new_tokens: int, seed: int = 0, on_tokens=None) -> GenerationResult:
        prompt = torch.as_tensor(np.asarray(prompt_ids, dtype=np.int64), device=self.target.device)[None]
        if prompt.shape[1] == 0:
            raise SpecBlockError("the prompt is empty; give at least one token")
        extra = {} if self.assistant is None else {"assistant_model": self.assistant}
        t0 = self._now()
        out = self.target.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                                         **self.gen_kwargs, **extra)
        t1 = self._now()
        new = out[0, prompt.shape[1]:].tolist()
        stats = DecodeStats(new_tokens=len(new), loop_s=t1 - t0, wall_s=t1 - t0)
        if on_tokens is not None and new:
            on_tokens(new)
        stopped = "eos" if new and new[-1] in self.eos_ids else "max_new_tokens"
        return GenerationResult(token_ids=new, stats=stats, stopped=stopped)


def _assistant_dir(opt: dict, target: TargetModel) -> Path | None:
    """The SpS draft model: ``drafter`` as given (``--set hf-assisted:drafter=DIR`` or
    ``--drafter-dir``/hf-assisted), then ``sps`` beside it, then the one shipped for this target."""
    from specblock.models import drafters_dir

    given = opt.get("drafter")
    tries = [Path(given), Path(given).parent / "sps"] if given else []
    tries.append(drafters_dir(Path(target.model.name_or_path or ".")) / "sps")
    return next((p for p in tries if (p / "config.json").is_file()), None)


def build(method: str, target: TargetModel, opt: dict, eos_ids: frozenset[int]) -> HFPeer:
    """The peer named ``method``; raises :class:`PeerUnavailable` when it cannot run."""
    name = method.split("@")[0]
    if name == "hf-greedy":
        return HFPeer(target, eos_ids)
    if name == "hf-lookup":
        return HFPeer(target, eos_ids, lookup_tokens=int(opt.get("lookup_depth") or 8), ngram=int(opt.get("ngram") or 3))
    if name != "hf-assisted":
        raise SpecBlockError(f"unknown peer {method!r}; choose one of {', '.join(PEERS)}")
    path = _assistant_dir(opt, target)
    if path is None:
        raise PeerUnavailable(
            "hf-assisted skipped: no SpS draft model (none is shipped); train one with "
            "`python -m specblock.training drafter --method sps --out DIR` and pass --set hf-assisted:drafter=DIR")
    dtype = {v: k for k, v in DTYPES.items()}[target.dtype]
    draft = load_causal_lm(path, dtype, str(target.device), "sdpa", False).eval()
    if int(draft.config.vocab_size) != target.vocab_size:
        raise PeerUnavailable(f"hf-assisted skipped: the draft model at {path} has vocab {draft.config.vocab_size}, "
                              f"the target {target.vocab_size}")
    if opt.get("num_assistant_tokens"):
        draft.generation_config.num_assistant_tokens = int(opt["num_assistant_tokens"])
    return HFPeer(target, eos_ids, assistant=draft)
