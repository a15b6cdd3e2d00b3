"""``python -m specblock.training featcache``: target features computed once, shared by every
feature-based drafter's training.

On this CPU the target's forward is the bottleneck of drafter training by an order of magnitude
(issue 14: ~550 tokens/s against ~6,700 for a drafter step), so the target runs once per token of
the self-generated data (``training/chatgen.py``) and every drafter (SpecBlock, EAGLE-3,
ParallelSpec, Falcon, ablations) reads the same cache.

Per chatgen shard, a directory ``shard_NNNNN/`` of memory-mappable ``.npy`` files over the
shard's sequences concatenated (prompt then answer, ``offsets`` [n+1] marks where each starts):

- ``tokens`` [T] int32, ``prompt_lens`` [n] int32;
- ``taps`` [T, n_taps*h] and ``top`` [T, h]: hidden states entering the tap layers
  (``runtime.target.default_taps``) and the last hidden state (HF's ``hidden_states[-1]``, after
  the final norm), stored as the bits of the target's bfloat16 (uint16; numpy has no bfloat16, and
  the bits keep exactly what the served target computes; float32 targets are stored as float32);
- ``topk_ids`` [T, k] int32 and ``topk_logp`` [T, k] float32: the target's k most likely next
  tokens and their log-probabilities over the whole vocabulary.

``--dtype q4`` computes them with the target as ``--dtype q4`` serves it (its GGUF codes on our
kernels, ``runtime.target.TargetModel``), stored as float32, one sequence a forward. Why: at q4 the
served target agrees with the bf16 model on about 97% of next tokens, and a drafter trained on bf16
features meets other taps and other soft targets when it serves. One sequence a forward because
q4's forward is not batch-invariant (in a batch of two, 1e-5 after the first layer and 1e-2 after
the second, which the int8 kernel's rounding of activations turns into other tokens:
``experiments/q4_batch_invariance.py``), while serving runs one sequence; alone, each sequence's taps equal the served prefill's bit for bit (``tests/test_featcache.py``).

``manifest.json`` holds the target's name and weights sha256, the taps, k, per-shard token counts,
bytes and the sha256 of every file. Resumable (a shard is written to a temp directory then
renamed; shards in the manifest are skipped); a cache made for another target is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specblock.models.convert import sha256
from specblock.errors import SpecBlockError

#: Shards of reference answers (``refanswers``) are named ``ref_NNNNN``; chatgen's, the target's
#: own answers, ``shard_NNNNN``. One cache holds both kinds side by side.
REF_PREFIX = "ref_"


def is_reference(name: str) -> bool:
    return name.startswith(REF_PREFIX)


FILES = ("tokens", "offsets", "prompt_lens", "taps", "top", "topk_ids", "topk_logp")


def target_identity(target_dir: Path) -> dict:
    """Name and weights checksum of a target: from ``specblock_model.json`` when the registry
    built it (its ``weights_sha256``), else the sha256 of its safetensors files."""
    target_dir = Path(target_dir)
    card = target_dir / "specblock_model.json"
    if card.is_file():
        meta = json.loads(card.read_text())
        if meta.get("weights_sha256"):
            return {"name": meta.get("name", target_dir.name), "weights_sha256": meta["weights_sha256"]}
    h = hashlib.sha256()
    for f in sorted(target_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return {"name": target_dir.name, "weights_sha256": h.hexdigest()}




def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _to_numpy(x):
    """bfloat16 as its raw bits (uint16), anything else as float32."""
    import torch

    if x.dtype == torch.bfloat16:
        return x.contiguous().view(torch.int16).numpy().view(np.uint16)
    return x.float().numpy()


def sequence_features(model, seqs: list[list[int]], taps: tuple[int, ...], k: int) -> list[dict]:
    """Features of each sequence, batched with right padding (a causal model's positions before the
    padding never see it, so each row equals the sequence's own forward up to kernel rounding)."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    from specblock.runtime import exact_parts

    with torch.no_grad(), exact_parts.rotary_op(model):  # as the served target runs (a no-op where not prepared)
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        hs = out.hidden_states
        tap = torch.cat([hs[i] for i in taps], dim=-1)
        logp = torch.log_softmax(out.logits.float(), dim=-1)
        top_lp, top_id = logp.topk(k, dim=-1)
    res = []
    for i, s in enumerate(seqs):
        n = len(s)
        res.append({"taps": _to_numpy(tap[i, :n]), "top": _to_numpy(hs[-1][i, :n]),
                    "topk_ids": top_id[i, :n].numpy().astype(np.int32), "topk_logp": top_lp[i, :n].numpy()})
    return res


def write_shard(out_dir: Path, model, rows: list[dict], taps: tuple[int, ...], k: int, batch_tokens: int) -> dict:
    """One chatgen shard's features into ``out_dir`` (atomically: temp directory, then rename)."""
    seqs = [r["prompt_ids"] + r["answer_ids"] for r in rows]
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    feats: list[dict | None] = [None] * len(seqs)
    i = 0
    while i < len(order):  # batches of similar length up to ~batch_tokens padded tokens
        j = i + 1
        while j < len(order) and (j - i + 1) * len(seqs[order[j]]) <= batch_tokens:
            j += 1
        for idx, f in zip(order[i:j], sequence_features(model, [seqs[o] for o in order[i:j]], taps, k)):
            feats[idx] = f
        i = j
    arrays = {
        "tokens": np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs]),
        "offsets": np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64),
        "prompt_lens": np.asarray([len(r["prompt_ids"]) for r in rows], dtype=np.int32),
        **{name: np.concatenate([f[name] for f in feats]) for name in ("taps", "top", "topk_ids", "topk_logp")},
    }
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, arr in arrays.items():
        np.save(tmp / f"{name}.npy", arr)
    info = {"sequences": len(seqs), "tokens": int(arrays["tokens"].size),
            "answer_tokens": int(sum(len(r["answer_ids"]) for r in rows)),
            "bytes": int(sum((tmp / f"{n}.npy").stat().st_size for n in FILES)),
            "sha256": {n: sha256(tmp / f"{n}.npy") for n in FILES}}
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return info


