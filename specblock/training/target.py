"""Train, sample and export the lab target: a small HF ``LlamaForCausalLM`` trained from scratch.

    python -m specblock.training.target bench  [--steps 6]
    python -m specblock.training.target train  [--max-minutes 100 --max-steps N]
    python -m specblock.training.target sample [--max-new-tokens 64]
    python -m specblock.training.target export OUT_DIR

Everything lives in ``--run-dir`` (default ``runs/target``, gitignored): the tokenizer, a
uint16 token cache per domain and split (built once, so restarts are fast), ``ckpt/latest.safetensors``
(written atomically every ``--ckpt-every`` steps and on SIGTERM/SIGINT; ``train`` resumes from
it) and ``metrics.jsonl`` (train loss, tokens/s, held-out loss per domain).

The LR schedule is linear warmup then cosine decay over *progress*, the larger of
``step / max_steps`` and ``train_seconds / (max_minutes * 60)``, so the decay completes even
when a shared CPU runs slower than measured. Training stops when progress reaches 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pydantic import BaseModel, ConfigDict, Field

from specblock.errors import SpecBlockError
from specblock.flags import OneLineParser, check
from specblock.training.checkpoint import load_checkpoint, refuse_pickles, save_checkpoint
from specblock.training.corpus import DOMAINS, MIX_WEIGHTS, SPLITS, iter_documents
from specblock.training.tokenizer import load_tokenizer, train_tokenizer

SEQ_LEN = 512


def model_config(vocab_size: int = 8192):
    """The issue's measured 6-layer hidden-384 Llama (16.9M parameters with untied head)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
        num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=1024,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
        pad_token_id=2, attn_implementation="sdpa")


def _build_model(vocab_size: int):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(model_config(vocab_size))


# ----------------------------------------------------------------------------- token cache

def _tokenizer_digest(tok_dir: Path) -> str:
    return hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest()[:16]


def ensure_tokenizer(run_dir: Path) -> Path:
    tok_dir = run_dir / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        print(f"training tokenizer -> {tok_dir}", flush=True)
        tmp = run_dir / "tokenizer.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        train_tokenizer(tmp)
        os.replace(tmp, tok_dir)
    return tok_dir


def ensure_cache(run_dir: Path) -> dict[tuple[str, str], np.ndarray]:
    """Token streams ``<bos> doc <eos> <bos> doc <eos> ...`` per (domain, split), memmapped."""
    from tokenizers import Tokenizer

    tok_dir = ensure_tokenizer(run_dir)
    cache = run_dir / "cache" / _tokenizer_digest(tok_dir)
    cache.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|eos|>")
    out = {}
    for domain in DOMAINS:
        for split in SPLITS:
            path = cache / f"{domain}.{split}.u16"
            if not path.is_file():
                docs = list(iter_documents(domain, split))
                ids = [e.ids + [eos] for e in tok.encode_batch(docs)]  # post-processor adds bos
                arr = np.fromiter((t for d in ids for t in d), dtype=np.uint16)
                tmp = path.with_suffix(".tmp")
                arr.tofile(tmp)
                os.replace(tmp, path)
                print(f"cached {domain}/{split}: {len(docs)} docs, {arr.size:,} tokens", flush=True)
            out[domain, split] = np.memmap(path, dtype=np.uint16, mode="r")
    return out


def sample_batch(streams: dict, rng: np.random.Generator, batch: int) -> torch.Tensor:
    """Random ``SEQ_LEN + 1`` windows; each row's domain drawn by ``MIX_WEIGHTS`` (token shares)."""
    w = np.array([MIX_WEIGHTS[d] for d in DOMAINS])
    doms = rng.choice(len(DOMAINS), size=batch, p=w / w.sum())
    rows = []
    for d in doms:
        s = streams[DOMAINS[d], "train"]
        start = int(rng.integers(0, s.size - SEQ_LEN - 1))
        rows.append(np.asarray(s[start:start + SEQ_LEN + 1], dtype=np.int64))
    return torch.from_numpy(np.stack(rows))


