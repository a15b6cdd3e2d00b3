"""Why served tau sits below held-out acceptance (issue 14): the drafters on the bench's own text.

Held-out acceptance (``heldout_compare.py``) is measured on 257-token windows of the target's
own answers to *training* instructions, every position counted: prompt tokens, chat-template
tokens and long, often repetitive answer tails. The bench decodes the first 48 tokens of answers
to *evaluation* prompts. This script measures the same chain acceptance on the bench's text: the
target's greedy answer to each bench prompt (plain decoding, fp32), the drafter teacher-forced
over prompt + answer exactly as in training, and only chains whose root is an answer position
counted (the roots serving drafts from). A position whose target token has no row in the draft
vocabulary counts as a miss, as it does when serving (held-out drops such roots for SpecBlock).

If these figures match the served tau of chain-shaped trees on the same prompts (a bench with
``specblock@chain`` = M 1, widths 1,1,1,1 and ``eagle3@chain`` = top_k 1), the serving path
loses nothing and the gap is the text; if they sit clearly above, serving does.

    python experiments/served_gap.py --drafter specblock=specblock:specblock/assets/drafters/smollm2-135m-instruct/specblock \
        --drafter eagle3=eagle3:specblock/assets/drafters/smollm2-135m-instruct/eagle3 --prompts 3 \
        --out experiments/results/served_gap_smollm2

``--lookup`` adds prompt lookup's chain (its first match, as ``lookup`` serves it) and, for each
drafter, the two chains side by side (``NAME+lookup``: a tree of two branches accepts the longer
of the two; up to twice the nodes). How much a lookup branch could add to a drafter's tree on the
bench's text, before anyone builds one. ``--datastore shipped`` adds the same with lookup's chain
taken from the target's own answers where the prompt has no match (``--lookup-datastore``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: heldout_compare is a sibling

from heldout_compare import parse  # noqa: E402
from vocab_sweep import load  # noqa: E402

from specblock.atomic import write_atomic  # noqa: E402
from specblock.errors import SpecBlockError  # noqa: E402
from specblock.models import resolve_target  # noqa: E402
from specblock.prompts import DOMAINS, load_prompts  # noqa: E402
from specblock.runtime import chat  # noqa: E402
from specblock.runtime.cli import load_tokenizer  # noqa: E402
from specblock.runtime.drafters.base import DraftRequest  # noqa: E402
from specblock.runtime.drafters.datastore import Datastore, open_datastore  # noqa: E402
from specblock.runtime.drafters.lookup import LookupDrafter  # noqa: E402
from specblock.runtime.target import load_causal_lm, read_generation_eos  # noqa: E402
from specblock.training.specblock_step import target_pass  # noqa: E402

DEPTH = 4  # positions per chain reported (SpecBlock's K; EAGLE-3 runs as many TTT depths)
CHAINS = ("specblock", "eagle3")  # the drafters whose top-1 chain is measured here


@torch.no_grad()
def greedy_answer(model, ids: list[int], n: int, eos: list[int]) -> list[int]:
    """The target's own greedy continuation (HF generate, fp32): what every method of the bench must reproduce."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                         pad_token_id=eos[0])
    return out[0, len(ids):].tolist()


def texts(a: argparse.Namespace, domain: str, model, tok, eos: list[int]):
    """(prompt ids, answer ids) of one domain: the bench's prompts answered now, or a chatgen shard's."""
    if a.chatgen is None:
        for p in load_prompts(domain, a.prompts, split=a.split):
            ids = chat.encode_prompt(tok, p)
            yield ids, greedy_answer(model, ids, a.max_new_tokens, eos)
        return
    if not a.chatgen.is_file():
        raise SpecBlockError(f"--chatgen {a.chatgen}: no such shard (chatgen writes shard_NNNNN.jsonl)")
    rows = [json.loads(line) for line in a.chatgen.read_text().splitlines() if line.strip()]
    for r in [r for r in rows if r["domain"] == domain][: a.prompts]:
        yield r["prompt_ids"], r["answer_ids"][: a.max_new_tokens]


