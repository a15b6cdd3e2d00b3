"""``python -m specblock.training chatgen``: a chat target's own greedy answers, for drafter training.

A drafter serves on the target's own output, so it should learn from that output (the public
EAGLE recipes regenerate every answer with the target: self-distillation). This asks the target,
through its chat template (``runtime/chat.py``, the same encoding the bench uses), the training
instructions of ``../shared/data`` and keeps its greedy answers as token ids:

- ``math``: GSM8K *train* questions;
- ``chat``: AlpacaEval instructions 0-699 (``train.jsonl`` repeats each for 11 models: deduplicated);
- ``code``: functions of the Python standard library cut after their docstring, framed like the
  bench's code prompts (:func:`code_prompt`);
- ``prose``: excerpts of the first 90% of tinyshakespeare behind ``"Continue this passage:"``.

Never the evaluation prompts (HumanEval, GSM8K test, AlpacaEval ``eval_prompts.jsonl``,
Spec-Bench). The domains are interleaved by fixed weights, so any prefix of shards is a mix and a
run stopped early still covers every domain. Shard 0 is the held-out shard by convention.
``--instructions FILE`` answers another list instead (selfask's, written by the target itself) into
``ask_NNNNN`` shards, none held out, so one feature cache can hold both directories.

Output: ``DIR/shard_NNNNN.jsonl`` (one ``{"id", "domain", "prompt_ids", "answer_ids", "stopped"}``
per line; answers end with the stop token when the target stopped) and ``DIR/manifest.json``
(token counts, seconds and sha256 per shard, totals). Resumable: written shards are skipped, each
shard is written to a temp file then renamed, and a directory made with other settings is refused.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import random
import re
import sysconfig
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from specblock.errors import SpecBlockError
from specblock.training.corpus import data_file, is_heldout, stdlib_files
from specblock.training.featcache import REF_PREFIX

#: Share of instructions per domain while every domain lasts. The bench's chat-like domains (chat,
#: qa, mtbench) weigh most, then math and code; prose is for general English only.
MIX: dict[str, float] = {"chat": 0.30, "math": 0.30, "code": 0.28, "prose": 0.12}
HELDOUT_SHARDS = (0,)


def code_prompt(code: str) -> str:
    """The bench's code framing (one user message): a signature and docstring to complete."""
    return f"Complete the following Python function.\n\n```python\n{code}```"


def prose_prompt(excerpt: str) -> str:
    return f"Continue this passage:\n\n{excerpt}"


@dataclass(frozen=True)
class Instruction:
    id: str
    domain: str
    text: str  # one user message