def heldout_windows(streams: dict, per_domain: int) -> dict[str, torch.Tensor]:
    """Fixed, evenly spaced held-out windows per domain, the same at every evaluation."""
    out = {}
    for d in DOMAINS:
        s = streams[d, "heldout"]
        n = min(per_domain, s.size // (SEQ_LEN + 1))
        starts = np.linspace(0, s.size - SEQ_LEN - 1, n).astype(np.int64)
        out[d] = torch.from_numpy(np.stack(
            [np.asarray(s[a:a + SEQ_LEN + 1], dtype=np.int64) for a in starts]))
    return out


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model, windows: dict[str, torch.Tensor], batch: int = 8) -> dict[str, float]:
    model.eval()
    out = {}
    for d, w in windows.items():
        losses = [lm_loss(model, w[i:i + batch]).item() * len(w[i:i + batch])
                  for i in range(0, len(w), batch)]
        out[d] = sum(losses) / len(w)
    model.train()
    return out


# ----------------------------------------------------------------------------- training

class ThreadGovernor:
    """Drop to one torch thread while other processes keep a core busy, back up when they stop.

    Measured on this 2-core machine: batch 16x512 trains at ~3,400 tokens/s with 2 threads on
    an idle CPU, but at ~600 tokens/s with 2 threads while another process holds one core
    (OpenMP threads wait on the descheduled one), against ~1,400 with 1 thread. The load of the
    *other* processes is read from /proc/stat minus this process's own CPU time.
    """

    def __init__(self, max_threads: int, enabled: bool) -> None:
        self.max_threads, self.enabled = max_threads, enabled and os.path.exists("/proc/stat")
        self.threads = max_threads
        self.other = 0.0
        self._last = self._sample()
        torch.set_num_threads(max_threads)

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
            busy = (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            busy = 0.0
        return time.monotonic(), busy, time.process_time()

    def update(self) -> int:
        if not self.enabled or self.max_threads < 2:
            return self.threads
        now = self._sample()
        wall, busy, mine = (a - b for a, b in zip(now, self._last))
        self._last = now
        if wall > 0:
            self.other = 0.5 * self.other + 0.5 * max(0.0, (busy - mine) / wall)
        want = 1 if self.other > 0.4 else self.max_threads
        if want != self.threads:
            torch.set_num_threads(want)
            self.threads = want
        return self.threads


def lr_at(step: int, progress: float, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def _optimizer(model, args) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def train(args, bench: bool = False) -> None:
    from tqdm import tqdm

    governor = ThreadGovernor(args.threads, args.adaptive_threads)
    run_dir = Path(args.run_dir)
    streams = ensure_cache(run_dir)
    for d in DOMAINS:
        print(f"  {d}: train {streams[d, 'train'].size:,} heldout {streams[d, 'heldout'].size:,} tokens")
    ckpt_path = run_dir / "ckpt" / "latest.safetensors"
    refuse_pickles(run_dir / "ckpt" / "latest.pt")
    torch.manual_seed(args.seed)
    model = _build_model(8192)
    opt = _optimizer(model, args)
    rng = np.random.default_rng(args.seed)
    step, train_seconds, tokens = 0, 0.0, 0
    if ckpt_path.is_file() and not bench:
        st = load_checkpoint(ckpt_path)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optim"])
        rng.bit_generator.state = st["np_rng"]
        torch.set_rng_state(st["torch_rng"])
        step, train_seconds, tokens = st["step"], st["train_seconds"], st["tokens"]
        print(f"resumed from {ckpt_path}: step {step}, {tokens:,} tokens, {train_seconds / 60:.1f} min")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters; batch {args.batch}x{SEQ_LEN} tokens/step; "
          f"plan: {args.max_steps} steps or {args.max_minutes} min", flush=True)
    windows = heldout_windows(streams, args.eval_windows)
    log = open(run_dir / ("bench.jsonl" if bench else "metrics.jsonl"), "a")

    stop = {"flag": False}

    def _on_signal(signum, _frame):
        print(f"\nsignal {signum}: saving and stopping after this step", flush=True)
        stop["flag"] = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)

    def state() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step,
                "train_seconds": train_seconds, "tokens": tokens,
                "np_rng": rng.bit_generator.state, "torch_rng": torch.get_rng_state(),
                "args": vars(args), "config": model.config.to_dict()}

    def progress() -> float:
        return max(step / args.max_steps, train_seconds / (args.max_minutes * 60))

    bar = tqdm(total=args.max_steps, initial=step, dynamic_ncols=True, mininterval=5)
    model.train()
    ema_tps = None
    while progress() < 1.0 and not stop["flag"] and not (bench and step >= args.steps):
        t0 = time.perf_counter()
        lr = lr_at(step, progress(), args)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = sample_batch(streams, rng, args.batch)
        loss = lm_loss(model, batch)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        step += 1
        train_seconds += dt
        tokens += batch.numel() - batch.shape[0]
        tps = (batch.numel() - batch.shape[0]) / dt
        threads = governor.update()
        ema_tps = tps if ema_tps is None or step <= 2 else 0.9 * ema_tps + 0.1 * tps
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.2e}", tok_s=f"{ema_tps:.0f}", thr=threads)
        rec = {"step": step, "loss": round(loss.item(), 4), "lr": lr, "gnorm": round(gnorm, 3),
               "tok_s": round(tps), "threads": threads,
               "other_load": round(governor.other, 2), "tokens": tokens, "minutes": round(train_seconds / 60, 2)}
        if step % args.eval_every == 0 or progress() >= 1.0:
            ev = evaluate(model, windows)
            rec["heldout"] = {d: round(v, 4) for d, v in ev.items()}
            bar.write(f"step {step} tokens {tokens:,} heldout " +
                      " ".join(f"{d}={v:.3f}" for d, v in ev.items()))
        if bench or step % 10 == 0 or "heldout" in rec:
            log.write(json.dumps(rec) + "\n")
            log.flush()
        if not bench and (step % args.ckpt_every == 0 or stop["flag"] or progress() >= 1.0):
            save_checkpoint(ckpt_path, state())
    bar.close()
    if bench:
        rates = [json.loads(x)["tok_s"] for x in open(run_dir / "bench.jsonl")][-max(1, args.steps - 2):]
        print(f"bench: {np.median(rates):.0f} tokens/s median over last {len(rates)} steps "
              f"(batch {args.batch}x{SEQ_LEN}, threads {args.threads})")
    else:
        print(f"stopped at step {step}, {tokens:,} tokens, {train_seconds / 60:.1f} min; "
              f"checkpoint {ckpt_path}", flush=True)


