"""Compiled versus eager target (issue 16), in one run per target: T(n) for the tree-size buckets,
plain-decoding tokens/s against HF ``generate`` (plain, static cache, static cache +
``torch.compile(mode="reduce-overhead")``), compile time cold and warm (fresh processes on an empty
and then the same inductor cache), and the memory-bandwidth floor beside T(1). ``--modes`` picks
the compile modes measured side by side: ``regions`` (one layer step shared by all layers) and/or
``whole`` (the whole forward); each mode's cold compile starts from its own empty cache.

    python experiments/compiled_speed.py --targets lab,smollm2-135m-instruct [--threads 2] [--reps 20]
    python experiments/compiled_speed.py --targets lab --modes regions,whole --skip-decoding --sizes 1,16 \
        --out experiments/results/compiled_regions

Writes experiments/results/compiled_speed.{json,md}. Timings are medians of interleaved reps
(compiled and eager alternate, so a load change on the machine hits both).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from specblock.compiled.target import BUCKETS, CPU_OPTIONS, FROZEN_CPU_OPTIONS, StaticTarget
from specblock.runtime.config import validate
from specblock.runtime.drafters.base import ARDrafter
from specblock.runtime.engine import Engine
from specblock.runtime.packed import PackedLinear
from specblock.runtime.q4 import Int4Linear, Int8Linear
from specblock.runtime.calibrate import _random_tree as random_tree  # calibrate's trees and rewind: the same T(n)
from specblock.runtime.calibrate import rewind
from specblock.runtime import exact_parts as exact_parts_module
from specblock.runtime.target import DTYPE_CHOICES, TargetModel, resolve_dtype


def clock(device: torch.device | str = "cpu") -> float:
    """Wall time after the device finished (CUDA kernels are asynchronous)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def bandwidth_gbs(device: str, mb: int = 512, reps: int = 7) -> float:
    """Read bandwidth as the issue measured it: a torch sum over ``mb`` MB of bf16."""
    x = torch.ones(mb * 2**20 // 2, dtype=torch.bfloat16, device=device)
    x.sum()
    ts = []
    for _ in range(reps):
        t0 = clock(device)
        x.sum()
        ts.append(clock(device) - t0)
    return x.numel() * 2 / float(np.median(ts)) / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one forward reads. Packed-fp16 linears read their fp16 copy (2 bytes a weight), q4
    linears their 4-bit (or the head's 8-bit) values and their kernel's scales and offsets, not the fp32
    ``weight`` either keeps; an embedding whose head is packed or quantized is read one row at a time."""
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    int4 = [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    if not packed and not int4:
        return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
    skip = {id(m.weight) for m in packed + int4} | {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding)
                                                    for p in m.parameters()}
    read = sum(2 * m.weight.numel() for m in packed)
    read += sum(m.nbytes() for m in int4)
    return read + sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)


def packed_fp16_head(model: torch.nn.Module) -> None:
    """q4's Q8_0 head (``Int8Linear``) back to a packed fp16 one over the same weight values: the
    head q4 had before it read the GGUF's 8-bit head."""
    head = model.get_output_embeddings()
    if not isinstance(head, Int8Linear):
        raise SystemExit("an fp16 head baseline needs --dtype q4 on a model whose q4 file holds its Q8_0 head "
                         "(rebuild it: `python -m specblock.runtime models --build NAME`)")
    lin = torch.nn.Linear(head.in_features, head.out_features, bias=False)
    lin.weight = head.weight
    model.set_output_embeddings(PackedLinear(lin))


def time_trees(targets: dict[str, TargetModel], ctx: int, sizes: list[int], reps: int, seed: int = 0,
               first: dict | None = None) -> dict:
    """Median ms of one tree forward of n nodes at context ``ctx``, per target, interleaved;
    ``first`` gets each target's seconds for its first forward of each n (a compile, a load or
    neither: a size whose bucket or graph it has already)."""
    rng = np.random.default_rng(seed)
    vocab = next(iter(targets.values())).vocab_size
    dev = next(iter(targets.values())).device
    prompt = rng.integers(0, vocab, ctx)
    out: dict[str, list[float]] = {name: [] for name in targets}
    for n in sizes:
        ts = {name: [] for name in targets}
        for name, t in targets.items():
            t.prefill(prompt)
            t0 = clock(dev)
            t.tree_forward(random_tree(rng, n, vocab))  # first use of a bucket compiles: not in the medians
            if first is not None:
                first.setdefault(name, []).append(round(clock(dev) - t0, 2))
            rewind(t, ctx)
        for _ in range(reps):
            tree = random_tree(rng, n, vocab)
            for name, t in targets.items():
                t0 = clock(dev)
                t.tree_forward(tree)
                ts[name].append(clock(dev) - t0)
                rewind(t, ctx)
        for name in targets:
            out[name].append(round(1e3 * float(np.median(ts[name])), 3))
        print(f"T({n}) " + ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in out.items()), flush=True)
    return out


class Stamps:
    """When each new token arrived, from our engine's ``on_tokens`` or as an HF streamer (whose first
    ``put`` is the prompt): the decode time a token after the first, prefill and first token left out."""

    def __init__(self, device: torch.device | str) -> None:
        self.device, self.times, self.counts, self.prompt_seen = device, [], [], False

    def tokens(self, new: list[int]) -> None:
        self.times.append(clock(self.device))
        self.counts.append(len(new))

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.tokens([0] * value.numel())

    def end(self) -> None:
        pass

    def ms_per_token(self) -> float:
        after = sum(self.counts[1:])  # tokens that arrived after the first arrival
        return 1e3 * (self.times[-1] - self.times[0]) / after if after else float("nan")


def hf_generate(model, prompt: torch.Tensor, tokens: int, mode: str, streamer: Stamps | None = None) -> list[int]:
    from transformers import CompileConfig

    kw: dict = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0,
                    attention_mask=torch.ones_like(prompt), streamer=streamer)
    if mode in ("static", "static+compile"):
        kw["cache_implementation"] = "static"
    if mode == "static+compile":
        cc = CompileConfig(mode="reduce-overhead")  # the best HF mode on this CPU
        cc._compile_all_devices = True  # HF auto-compiles on GPUs only unless told
        kw["compile_config"] = cc
    else:
        kw["disable_compile"] = True
    out = model.generate(prompt, **kw)
    return out[0, prompt.shape[1]:].tolist()