def chain_hits(method: str, net, tp) -> torch.Tensor:
    """``[R, DEPTH]`` bool: the chain whose last known token is x_R is right at depths 1..d (R = 1..W-1).

    Right = the drafter's top-1 equals the target's argmax given the true prefix; a token outside
    the draft vocabulary is never right (``y_ok``), as when serving."""
    w = tp.tokens.shape[1]
    if method == "specblock":
        from specblock.training.specblock_step import specblock_step

        # block 1 as training scores it: row p (last known token x_{p+1}) reaches depth k and is right
        # there; a depth past the window or a target without a head row is off in its mask
        b1 = specblock_step(net, tp, torch.Generator().manual_seed(0), 1.0, cross_block=False).blocks[0]
        ok = (b1.mask * b1.top1)[0, :, :DEPTH].bool()
    elif method == "eagle3":
        from specblock.training.eagle3_step import eagle3_step

        res = eagle3_step(net, tp, DEPTH)  # depth d row p = R-2+d predicts x_{R+d}
        r = torch.arange(1, w)  # R: the last known token's index
        ok = torch.zeros(w - 1, DEPTH, dtype=torch.bool)
        for d in range(1, DEPTH + 1):
            rows = r - 2 + d
            inside = (rows >= 0) & (rows < w - 1)
            ok[inside, d - 1] = res.top1[d - 1][0, rows[inside]]
    else:
        raise SpecBlockError(f"{method!r} has no chain here; use {' or '.join(CHAINS)}")
    return ok.cumprod(-1).bool()  # right at every depth up to d


def lookup_hits(seq: np.ndarray, lookup: LookupDrafter | None = None, store: Datastore | None = None) -> torch.Tensor:
    """``[W-1, DEPTH]`` bool, rows as in ``chain_hits`` (row R-1: root R): prompt lookup's chain
    proposed from ``seq[:R+1]`` is right at every depth up to d (a depth past the sequence: a miss).
    With ``store``, where lookup finds nothing the chain is the store's, as the branch serves it."""
    lookup = lookup or LookupDrafter(branches=1)
    seq = np.asarray(seq, dtype=np.int64)
    w = len(seq)
    ok = torch.zeros(w - 1, DEPTH, dtype=torch.bool)
    for r in range(1, w - 1):
        tree = lookup.propose(DraftRequest(seq[: r + 1], budget=DEPTH, max_depth=DEPTH))
        guess = tree.tokens[1:]  # one branch: a chain, in depth order
        if not guess.size and store is not None:
            guess = store.chain(seq[: r + 1], DEPTH)
        n = min(len(guess), w - 1 - r)
        ok[r - 1, :n] = torch.from_numpy(guess[:n] == seq[r + 1 : r + 1 + n])
    return ok.cumprod(-1).bool()