# ----------------------------------------------------------------------------- sample / export

def load_checkpoint_model(run_dir: Path, ckpt: str | None = None):
    path = Path(ckpt) if ckpt else run_dir / "ckpt" / "latest.safetensors"
    if path.suffix == ".pt":
        refuse_pickles(path)
    if not path.is_file():
        raise SpecBlockError(f"no checkpoint at {path}; run `python -m specblock.training target train` first")
    st = load_checkpoint(path)
    model = _build_model(8192)
    model.load_state_dict(st["model"])
    return model.eval(), st


@torch.no_grad()
def sample(args) -> None:
    from specblock.prompts import DOMAINS as EVAL_DOMAINS, load_prompts

    torch.set_num_threads(args.threads)
    run_dir = Path(args.run_dir)
    model, st = load_checkpoint_model(run_dir, args.ckpt)
    tok = load_tokenizer(run_dir / "tokenizer")
    print(f"checkpoint step {st['step']}, {st['tokens']:,} tokens")
    prompts = [(d, load_prompts(d, 1)[0].text) for d in EVAL_DOMAINS]
    prompts.append(("prose", "ROMEO:\n"))
    for domain, text in prompts:
        ids = tok(text, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        print(f"===== {domain} =====\n{text[-300:]}\n----- greedy continuation -----\n"
              f"{tok.decode(out[0, ids.shape[1]:])}\n")


def export(args) -> None:
    """An HF model dir (bf16 safetensors, tokenizer, generation config), written atomically."""
    from transformers import GenerationConfig

    run_dir = Path(args.run_dir)
    model, st = load_checkpoint_model(run_dir, args.ckpt)
    tok = load_tokenizer(run_dir / "tokenizer")
    out = Path(args.out).resolve()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, do_sample=False)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    tj = tmp / "tokenizer.json"  # compact: the pretty-printed file is 2.4x larger, and assets count bytes
    tj.write_text(json.dumps(json.loads(tj.read_text()), ensure_ascii=False, separators=(",", ":")))
    for f in tmp.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; a shipped asset should be world-readable
    summary = {"step": st["step"], "train_tokens": st["tokens"],
               "train_minutes": round(st["train_seconds"] / 60, 1), "seq_len": SEQ_LEN,
               "mix_weights": MIX_WEIGHTS, "train_args": st["args"]}
    (tmp / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    print(f"exported step {st['step']} to {out}")


class TargetTrainFlags(BaseModel):
    """Numeric flags of every subcommand (absent ones are skipped): a zero batch or step count
    used to end in a traceback after the token cache was built."""

    model_config = ConfigDict(extra="ignore")

    threads: int = Field(ge=1)
    max_steps: int = Field(1, ge=1)
    max_minutes: float = Field(1.0, gt=0, allow_inf_nan=False)
    batch: int = Field(1, ge=1)
    lr: float = Field(1.0, gt=0, allow_inf_nan=False)
    min_lr: float = Field(0.0, ge=0, allow_inf_nan=False)
    warmup: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)
    clip: float = Field(1.0, gt=0, allow_inf_nan=False)
    seed: int = Field(0, ge=0, lt=2**63)
    eval_every: int = Field(1, ge=1)
    eval_windows: int = Field(1, ge=1)
    ckpt_every: int = Field(1, ge=1)
    steps: int = Field(1, ge=1)
    max_new_tokens: int = Field(1, ge=1)