def read_jsonl(*parts: str) -> list[dict]:
    with open(data_file(*parts), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def math_instructions() -> list[Instruction]:
    return [Instruction(f"gsm8k/train/{i}", "math", r["question"].strip())
            for i, r in enumerate(read_jsonl("gsm8k", "train.jsonl"))]


def chat_instructions() -> list[Instruction]:
    seen: dict[int, str] = {}
    for r in read_jsonl("alpaca_eval", "train.jsonl"):
        if int(r["id"]) < 700:
            seen.setdefault(int(r["id"]), r["instruction"].strip())
    return [Instruction(f"alpaca_eval/{i}", "chat", seen[i]) for i in sorted(seen)]


def documented_functions(source: str, per_file: int) -> list[tuple[str, str, str]]:
    """Public functions and methods with a docstring: name, the head cut right after the docstring
    (HumanEval's shape) and the whole function (a method is dedented out of its class)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    out = []
    nodes = [(top.name + ".", n) if isinstance(top, ast.ClassDef) else ("", n)
             for top in tree.body for n in (top.body if isinstance(top, ast.ClassDef) else [top])]
    for owner, node in nodes:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.decorator_list:
            continue
        doc = node.body[0] if node.body else None
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            continue
        if len(node.body) < 2:  # a docstring and nothing else: nothing to complete
            continue
        code = textwrap.dedent("".join(lines[node.lineno - 1:doc.end_lineno]))
        if 40 <= len(code) <= 1500:
            whole = textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno]))
            out.append((owner + node.name, code, whole))
        if len(out) >= per_file:
            break
    return out


def training_functions(per_file: int = 12) -> list[tuple[str, str, str]]:
    """``(id, head, whole function)`` of every documented stdlib function outside the code
    domain's held-out files: the code prompts (chatgen) and their reference answers (refanswers)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in stdlib_files():
        rel = path.relative_to(root).as_posix()
        if is_heldout("code", rel):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out += [(f"stdlib/{rel}:{name}", head, whole) for name, head, whole in documented_functions(text, per_file)]
    return out


def code_instructions(per_file: int = 12) -> list[Instruction]:
    return [Instruction(key, "code", code_prompt(head)) for key, head, _ in training_functions(per_file)]


def prose_instructions(chars: int = 600) -> list[Instruction]:
    """Excerpts cut at blank lines from the first 90% of the text (the corpus' training part)."""
    text = data_file("tinyshakespeare", "input.txt").read_text(encoding="utf-8")
    part = text[:text.find("\n\n", int(len(text) * 0.9))]
    out, start = [], 0
    while start < len(part):
        end = part.find("\n\n", start + chars)
        end = len(part) if end < 0 else end
        chunk = part[start:end].strip("\n")
        if len(chunk) >= chars // 2:
            out.append(Instruction(f"shakespeare/{start}", "prose", prose_prompt(chunk)))
        start = end + 2
    return out


def all_instructions(seed: int = 0) -> list[Instruction]:
    """Every domain shuffled (seeded), then interleaved by :data:`MIX` until each runs out."""
    pools = {"chat": chat_instructions(), "math": math_instructions(), "code": code_instructions(),
             "prose": prose_instructions()}
    rng = random.Random(seed)
    for items in pools.values():
        rng.shuffle(items)
    credit = dict.fromkeys(pools, 0.0)
    out: list[Instruction] = []
    while any(pools.values()):
        live = {d: w for d, w in MIX.items() if pools[d]}
        total = sum(live.values())
        for d, w in live.items():
            credit[d] += w / total
        d = max(live, key=lambda k: credit[k])
        credit[d] -= 1.0
        out.append(pools[d].pop())
    return out


# --------------------------------------------------------------------------- generation
def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def generate_batch(model, prompts: list[list[int]], max_new: int, stops: frozenset[int], pad: int,
                   temperature: float = 0.0, top_k: int = 0, generator=None) -> list[tuple[list[int], bool]]:
    """Greedy answers for a batch of prompts (left-padded), each cut after its first stop token.
    ``temperature > 0`` samples instead (top-k where ``top_k > 0``, from ``generator``): selfask's
    instructions; every answer chatgen stores is greedy.

    A plain loop rather than HF ``generate``: a row that has stopped leaves the batch and its KV
    cache (``generate`` kept computing it until the longest answer ended: 1.41x the answer tokens
    over the first 16 shards), and the prefill computes the LM head for the last position only."""
    import torch
    from transformers import DynamicCache

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    answers: list[list[int]] = [[] for _ in prompts]
    alive = list(range(len(prompts)))  # batch row -> prompt index
    cache = DynamicCache(config=model.config)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def pick(logits):
        if temperature <= 0:
            return logits.argmax(-1)
        logits = logits.float() / temperature
        if top_k > 0:
            kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]

    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1]
        for step in range(max_new):
            nxt = pick(logits)
            keep = []
            for row, tok in enumerate(nxt.tolist()):
                answers[alive[row]].append(tok)
                if tok not in stops:
                    keep.append(row)
            if not keep or step == max_new - 1:
                break
            if len(keep) < len(alive):
                idx = torch.tensor(keep)
                cache.batch_select_indices(idx)
                mask, nxt = mask[idx], nxt[idx]
                alive = [alive[r] for r in keep]
            mask = torch.cat([mask, mask.new_ones(len(alive), 1)], dim=1)
            logits = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                           past_key_values=cache, use_cache=True).logits[:, -1]
    return [(a, a[-1] in stops) for a in answers]