@contextmanager
def hf_attention(model):
    """HF's generate runs with HF's own SDPA attention, as shipped: our compiled target switches the
    shared model to its GQA attention (compiled/gqa.py), which would otherwise speed up HF's compiled
    generate too. Switched back after each call, so every compiled graph keeps the setting it was
    traced with."""
    impl = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(impl)


def time_decoding(eager: TargetModel, compiled: dict[str, StaticTarget], prompt: np.ndarray, tokens: int, runs: int,
                  hf_also: dict[str, torch.nn.Module] | None = None) -> dict:
    """Plain-decoding tokens/s (prefill included, as HF's) for ours eager, each compiled target (the
    first is "ours compiled", baselines keep their names) and HF's three modes, on our eager model
    and on each model of ``hf_also`` (label: model, e.g. the bf16 checkpoint)."""
    dev = eager.device
    x = torch.as_tensor(prompt, device=dev)[None]
    hf_models = {"": eager.model, **{f" ({k})": m for k, m in (hf_also or {}).items()}}
    engines = {"ours eager": Engine(eager, ARDrafter(), budget=0)}
    for i, (name, target) in enumerate(compiled.items()):
        engines["ours compiled" if i == 0 else f"ours {name}"] = Engine(target, ARDrafter(), budget=0)
    hf_modes = ("plain", "static", "static+compile")
    first: dict[str, float] = {}
    outs: dict[str, list[int]] = {}
    for name, eng in engines.items():  # warm-up (the compiled one compiles bucket 1 here)
        t0 = clock(dev)
        outs[name] = eng.generate(prompt, tokens).token_ids
        first[name] = clock(dev) - t0
    for suffix, model in hf_models.items():
        for mode in hf_modes:
            t0 = clock(dev)
            with hf_attention(model):
                outs[f"hf {mode}{suffix}"] = hf_generate(model, x, tokens, mode)
            first[f"hf {mode}{suffix}"] = clock(dev) - t0
    rates: dict[str, list[float]] = {k: [] for k in outs}
    per_token: dict[str, list[float]] = {k: [] for k in outs}  # ms a new token after the first, prefill left out

    for _ in range(runs):
        for name, eng in engines.items():
            stamps = Stamps(dev)
            t0 = clock(dev)
            eng.generate(prompt, tokens, on_tokens=stamps.tokens)
            rates[name].append(tokens / (clock(dev) - t0))
            per_token[name].append(stamps.ms_per_token())
        for suffix, model in hf_models.items():
            for mode in hf_modes:
                stamps = Stamps(dev)
                with hf_attention(model):
                    t0 = clock(dev)
                    hf_generate(model, x, tokens, mode, streamer=stamps)
                    rates[f"hf {mode}{suffix}"].append(tokens / (clock(dev) - t0))
                per_token[f"hf {mode}{suffix}"].append(stamps.ms_per_token())
    rows = {k: {"tokens_per_s": round(float(np.median(v)), 2), "decode_ms_per_token": round(float(np.median(per_token[k])), 2),
                "first_call_s": round(first[k], 2),
                "common_prefix_with_hf_plain": common_prefix(outs[k], outs["hf plain"]),
                "common_prefix_with_ours_eager": common_prefix(outs[k], outs["ours eager"])} for k, v in rates.items()}
    for k, r in rows.items():
        print(f"{k}: {r}", flush=True)
    return rows