# --------------------------------------------------------------------------- reading
@dataclass
class Shard:
    """One shard's arrays, memory-mapped (nothing is read until indexed)."""

    tokens: np.ndarray
    offsets: np.ndarray
    prompt_lens: np.ndarray
    taps: np.ndarray
    top: np.ndarray
    topk_ids: np.ndarray
    topk_logp: np.ndarray
    bf16: bool


class FeatureCache:
    """A finished (or growing) cache opened for reading; checks it belongs to the target."""

    def __init__(self, root: Path, target_dir: Path | None = None) -> None:
        self.root = Path(root)
        path = self.root / "manifest.json"
        if not path.is_file():
            raise SpecBlockError(f"no feature cache at {self.root} (no manifest.json); build it with "
                                 "`python -m specblock.training featcache`")
        self.manifest = json.loads(path.read_text())
        if target_dir is not None:
            ident = target_identity(Path(target_dir))
            if ident["weights_sha256"] != self.manifest["target_sha256"]:
                raise SpecBlockError(f"feature cache {self.root} was made for target {self.manifest['target']} "
                                     f"(weights {self.manifest['target_sha256'][:12]}), not {ident['name']} "
                                     f"({ident['weights_sha256'][:12]}); use that target or another cache")
        self.names = sorted(self.manifest["shards"])
        self.taps = tuple(self.manifest["taps"])
        self.bf16 = self.manifest["dtype"] == "bfloat16"

    def reload(self) -> None:
        """Re-read the manifest (a featcache still running adds shards to it atomically)."""
        self.manifest = json.loads((self.root / "manifest.json").read_text())
        self.names = sorted(self.manifest["shards"])

    def shard(self, name: str) -> Shard:
        d = self.root / name
        arrs = {n: np.load(d / f"{n}.npy", mmap_mode="r") for n in FILES}
        return Shard(**arrs, bf16=self.bf16)

    def verify(self) -> None:
        """Recompute every file's sha256 against the manifest (one line naming the first bad file)."""
        for name in self.names:
            for f, digest in self.manifest["shards"][name]["sha256"].items():
                if sha256(self.root / name / f"{f}.npy") != digest:
                    raise SpecBlockError(f"{self.root / name / f}.npy does not match its checksum; delete "
                                         f"{self.root / name} and rerun featcache to rebuild it")