def run_shard(model, tok, items: list[Instruction], args, stops: frozenset[int], pad: int) -> list[dict]:
    from specblock.runtime.chat import ChatRequest, encode

    enc = [(it, encode(tok, ChatRequest(prompt=it.text))) for it in items]
    enc = [(it, ids) for it, ids in enc if len(ids) <= args.max_prompt_tokens]
    enc.sort(key=lambda x: len(x[1]))  # similar lengths per batch: less padding
    rows = []
    for i in range(0, len(enc), args.batch):
        part = enc[i:i + args.batch]
        for (it, ids), (ans, stopped) in zip(part, generate_batch(model, [p for _, p in part], args.max_new_tokens, stops, pad)):
            rows.append({"id": it.id, "domain": it.domain, "prompt_ids": ids, "answer_ids": ans, "stopped": stopped})
    return rows


def _settings(args) -> dict:
    out = {"seed": args.seed, "shard_size": args.shard_size, "max_new_tokens": args.max_new_tokens,
           "max_prompt_tokens": args.max_prompt_tokens}
    if args.instructions is not None:  # the file's hash: a directory answers one list of instructions
        out["instructions_sha256"] = _sha256(args.instructions)
    return out


def read_instructions(path: Path) -> list[Instruction]:
    """A jsonl of ``{"id", "domain", "text"}`` (selfask's output), in file order."""
    try:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        items = [Instruction(str(r["id"]), str(r["domain"]), str(r["text"])) for r in rows]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SpecBlockError(f"--instructions {path}: not a jsonl of {{id, domain, text}} rows ({e})") from None
    if not items:
        raise SpecBlockError(f"--instructions {path} holds no instruction")
    return items


def open_manifest(out: Path, target_dir: Path, settings: dict, heldout: tuple[int, ...] = HELDOUT_SHARDS,
                  prefix: str = "shard_") -> dict:
    from specblock.training.featcache import target_identity

    ident = target_identity(target_dir)
    path = out / "manifest.json"
    if path.is_file():
        man = json.loads(path.read_text())
        if man.get("target_sha256") != ident["weights_sha256"]:
            raise SpecBlockError(f"{out} holds answers of another target ({man.get('target')}); use another --out")
        if man.get("settings") != settings:
            raise SpecBlockError(f"{out} was generated with settings {man.get('settings')}; pass the same or use another --out")
        return man
    return {"kind": "specblock-chatgen", "target": ident["name"], "target_sha256": ident["weights_sha256"],
            "settings": settings, "heldout_shards": list(heldout), "shard_prefix": prefix, "shards": {}}