def with_fp16_kernel(target: StaticTarget) -> StaticTarget:
    """This target's forwards on the fp16 kernel (``compiled/native.py``; a process-wide switch, so it
    is turned on for the length of each of its calls and off after): the other targets keep fbgemm."""
    from specblock.compiled import native

    if not native.use_native_kernel():
        raise SystemExit("error: --fp16-kernel-variant needs the C++ packed-linear library, which did not build")
    for name in ("prefill", "tree_forward", "warm"):
        def switched(*a, _fn=getattr(target, name), **k):
            native.set_fp16_kernel(True)
            try:
                return _fn(*a, **k)
            finally:
                native.set_fp16_kernel(False)
        setattr(target, name, switched)
    return target


def common_prefix(a: list[int], b: list[int]) -> int:
    """Tokens two greedy decodings share before the first difference (bf16 rounds each kernel
    choice differently, so near-ties can flip; fp32 identity is what the tests check)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def probe(args) -> None:
    """One fresh process: load, then the first forward of every bucket (compiling or loading)."""
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    path = validate({"target": args.target}).target_dir
    target = StaticTarget.wrap(TargetModel.load(path, args.dtype, args.device), compile=True,
                               regions=args.mode == "regions")
    t1 = time.perf_counter()
    rng = np.random.default_rng(0)
    target.prefill(rng.integers(0, target.vocab_size, args.ctx))
    per = {}
    for n in args.compile_bucket_list:
        ta = clock(args.device)
        target.tree_forward(random_tree(rng, n, target.vocab_size))
        per[n] = round(clock(args.device) - ta, 2)
        rewind(target, args.ctx)
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime  # C++ builds run in child processes
    from torch._dynamo.utils import compilation_time_metrics  # dynamo's and inductor's timed phases (nested)

    phases = sorted(((k, sum(v)) for k, v in compilation_time_metrics.items()), key=lambda kv: -kv[1])[:10]
    print(json.dumps({"load_s": round(t1 - t0, 2), "first_forward_s": per, "total_s": round(time.perf_counter() - t0, 2),
                      "cpu_s": round(cpu_s, 1), "peak_rss_mb": round(me.ru_maxrss / 1024),
                      "phases_s": {k: round(v, 2) for k, v in phases}}))


def compile_times(target: str, threads: int, ctx: int, device: str, mode: str, dtype: str, buckets: str) -> dict:
    """Cold: a fresh process on an empty inductor cache; warm: another fresh process on the same
    cache (this run's, ``TORCHINDUCTOR_CACHE_DIR``, emptied by ``run_target``)."""
    res = {}
    for kind in ("cold", "warm"):
        cmd = [sys.executable, __file__, "--probe", "--target", target, "--threads", str(threads), "--ctx", str(ctx),
               "--device", device, "--mode", mode, "--dtype", dtype, "--compile-buckets", buckets]
        t = time.perf_counter()
        out = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, check=True).stdout
        res[kind] = json.loads(out.strip().splitlines()[-1])
        res[kind]["process_s"] = round(time.perf_counter() - t, 2)  # with interpreter start and imports
        print(f"compile {mode} {kind}: {res[kind]}", flush=True)
    return res