def load_chains(target: str, drafters: list[str]):
    """The target at fp32, its tokenizer and stop ids, and each ``--drafter NAME=METHOD:PATH`` as
    ``{name: (method, net)}``; a method without a chain here is refused (``SpecBlockError``)."""
    specs = [parse(s) for s in drafters]
    for name, method, _ in specs:
        if method not in CHAINS:
            raise SpecBlockError(f"--drafter {name}: {method!r} has no chain here; use {' or '.join(CHAINS)}")
    target_dir = resolve_target(target)
    model = load_causal_lm(target_dir, "float32", "cpu", "sdpa", False).eval()
    tok = load_tokenizer(target_dir, False)
    eos = sorted(chat.stop_ids(tok, read_generation_eos(target_dir)))
    return model, tok, eos, {name: (method, load(method, path, model).eval()) for name, method, path in specs}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", action="append", required=True, metavar="NAME=METHOD:DIR")
    ap.add_argument("--domains", default=",".join(DOMAINS))
    ap.add_argument("--prompts", type=int, default=3, help="per domain, the bench's first N")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--chatgen", type=Path, default=None,
                    help="a chatgen shard (jsonl) instead of the bench: its prompts and the first --max-new-tokens of "
                         "their stored answers (the held-out shard 0: training's kind of instruction, never trained on)")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lookup", action="store_true",
                    help="also prompt lookup's chain, and each drafter's chain beside it (NAME+lookup: the longer of the two)")
    ap.add_argument("--datastore", default=None, metavar="shipped|PATH",
                    help="with --lookup: also lookup's chain fed by this datastore where the prompt has no match "
                         "(lookup+ds, NAME+lookup+ds), as --lookup-datastore serves it")
    ap.add_argument("--split", choices=("eval", "tune"), default="eval", help="the bench's prompt split")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    try:
        model, tok, eos, nets = load_chains(a.target, a.drafter)
        methods = {n: m for n, (m, _) in nets.items()}  # every row's name -> its method
        if a.datastore and not a.lookup:
            raise SpecBlockError("--datastore feeds prompt lookup's chain; give --lookup with it")
        store = open_datastore(a.datastore, a.target, model.config.vocab_size) if a.datastore else None
        if a.lookup:
            methods |= {"lookup": "lookup"} | {f"{n}+lookup": f"{m}+lookup" for n, (m, _) in nets.items()}
        if store is not None:
            methods |= {"lookup+ds": "lookup"} | {f"{n}+lookup+ds": f"{m}+lookup" for n, (m, _) in nets.items()}
        sums = {(n, d): torch.zeros(DEPTH) for n in methods for d in a.domains.split(",")}
        roots = {d: 0 for d in a.domains.split(",")}  # a chatgen shard's domains: code, math, chat, prose
        for d in a.domains.split(","):
            for ids, ans in texts(a, d, model, tok, eos):
                seq = torch.tensor([ids + ans])
                first, last = len(ids), len(ids) + len(ans) - 1  # roots serving drafts from: x_R known, R in [first, last)
                roots[d] += last - first
                near = lookup_hits(seq[0].numpy())[first - 1 : last - 1] if a.lookup else None
                if near is not None:
                    sums["lookup", d] += near.float().sum(0)
                fed = lookup_hits(seq[0].numpy(), store=store)[first - 1 : last - 1] if store is not None else None
                if fed is not None:
                    sums["lookup+ds", d] += fed.float().sum(0)
                for name, (method, net) in nets.items():
                    tp = target_pass(model, seq, tuple(net.cfg.tap_layers), net)
                    hits = chain_hits(method, net, tp)[first - 1 : last - 1]  # row R-1 <-> root R
                    sums[name, d] += hits.float().sum(0)
                    if near is not None:  # two branches: the longer chain is accepted
                        sums[f"{name}+lookup", d] += (hits | near).float().sum(0)
                    if fed is not None:
                        sums[f"{name}+lookup+ds", d] += (hits | fed).float().sum(0)
            print(d, {n: [round(float(x) / max(roots[d], 1), 3) for x in sums[n, d]] for n in methods}, flush=True)
    except SpecBlockError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    for name, method in methods.items():
        per = {d: [round(float(x) / max(roots[d], 1), 4) for x in sums[name, d]] for d in roots}
        tot = sum((sums[name, d] for d in roots), torch.zeros(DEPTH)) / max(sum(roots.values()), 1)
        rows.append({"name": name, "method": method, "by_depth": [round(float(x), 4) for x in tot], "by_domain": per})
    what = f"the bench's prompts ({a.split} split)" if a.chatgen is None else f"the prompts of {a.chatgen.name}"
    md = [f"Chains rooted at answer positions of the target's greedy answers to {what} ({a.prompts} per domain, "
          f"{a.max_new_tokens} new tokens, fp32): expected accepted drafts of a top-1 chain, by depth (cumulative).", "",
          "| drafter | chain of 2 | chain of 3 | chain of 4 | by depth | " + " | ".join(roots) + " (chain of 3) |",
          "|---|---|---|---|---|" + "---|" * len(roots)]
    for r in rows:
        c = r["by_depth"]
        md.append(f"| {r['name']} | {sum(c[:2]):.3f} | {sum(c[:3]):.3f} | {sum(c[:4]):.3f} | {' / '.join(f'{x:.3f}' for x in c)} | "
                  + " | ".join(f"{sum(r['by_domain'][d][:3]):.3f}" for d in roots) + " |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(a.out.with_suffix(".json"), json.dumps({"config": vars(a) | {"out": str(a.out)}, "roots": roots,
                                                         "rows": rows}, indent=1, default=str) + "\n")
    write_atomic(a.out.with_suffix(".md"), "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