def as_tensor(arr: np.ndarray, bf16: bool):
    """A slice of ``taps`` / ``top`` as a torch tensor in the target's dtype."""
    import torch

    t = torch.from_numpy(np.array(arr))  # a copy: memory maps are read-only
    return t.view(torch.int16).view(torch.bfloat16) if bf16 else t


# --------------------------------------------------------------------------- building
def open_manifest(out: Path, ident: dict, settings: dict) -> dict:
    path = out / "manifest.json"
    if path.is_file():
        man = json.loads(path.read_text())
        if man["target_sha256"] != ident["weights_sha256"]:
            raise SpecBlockError(f"{out} is a feature cache of another target ({man['target']}, weights "
                                 f"{man['target_sha256'][:12]}); use another --out")
        if {k: man[k] for k in settings} != settings:
            raise SpecBlockError(f"{out} was built with {({k: man[k] for k in settings})}; pass the same settings or use another --out")
        return man
    return {"kind": "specblock-featcache", "target": ident["name"], "target_sha256": ident["weights_sha256"],
            **settings, "shards": {}}


def check_sources(data: Path, out: Path, target_dir: Path) -> tuple[dict, dict]:
    """Refuse, before any model is loaded, answers or a cache that belong to another target.
    ``data`` is a chatgen directory (the target's own answers) or a refanswers one (reference text
    encoded with the target's tokenizer and template)."""
    src = data / "manifest.json"
    if not src.is_file():
        raise SpecBlockError(f"{data} holds no chatgen manifest; run `python -m specblock.training chatgen` first")
    gen = json.loads(src.read_text())
    ident = target_identity(target_dir)
    if gen.get("target_sha256") != ident["weights_sha256"]:
        what = "reference answers encoded for" if gen.get("kind") == "specblock-reference" else "answers of"
        raise SpecBlockError(f"{data} holds {what} target {gen.get('target')}, not {ident['name']}; "
                             "features must come from the model that wrote the answers")
    if (out / "manifest.json").is_file():
        open_manifest(out, ident, {})
    return gen, ident


def pending(data: list[Path], out: Path, man: dict) -> list[tuple[Path, str]]:
    """Shards of every data directory not yet in the cache, the first directory's first (the
    target's own answers before reference text, so a --follow run keeps up with chatgen)."""
    todo = []
    for d in data:
        gen = json.loads((d / "manifest.json").read_text())
        todo += [(d, n) for n in sorted(gen["shards"]) if not (n in man["shards"] and (out / n).is_dir())]
    return todo


#: The ``--dtype`` of a cache computed with the served q4 target (its arrays are float32).
Q4 = "q4"


def served_dtype(model) -> str:
    """The manifest's ``dtype``: ``q4`` for a model whose linears are our q4 ones, else ``bfloat16``
    or ``float32`` by its torch dtype."""
    import torch

    from specblock.runtime.target import dtype_name_of

    if dtype_name_of(model, model.dtype) == Q4:
        return Q4
    return "bfloat16" if model.dtype == torch.bfloat16 else "float32"