def run_target(name: str, args) -> dict:
    """Each mode's probes on an empty cache of its own (cold means cold), then the timings in
    this process on the union of those caches (warm for every mode)."""
    with tempfile.TemporaryDirectory(prefix="inductor_") as root:
        compile_s = {}
        for mode in args.mode_list:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, mode)
            if not args.skip_compile_times:
                compile_s[mode] = compile_times(name, args.threads, args.ctx, args.device, mode, args.dtype,
                                                args.compile_buckets)
        merged = os.path.join(root, "all")
        for mode in args.mode_list:
            if os.path.isdir(os.path.join(root, mode)):
                shutil.copytree(os.path.join(root, mode), merged, dirs_exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = merged
        return measure_target(name, args, compile_s or None)


def measure_target(name: str, args, compile_s: dict | None) -> dict:
    torch.set_num_threads(args.threads)
    path = validate({"target": name}).target_dir
    eager = TargetModel.load(path, args.dtype, args.device)
    compiled = {f"compiled {m}": StaticTarget.wrap(eager, compile=True, regions=m == "regions")  # same weights
                for m in args.mode_list}

    def second(dtype: str = args.dtype, fp16_head: bool = False, hf_parts: bool = False, exact_parts: bool = False,
               fp16_kernel: bool = False, **kw) -> StaticTarget:  # a second copy: attention, kernel and options are per copy
        with mock.patch.object(exact_parts_module, "use_exact_parts", lambda model, prompts=True: (0, 0)) \
                if hf_parts else contextlib.nullcontext():
            t = TargetModel.load(path, dtype, args.device)
        if exact_parts:
            exact_parts_module.use_exact_parts(t.model)
        if fp16_head:
            packed_fp16_head(t.model)
        static = StaticTarget.wrap(t, compile=True, **kw)
        return with_fp16_kernel(static) if fp16_kernel else static

    variants = {  # label: (asked for, StaticTarget arguments)
        "repeat_kv": (args.repeat_kv_baseline, {"gqa": False}),
        "SDPA gqa": (args.sdpa_gqa_baseline, {"gqa_kernel": "sdpa"}),
        "Python kernel": (args.python_kernel_baseline, {"native": False}),
        "frozen": (args.frozen_variant, {"options": FROZEN_CPU_OPTIONS}),  # frozen graphs are not saved
        "unfrozen": (args.unfrozen_variant, {"options": CPU_OPTIONS}),
        str(args.options_variant): (args.options_variant, {"options": json.loads(args.options_variant or "{}")}),
        "dynamic": (args.dynamic_variant, {"dynamic": None}),  # meant as one graph past bucket 1; it was not (docs/compiled.md)
        "unfused": (args.unfused_baseline, {"fuse": False}),
        "fp16 head": (args.fp16_head_baseline, {"fp16_head": True}),
        "HF's norms and rotary": (args.hf_parts_baseline, {"hf_parts": True}),  # before exact_parts (q4, packed-fp16)
        "exact parts": (args.exact_parts_variant, {"exact_parts": True}),  # q4's norms and rotary on another dtype
        "power-of-two spans": (args.spans_baseline, {"one_span": False}),  # before one_span (fused op)
        "fp16 kernel": (args.fp16_kernel_variant, {"fp16_kernel": True}),  # SPECBLOCK_FP16_KERNEL=ours for this copy
        str(args.also_dtype): (args.also_dtype, {"dtype": args.also_dtype}),  # e.g. q4 beside packed-fp16
    }
    compiled.update({f"compiled whole, {label}": second(**kw) for label, (asked, kw) in variants.items() if asked})
    sizes = args.size_list
    first_s: dict[str, list[float]] = {}
    t_ms = time_trees({"eager": eager, **compiled}, args.ctx, sizes, args.reps, first=first_s)
    bw = bandwidth_gbs(args.device)
    wbytes = weight_bytes(eager.model)
    floor_ms = wbytes / (bw * 1e9) * 1e3
    # a copy in another dtype reads other bytes (packed-q4: its 4-bit codes), so its own floor
    other_mb = {k: round(weight_bytes(t.model) / 2**20, 1) for k, t in compiled.items()
                if weight_bytes(t.model) != wbytes}
    prompt = np.random.default_rng(1).integers(3, eager.vocab_size, args.prompt_len)
    hf_also = {d: TargetModel.load(path, d, args.device).model for d in args.hf_also_dtype_list}
    decoding = None if args.skip_decoding else time_decoding(eager, compiled, prompt, args.tokens, args.runs, hf_also)
    return {
        "target": name, "device": str(eager.device), "layers": int(eager.config.num_hidden_layers), "weights_mb": round(wbytes / 2**20, 1),
        "ctx": args.ctx, "n": sizes, "T_ms": t_ms, "modes": args.mode_list,
        "T_ratio_eager_over_compiled": {k: [round(a / b, 2) for a, b in zip(t_ms["eager"], t_ms[k])] for k in compiled},
        "bandwidth_gbs": round(bw, 1), "floor_ms": round(floor_ms, 3),
        "T1_over_floor": {k: round(v[0] / (floor_ms * other_mb[k] * 2**20 / wbytes if k in other_mb else floor_ms), 2)
                          for k, v in t_ms.items()},
        "weights_mb_of": other_mb,
        "decoding": decoding, "compile_s": compile_s, "first_forward_s": first_s,
    }


def goal_lines(r: dict) -> list[str]:
    """Issue 16's plain-decoding goal (1.8x HF generate's best mode) in per-token terms: the ms a
    token ours must reach, beside the bandwidth floor that no decoder on this CPU goes below."""
    d = r["decoding"]
    hf = {k: v["decode_ms_per_token"] for k, v in d.items() if k.startswith("hf ") and "(" not in k and "decode_ms_per_token" in v}
    if not hf or "decode_ms_per_token" not in d.get("ours compiled", {}):
        return []
    best = min(hf, key=hf.get)
    need, ours = hf[best] / 1.8, d["ours compiled"]["decode_ms_per_token"]
    lines = [f"Per token after the first: HF's best mode ({best}) {hf[best]:.2f} ms, ours compiled {ours:.2f} ms "
             f"({hf[best] / ours:.2f}x). 1.8x HF's best needs {need:.2f} ms a token; the bandwidth floor is "
             f"{r['floor_ms']:.2f} ms ({need / r['floor_ms']:.2f}x the floor).", ""]
    for k, mb in r.get("weights_mb_of", {}).items():  # a copy that reads other bytes: its own figures
        row = d.get(f"ours {k}", {})
        if "decode_ms_per_token" in row:
            floor = r["floor_ms"] * mb / r["weights_mb"]
            lines += [f"{k} ({mb} MB read a forward): {row['decode_ms_per_token']:.2f} ms a token, "
                      f"{hf[best] / row['decode_ms_per_token']:.2f}x HF's best mode; its bandwidth floor "
                      f"{mb} MB / {r['bandwidth_gbs']} GB/s = {floor:.2f} ms.", ""]
    return lines


def markdown(results: list[dict], args) -> str:
    where = f"this CPU, {args.threads} threads" if args.device == "cpu" else "CUDA"
    lines = [f"Compiled vs eager target, {args.dtype}, {where} (`python experiments/compiled_speed.py --device {args.device} "
             f"--dtype {args.dtype} "
             f"--targets {args.targets} --modes {args.modes} --sizes {args.sizes} --threads {args.threads} --reps {args.reps} "
             f"--runs {args.runs} --tokens {args.tokens}{' --skip-compile-times' if args.skip_compile_times else ''}"
             f"{'' if args.ctx == 192 else f' --ctx {args.ctx}'}{'' if args.prompt_len == 128 else f' --prompt-len {args.prompt_len}'}"
             f"{'' if args.compile_bucket_list == list(BUCKETS) else ' --compile-buckets ' + args.compile_buckets}"
             f"{' --repeat-kv-baseline' if args.repeat_kv_baseline else ''}"
             f"{' --sdpa-gqa-baseline' if args.sdpa_gqa_baseline else ''}"
             f"{' --python-kernel-baseline' if args.python_kernel_baseline else ''}"
             f"{' --unfused-baseline' if args.unfused_baseline else ''}"
             f"{' --fp16-head-baseline' if args.fp16_head_baseline else ''}"
             f"{' --hf-parts-baseline' if args.hf_parts_baseline else ''}"
             f"{' --exact-parts-variant' if args.exact_parts_variant else ''}"
             f"{' --spans-baseline' if args.spans_baseline else ''}"
             f"{' --fp16-kernel-variant' if args.fp16_kernel_variant else ''}"
             f"{' --frozen-variant' if args.frozen_variant else ''}"
             f"{' --unfrozen-variant' if args.unfrozen_variant else ''}"
             f"{' --dynamic-variant' if args.dynamic_variant else ''}"
             f"{f' --options-variant {chr(39)}{args.options_variant}{chr(39)}' if args.options_variant else ''}"
             f"{f' --also-dtype {args.also_dtype}' if args.also_dtype else ''}"
             f"{f' --hf-also-dtypes {args.hf_also_dtypes}' if args.hf_also_dtypes else ''}"
             f"{' --skip-decoding' if args.skip_decoding else ''} --out {args.out}`).", ""]
    for r in results:
        lines += [f"## {r['target']} ({r['layers']} layers, {r['weights_mb']} MB of weights)", "",
                  f"T(n) at context {r['ctx']}, median of {args.reps} interleaved forwards:", "",
                  "| n | " + " | ".join(str(n) for n in r["n"]) + " |", "|---" * (len(r["n"]) + 1) + "|"]
        for k, v in r["T_ms"].items():
            lines.append(f"| {k} ms | " + " | ".join(f"{x:.2f}" for x in v) + " |")
        for k, v in r["T_ratio_eager_over_compiled"].items():
            lines.append(f"| eager / {k} | " + " | ".join(f"{x:.2f}x" for x in v) + " |")
        for k, v in r.get("first_forward_s", {}).items():  # in this process, sizes in the order above
            if k != "eager":
                lines.append(f"| {k}: first forward s | " + " | ".join(f"{x:.1f}" for x in v) + " |")
        floors = ", ".join(f"{v:.1f}x {k}" + (f" (over its own floor, {r['weights_mb_of'][k]} MB)"
                                                if k in r.get("weights_mb_of", {}) else "")
                           for k, v in r["T1_over_floor"].items())
        lines += ["", f"Bandwidth floor: {r['weights_mb']} MB / {r['bandwidth_gbs']} GB/s = {r['floor_ms']:.2f} ms; "
                  f"T({r['n'][0]}) is {floors}.", ""]
        if r["decoding"]:
            lines += [f"Plain decoding, {args.tokens} new tokens after a {args.prompt_len}-token prompt (prefill included), "
                      f"median of {args.runs} interleaved runs:", "",
                      f"| decoder | tokens/s | ms a token after the first | first call s | tokens equal to HF plain's / "
                      f"ours eager's (of {args.tokens}) |",
                      "|---|---|---|---|---|"]
            for k, d in r["decoding"].items():
                ms = f"{d['decode_ms_per_token']:.2f}" if "decode_ms_per_token" in d else "-"
                lines.append(f"| {k} | {d['tokens_per_s']:.1f} | {ms} | {d['first_call_s']:.1f} | "
                             f"{d['common_prefix_with_hf_plain']} / {d['common_prefix_with_ours_eager']} |")
            lines += ["", *goal_lines(r)]
        for mode, c in (r["compile_s"] or {}).items():
            lines += ["", f"Compile time, {mode} (fresh process; load, then the first forward of each bucket "
                      f"{args.compile_bucket_list}): cold {c['cold']['total_s']:.1f} s (empty inductor cache), "
                      f"warm {c['warm']['total_s']:.1f} s (same cache); per bucket cold {c['cold']['first_forward_s']}, "
                      f"warm {c['warm']['first_forward_s']}; CPU time (all threads and compiler processes) cold "
                      f"{c['cold'].get('cpu_s', '-')} s, warm {c['warm'].get('cpu_s', '-')} s; peak RSS {c['cold'].get('peak_rss_mb', '-')} MB; "
                      f"whole process with interpreter start and imports cold {c['cold'].get('process_s', '-')} s, "
                      f"warm {c['warm'].get('process_s', '-')} s."]
            for kind in ("cold", "warm"):
                if c[kind].get("phases_s"):
                    lines += ["", f"Longest timed compile phases, {kind} (seconds, nested: an outer phase includes inner ones): "
                              + ", ".join(f"`{k}` {v}" for k, v in c[kind]["phases_s"].items())]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="lab")
    ap.add_argument("--target", help=argparse.SUPPRESS)  # --probe's target
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPE_CHOICES, help="the target's dtype (auto: resolved here)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=192, help="cached tokens for T(n); 192 + 64 keeps one attention span")
    ap.add_argument("--skip-compile-times", action="store_true")
    ap.add_argument("--skip-decoding", action="store_true", help="no plain-decoding tokens/s (HF's compiled generate is slow to build)")
    ap.add_argument("--repeat-kv-baseline", action="store_true",
                    help="also time a compiled target with HF's repeat_kv attention (before compiled/gqa.py)")
    ap.add_argument("--sdpa-gqa-baseline", action="store_true",
                    help="also time a compiled target with SDPA attention (grouped heads in place up to 4 rows; before "
                         "the math kernel of compiled/gqa.py)")
    ap.add_argument("--python-kernel-baseline", action="store_true",
                    help="also time a compiled target whose packed linears call the Python kernel (before compiled/native.py)")
    ap.add_argument("--frozen-variant", action="store_true",
                    help="also time a compiled target with inductor's freezing (FROZEN_CPU_OPTIONS, the default until saved graphs)")
    ap.add_argument("--unfrozen-variant", action="store_true",
                    help="also time a second compiled target without freezing (CPU_OPTIONS, as the default now is)")
    ap.add_argument("--options-variant", metavar="JSON", help="also time a compiled target with these inductor options")
    ap.add_argument("--dynamic-variant", action="store_true",
                    help="also time a compiled target with dynamic=None (tried for one graph per size past 1; it did not)")
    ap.add_argument("--unfused-baseline", action="store_true",
                    help="also time a compiled target without q/k/v and gate/up fusion (before compiled/fuse.py)")
    ap.add_argument("--fp16-head-baseline", action="store_true",
                    help="q4: also time a compiled target whose LM head is packed fp16 (before the GGUF's Q8_0 head)")
    ap.add_argument("--hf-parts-baseline", action="store_true",
                    help="q4 on the int8 kernel, packed-fp16: also time a compiled target with HF's RMSNorm and rotary "
                         "(before exact_parts)")
    ap.add_argument("--exact-parts-variant", action="store_true",
                    help="float32: also time a compiled target with q4's exact parts (one C++ RMSNorm, rotary from a "
                         "table); packed-fp16 has them since stop 62, so there --hf-parts-baseline is the comparison")
    ap.add_argument("--spans-baseline", action="store_true",
                    help="also time a compiled target on power-of-two spans where the fused op allows the whole buffer")
    ap.add_argument("--fp16-kernel-variant", action="store_true",
                    help="also time a compiled copy whose packed linears run the fp16 kernel (SPECBLOCK_FP16_KERNEL=ours)")
    ap.add_argument("--also-dtype", choices=DTYPE_CHOICES, help="also time a compiled copy of the target in this dtype")
    ap.add_argument("--hf-also-dtypes", default="",
                    help="HF generate also on copies of the model in these dtypes (e.g. bfloat16: the issue's reference)")
    ap.add_argument("--compile-buckets", default=",".join(map(str, BUCKETS)),
                    help="the buckets whose first forward the compile-time probes time (plain decoding needs 1 only)")
    ap.add_argument("--modes", default="whole", help="compile modes side by side: regions, whole or both")
    ap.add_argument("--mode", default="whole", choices=["regions", "whole"], help=argparse.SUPPRESS)  # --probe's mode
    ap.add_argument("--sizes", default=",".join(map(str, BUCKETS)), help="tree sizes n for T(n)")
    ap.add_argument("--out", type=Path, default=Path("experiments/results/compiled_speed"))
    args = ap.parse_args()
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.dtype = resolve_dtype(args.dtype, args.device)  # the table names what ran, never "auto"
    args.size_list = [int(n) for n in args.sizes.split(",")]
    args.hf_also_dtype_list = [d for d in args.hf_also_dtypes.split(",") if d]
    args.compile_bucket_list = [int(n) for n in args.compile_buckets.split(",")]
    if args.probe:
        return probe(args)
    results = [run_target(t.strip(), args) for t in args.targets.split(",") if t.strip()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps({"threads": args.threads, "results": results}, indent=1) + "\n"),
                         (".md", markdown(results, args))):
        tmp = args.out.with_name(args.out.name + suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(args.out.with_name(args.out.name + suffix))
    print(markdown(results, args))


if __name__ == "__main__":
    main()
