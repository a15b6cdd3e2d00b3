"""Load test of ``python -m specblock.serve`` on the loopback address: ar against the best method.

Each method gets a server started as a subprocess (the command users run); all stay up, and at
each of 1, 4 and 16 concurrent closed-loop clients (the official ``openai`` client, streaming,
over the bench prompts of every domain, ``specblock.prompts``) the methods take turns,
``--rounds`` times in alternating order, so a shared machine's load falls on all alike. Per level it reports throughput
(completion tokens / wall time), time to first token and time per output token (p50 and p95,
measured by the client from the first to the last streamed token), mean tau, errors, and
"mismatched": greedy answers that differ from the same method's 1-client answer to the same
prompt (a lost, duplicated or mixed-up response would show there).

``--adapt``: the SpecBlock drafter with and without serving-time adaptation, one client, the
prompts served ``--adapt-rounds`` times, reported window by window (``--adapt-window-requests``
requests each): tau, time per output token, and the server's adaptation updates and rollbacks
(from its /metrics) so far.

    python experiments/serve_load.py --target lab --prompts 2 --max-tokens 64
    python experiments/serve_load.py --target lab --adapt --prompts 2

Each server runs with OMP_NUM_THREADS=--threads (default 1: the machine is shared); the load is
bounded by --prompts, --max-tokens and the levels. Results: experiments/results/serve_load.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specblock.atomic import check_output, write_atomic  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="lab", help="a model name or directory (as --target of the server)")
    ap.add_argument("--methods", default="ar,lookup", help="comma-separated; the first is the baseline")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--domains", default="code,math,chat,qa,mtbench")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per domain")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-requests", type=int, default=2, help="a level sends at least this many per client")
    ap.add_argument("--rounds", type=int, default=2, help="turns per method at each level (alternating order)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each server")
    ap.add_argument("--server-args", default="", help="extra flags for every server, e.g. '--budget 16'")
    ap.add_argument("--adapt", action="store_true", help="instead: specblock vs specblock --adapt, window by window")
    ap.add_argument("--adapt-rounds", type=int, default=3, help="--adapt: times the prompt list is served")
    ap.add_argument("--adapt-window-requests", type=int, default=5)
    ap.add_argument("--out", type=Path, help="results stem (default experiments/results/serve_load, "
                    "serve_load_adapt with --adapt)")
    return ap


# -- one server ------------------------------------------------------------------------------------


class Server:
    """``python -m specblock.serve`` as a subprocess; stopped with SIGTERM (it must exit 0)."""

    def __init__(self, target: str, method: str, dtype: str, threads: int, extra: list[str]) -> None:
        cmd = [sys.executable, "-m", "specblock.serve", "--target", target, "--method", method, "--dtype", dtype,
               "--port", "0", "--max-queue", "256", *extra]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
        self.cmd = " ".join(cmd[1:])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.proc.wait(30)
            raise SystemExit(f"server did not start: {self.proc.stderr.read().strip()}")
        self.base = line.split("listening on ")[1].split()[0]  # http://127.0.0.1:PORT/v1
        self.model = line.split("(model ")[1].split(",")[0]

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.base.removesuffix("/v1") + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


# -- requests --------------------------------------------------------------------------------------


def load_requests(target: str, domains: list[str], n: int) -> tuple[bool, list[dict]]:
    """The bench prompts as the bench encodes them: one user turn for a chat model (its
    instruction), the lab-format text through /v1/completions otherwise."""
    from specblock.models import resolve_target
    from specblock.prompts import load_prompts
    from specblock.runtime.chat import has_template
    from specblock.runtime.cli import load_tokenizer

    chat = has_template(load_tokenizer(resolve_target(target), False))
    reqs = []
    for d in domains:
        for p in load_prompts(d, n):
            text = (getattr(p, "instruction", None) or p.text) if chat else p.text
            reqs.append({"id": p.id, "domain": d, "text": text})
    return chat, reqs


def one_request(client, model: str, chat: bool, text: str, max_tokens: int) -> dict:
    """Stream one greedy answer; client-side times of the first and last token."""
    t0 = time.perf_counter()
    first = last = None
    parts, usage, spec = [], None, None
    kw = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True})
    try:
        if chat:
            stream = client.chat.completions.create(messages=[{"role": "user", "content": text}], **kw)
        else:
            stream = client.completions.create(prompt=text, **kw)
        for ch in stream:
            piece = (ch.choices[0].delta.content if chat else ch.choices[0].text) if ch.choices else None
            if piece:
                now = time.perf_counter()
                first, last = first or now, now
                parts.append(piece)
            extra = ch.model_extra or {}
            spec = extra.get("speculative", spec)
            usage = ch.usage or usage
    except Exception as e:  # counted, never raised: the load test reports errors
        return {"error": f"{type(e).__name__}: {e}"}
    n = usage.completion_tokens if usage else 0
    return {"text": "".join(parts), "tokens": n, "ttft": (first - t0) if first else None,
            "tpot": (last - first) / (n - 1) if first and n > 1 else None, "tau": spec["tau"] if spec else None}


def level(server: Server, chat: bool, reqs: list[dict], clients: int, args) -> tuple[list[dict], float]:
    """Closed loop: ``clients`` workers, each sends its next request as soon as its last ends."""
    import openai

    total = max(len(reqs), clients * args.min_requests)
    order = [reqs[i % len(reqs)] for i in range(total)]
    client = openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda r: {**one_request(client, server.model, chat, r["text"], args.max_tokens),
                                           "id": r["id"]}, order))
    return results, time.perf_counter() - t0


def summarize(clients: int, results: list[dict], wall: float, reference: dict[str, str]) -> dict:
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    row = {"clients": clients, "requests": len(results), "errors": len(results) - len(ok), "wall_s": round(wall, 3),
           "throughput_tok_s": round(tokens / wall, 2), "completion_tokens": tokens,
           **pcts("ttft_s", [r["ttft"] for r in ok]), **pcts("tpot_ms", [1e3 * r["tpot"] for r in ok if r["tpot"]]),
           "tau": round(statistics.fmean([r["tau"] for r in ok if r["tau"]]), 3) if ok else None}
    for r in ok:
        reference.setdefault(r["id"], r["text"])  # the first (1-client) answer is the reference
    row["mismatched"] = sum(1 for r in ok if r["text"] != reference[r["id"]])
    if len(ok) < len(results):
        row["first_error"] = next(r["error"] for r in results if "error" in r)
    return row


def pcts(name: str, xs: list[float]) -> dict:
    if not xs:
        return {f"{name}_p50": None, f"{name}_p95": None}
    xs = sorted(xs)
    p95 = xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]
    return {f"{name}_p50": round(statistics.median(xs), 4), f"{name}_p95": round(p95, 4)}


# -- the two experiments ---------------------------------------------------------------------------


def run_levels(args, chat: bool, reqs: list[dict]) -> dict:
    """Every method's server is up for the whole run (idle, one costs no CPU) and the methods take
    turns at each level, in alternating order over rounds, so a shared machine's changing load
    falls on all of them alike."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    levels = [int(c) for c in args.clients.split(",")]
    servers = {m: Server(args.target, m, args.dtype, args.threads, args.server_args.split()) for m in methods}
    out: dict = {"methods": {m: {"rows": [], "command": servers[m].cmd} for m in methods}, "levels": levels}
    try:
        warm = argparse.Namespace(**{**vars(args), "min_requests": 1})
        for m in methods:
            level(servers[m], chat, reqs[:1], 1, warm)
        reference: dict[str, dict[str, str]] = {m: {} for m in methods}
        for c in levels:
            pooled = {m: ([], 0.0) for m in methods}
            for r in range(args.rounds):
                for m in methods if r % 2 == 0 else methods[::-1]:
                    results, wall = level(servers[m], chat, reqs, c, args)
                    pooled[m] = (pooled[m][0] + results, pooled[m][1] + wall)
            for m in methods:
                row = summarize(c, *pooled[m], reference[m])
                out["methods"][m]["rows"].append(row)
                print(json.dumps({"method": m, **row}), flush=True)
        for m, server in servers.items():
            counts = {k.split('status="')[1].rstrip('"}'): v for k, v in server.metrics().items()
                      if k.startswith("specblock_requests_total") and v}
            out["methods"][m]["server_status_counts"] = counts
    finally:
        for m, server in servers.items():
            out["methods"][m]["exit_code"] = server.stop()
    base, best = methods[0], methods[-1]
    b1 = out["methods"][base]["rows"][0]
    s1 = out["methods"][best]["rows"][0]
    if b1["tpot_ms_p50"] and s1["tpot_ms_p50"]:
        out[f"tpot_p50_ratio_at_{levels[0]}_clients"] = round(b1["tpot_ms_p50"] / s1["tpot_ms_p50"], 3)
    return out