def summarize(man: dict) -> dict:
    sh = man["shards"].values()
    secs = sum(s["seconds"] for s in sh)
    ans = sum(s["answer_tokens"] for s in sh)
    return {"sequences": sum(s["sequences"] for s in sh), "prompt_tokens": sum(s["prompt_tokens"] for s in sh),
            "answer_tokens": ans, "minutes": round(secs / 60, 2), "answer_tokens_per_s": round(ans / max(secs, 1e-9), 1)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m specblock.training chatgen", description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="a model name (smollm2-135m-instruct) or directory")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shard-size", type=int, default=64, help="instructions per shard")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped")
    ap.add_argument("--max-shards", type=int, default=None, help="stop after this many shards in total")
    ap.add_argument("--max-minutes", type=float, default=None, help="stop starting new shards after this long")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--instructions", type=Path, default=None,
                    help="answer this jsonl of {id, domain, text} (selfask) instead of the data set's instructions; "
                         "its shards are named ask_NNNNN (--shard-prefix), none held out")
    ap.add_argument("--shard-prefix", default=None,
                    help="with --instructions: the shards' name prefix (default ask_); one per list of instructions, "
                         "since a feature cache keys shards by name (e.g. ask1_ for selfask's seed 1)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.shard_size < 1 or args.batch < 1 or args.max_new_tokens < 1:
        raise SpecBlockError("--shard-size, --batch and --max-new-tokens must be positive")
    if args.shard_prefix is not None and (args.instructions is None or not re.fullmatch(r"[a-z][a-z0-9]*_", args.shard_prefix)
                                          or args.shard_prefix in ("shard_", REF_PREFIX)):
        raise SpecBlockError(f"--shard-prefix {args.shard_prefix!r}: give it with --instructions, lowercase letters and "
                             f"digits ending in '_' (e.g. ask1_), other than shard_ and {REF_PREFIX}")
    import torch
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from specblock.models import resolve_target
    from specblock.runtime.chat import has_template, stop_ids
    from specblock.runtime.target import load_causal_lm

    target_dir = resolve_target(args.target)
    torch.set_num_threads(args.threads)
    if args.instructions is not None:  # its own shard names, so one feature cache holds both directories
        items, heldout, prefix = read_instructions(args.instructions), (), args.shard_prefix or "ask_"
    else:
        items, heldout, prefix = all_instructions(args.seed), HELDOUT_SHARDS, "shard_"
    args.out.mkdir(parents=True, exist_ok=True)
    man = open_manifest(args.out, target_dir, _settings(args), heldout, prefix)
    if man.get("shard_prefix", "shard_") != prefix:
        raise SpecBlockError(f"{args.out} holds {man.get('shard_prefix', 'shard_')}* shards; use another --out")
    if man.get("dtype", args.dtype) != args.dtype:  # answers of one run come from one dtype (they differ at near-ties)
        raise SpecBlockError(f"{args.out} holds answers generated in {man['dtype']}; pass --dtype {man['dtype']} or use another --out")
    man["dtype"] = args.dtype
    tok = AutoTokenizer.from_pretrained(target_dir)
    if not has_template(tok):
        raise SpecBlockError(f"{target_dir} has no chat template; chatgen asks chat models (use selfgen for base models)")
    model = load_causal_lm(target_dir, args.dtype, "cpu", "sdpa", False).eval()
    stops = stop_ids(tok, set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
                               else [model.generation_config.eos_token_id]))
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(stops)
    n_shards = -(-len(items) // args.shard_size)
    if args.max_shards is not None:
        n_shards = min(n_shards, args.max_shards)
    t_start = time.perf_counter()
    bar = tqdm(total=n_shards, desc="chatgen", dynamic_ncols=True)
    for i in range(n_shards):
        name = f"{prefix}{i:05d}"
        path = args.out / f"{name}.jsonl"
        if name in man["shards"] and path.is_file():
            bar.update(1)
            continue
        if args.max_minutes is not None and time.perf_counter() - t_start > 60 * args.max_minutes:
            break
        t0 = time.perf_counter()
        rows = run_shard(model, tok, items[i * args.shard_size:(i + 1) * args.shard_size], args, stops, pad)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, path)
        dt = time.perf_counter() - t0
        ans = sum(len(r["answer_ids"]) for r in rows)
        man["shards"][name] = {"sequences": len(rows), "prompt_tokens": sum(len(r["prompt_ids"]) for r in rows),
                               "answer_tokens": ans, "stopped": sum(r["stopped"] for r in rows),
                               "seconds": round(dt, 2), "sha256": _sha256(path), "threads": args.threads}
        man["totals"] = summarize(man)
        _write_json(args.out / "manifest.json", man)
        bar.set_postfix(tok_s=f"{ans / dt:.0f}", total=man["totals"]["answer_tokens"])
        bar.update(1)
    bar.close()
    print(json.dumps({"out": str(args.out), **man.get("totals", {})}), flush=True)
    return 0