def main(argv: list[str] | None = None) -> None:
    p = OneLineParser(prog="python -m specblock.training target", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default="runs/target")
    p.add_argument("--threads", type=int, default=2)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("train", "bench"):
        t = sub.add_parser(name)
        t.add_argument("--max-steps", type=int, default=3600)
        t.add_argument("--max-minutes", type=float, default=100.0)
        t.add_argument("--batch", type=int, default=8, help="sequences of 512 tokens per step")
        t.add_argument("--lr", type=float, default=1e-3)
        t.add_argument("--min-lr", type=float, default=1e-4)
        t.add_argument("--warmup", type=int, default=150)
        t.add_argument("--weight-decay", type=float, default=0.1)
        t.add_argument("--clip", type=float, default=1.0)
        t.add_argument("--seed", type=int, default=0)
        t.add_argument("--eval-every", type=int, default=200)
        t.add_argument("--eval-windows", type=int, default=8, help="held-out windows per domain")
        t.add_argument("--ckpt-every", type=int, default=100)
        t.add_argument("--no-adaptive-threads", dest="adaptive_threads", action="store_false",
                       help="keep --threads fixed even while other processes load the CPU")
        t.add_argument("--steps", type=int, default=6, help="bench only: steps to time")
    s = sub.add_parser("sample")
    s.add_argument("--ckpt", default=None)
    s.add_argument("--max-new-tokens", type=int, default=64)
    e = sub.add_parser("export")
    e.add_argument("out")
    e.add_argument("--ckpt", default=None)
    args = p.parse_args(argv)
    check(TargetTrainFlags, vars(args))
    if args.cmd == "train":
        train(args)
    elif args.cmd == "bench":
        train(args, bench=True)
    elif args.cmd == "sample":
        sample(args)
    else:
        export(args)


if __name__ == "__main__":
    main()