def run_adapt(args, chat: bool, reqs: list[dict]) -> dict:
    import openai

    out = {}
    for label, extra in (("specblock", []), ("specblock --adapt", ["--adapt"])):
        server = Server(args.target, "specblock", args.dtype, args.threads, args.server_args.split() + extra)
        client = openai.OpenAI(base_url=server.base, api_key="unused", max_retries=0, timeout=600)
        stream = [r for _ in range(args.adapt_rounds) for r in reqs]
        windows, w = [], args.adapt_window_requests
        for i in range(0, len(stream), w):
            res = [one_request(client, server.model, chat, r["text"], args.max_tokens) for r in stream[i:i + w]]
            ok = [r for r in res if "error" not in r]
            m = server.metrics()
            windows.append({"window": i // w, "requests": len(res), "errors": len(res) - len(ok),
                            "tau": round(statistics.fmean(r["tau"] for r in ok), 3) if ok else None,
                            **pcts("tpot_ms", [1e3 * r["tpot"] for r in ok if r["tpot"]]),
                            "adapt_updates": m.get("specblock_adapt_updates_total", 0.0),
                            "adapt_rollbacks": m.get("specblock_adapt_rollbacks_total", 0.0)})
            print(json.dumps({"server": label, **windows[-1]}), flush=True)
        out[label] = {"windows": windows, "command": server.cmd, "exit_code": server.stop()}
    return out