def build_cache(data: Path | list[Path], out: Path, target_dir: Path, model, k: int = 8, batch_tokens: int = 2048,
                max_shards: int | None = None, max_minutes: float | None = None, log=print) -> dict:
    """Features for every shard of ``data`` (one directory or several) not yet in ``out``;
    returns the manifest. A q4 ``model`` (``served_dtype``) runs one sequence a forward."""
    data = [data] if isinstance(data, Path) else list(data)
    gens = [check_sources(d, out, target_dir)[0] for d in data]
    ident = target_identity(target_dir)
    from specblock.runtime.target import default_taps

    taps = tuple(default_taps(model.config.num_hidden_layers))
    dtype = served_dtype(model)
    if dtype == Q4:
        batch_tokens = 1  # one sequence a batch: q4's forward is not batch-invariant (module docstring)
    settings = {"taps": list(taps), "k": k, "dtype": dtype, "hidden_size": model.config.hidden_size}
    out.mkdir(parents=True, exist_ok=True)
    man = open_manifest(out, ident, settings)
    man["heldout_shards"] = [f"{g.get('shard_prefix', 'shard_')}{i:05d}" for g in gens for i in g.get("heldout_shards", [])]
    man["sources"] = {str(d): g.get("kind", "specblock-chatgen") for d, g in zip(data, gens)}
    t0 = time.perf_counter()
    for done, (d, name) in enumerate(pending(data, out, man)):
        if (max_shards is not None and done >= max_shards) or (
                max_minutes is not None and time.perf_counter() - t0 > 60 * max_minutes):
            break
        rows = [json.loads(line) for line in (d / f"{name}.jsonl").read_text().splitlines() if line.strip()]
        ts = time.perf_counter()
        info = write_shard(out / name, model, rows, taps, k, batch_tokens)
        took = time.perf_counter() - ts
        info["seconds"] = round(took, 2)
        man["shards"][name] = info
        man["totals"] = {"shards": len(man["shards"]), "tokens": sum(s["tokens"] for s in man["shards"].values()),
                         "gb": round(sum(s["bytes"] for s in man["shards"].values()) / 1e9, 3),
                         "minutes": round(sum(s["seconds"] for s in man["shards"].values()) / 60, 2)}
        _write_json(out / "manifest.json", man)
        log(json.dumps({"shard": name, "shard_tokens": info["tokens"], "tok_s": round(info["tokens"] / max(took, 1e-9), 1),  # a tiny shard rounds to 0.0 s
                        "cache": man["totals"]}))
    _write_json(out / "manifest.json", man)
    return man


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specblock.training featcache", description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="a model name or directory (the one that wrote --data)")
    ap.add_argument("--data", type=Path, required=True, action="append",
                    help="a chatgen (or refanswers) output directory; repeat to add more, the first one's shards first")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--k", type=int, default=8, help="soft targets kept per position")
    ap.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per target forward")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", Q4],
                    help="the target's dtype; q4: as --dtype q4 serves it, one sequence a forward")
    ap.add_argument("--max-shards", type=int, default=None)
    ap.add_argument("--max-minutes", type=float, default=None)
    ap.add_argument("--follow", action="store_true",
                    help="keep waiting for new chatgen shards (poll every minute) until --max-minutes")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.k < 1 or args.batch_tokens < 1:
        raise SpecBlockError("--k and --batch-tokens must be positive")
    import torch

    from specblock.models import resolve_target
    from specblock.runtime.target import load_causal_lm

    torch.set_num_threads(args.threads)
    target_dir = resolve_target(args.target)
    for d in args.data:
        check_sources(d, args.out, target_dir)
    if args.dtype == Q4:
        from specblock.runtime.target import TargetModel

        model = TargetModel.load(target_dir, Q4, "cpu").model.eval()
    else:
        model = load_causal_lm(target_dir, args.dtype, "cpu", "sdpa", False).eval()
    t0, man, added = time.perf_counter(), {}, 0
    while True:
        left = None if args.max_minutes is None else args.max_minutes - (time.perf_counter() - t0) / 60
        if (left is not None and left <= 0) or (args.max_shards is not None and added >= args.max_shards):
            break
        path = args.out / "manifest.json"
        before = len(json.loads(path.read_text())["shards"]) if path.is_file() else 0
        # One shard per pass under --follow: a chatgen shard finished meanwhile goes before reference text.
        man = build_cache(args.data, args.out, target_dir, model, args.k, args.batch_tokens,
                          1 if args.follow else args.max_shards, left, log=lambda s: print(s, flush=True))
        if not args.follow:
            break
        added += len(man["shards"]) - before
        if len(man["shards"]) == before:
            time.sleep(60)
    print(json.dumps({"out": str(args.out), **man.get("totals", {})}), flush=True)
    return 0