def markdown(res: dict) -> str:
    a = res["args"]
    lines = [f"# Serving load test ({a['target']}, {a['dtype']}, {a['max_tokens']} new tokens, "
             f"{a['prompts']} prompts x {len(a['domains'].split(','))} domains, "
             + (f"{a['rounds']} rounds, " if "levels" in res else f"{a['adapt_rounds']} passes, ")
             + f"OMP_NUM_THREADS={a['threads']})", "",
             f"`{res['command']}`", ""]
    if "levels" in res:
        lines += ["| method | clients | requests | errors | mismatched | tok/s | TTFT p50 / p95 (s) | "
                  "TPOT p50 / p95 (ms) | tau |", "|---|---|---|---|---|---|---|---|---|"]
        for m, r in res["methods"].items():
            for row in r["rows"]:
                lines.append(f"| {m} | {row['clients']} | {row['requests']} | {row['errors']} | {row['mismatched']} | "
                             f"{row['throughput_tok_s']} | {row['ttft_s_p50']} / {row['ttft_s_p95']} | "
                             f"{row['tpot_ms_p50']} / {row['tpot_ms_p95']} | {row['tau']} |")
        lines += [""] + [f"- {m}: server exit code {r['exit_code']} after SIGTERM; status counts "
                         f"{r['server_status_counts']}" for m, r in res["methods"].items()]
        for key in (k for k in res if k.startswith("tpot_p50_ratio_at_")):
            lines.append(f"- p50 time per output token at {key.split('_')[4]} client(s), "
                         f"{a['methods'].split(',')[0]} / {a['methods'].split(',')[-1]}: {res[key]}x")
    else:
        lines += ["| server | window | requests | errors | tau | TPOT p50 (ms) | adapt updates | rollbacks |",
                  "|---|---|---|---|---|---|---|---|"]
        for label, r in res["adapt"].items():
            for w in r["windows"]:
                lines.append(f"| {label} | {w['window']} | {w['requests']} | {w['errors']} | {w['tau']} | "
                             f"{w['tpot_ms_p50']} | {w['adapt_updates']:.0f} | {w['adapt_rollbacks']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out = args.out or ROOT / "experiments" / "results" / ("serve_load_adapt" if args.adapt else "serve_load")
    for suffix in (".json", ".md"):
        check_output(args.out.with_suffix(suffix), "--out", make_parents=True)
    chat, reqs = load_requests(args.target, [d.strip() for d in args.domains.split(",")], args.prompts)
    res = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "command": "python experiments/serve_load.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "api": "chat" if chat else "completions"}
    res.update({"adapt": run_adapt(args, chat, reqs)} if args.adapt else run_levels(args, chat, reqs))
    write_atomic(args.out.with_suffix(".json"), json.dumps(res, indent=2) + "\n")
    write_atomic(args.out.with_suffix(".md"), markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
