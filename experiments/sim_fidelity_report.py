"""``experiments/sim_fidelity.py``'s outputs: the JSON, CSV, Markdown and PNG of one comparison
(measured against simulated rows, the latency fit per row, what was skipped and why)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

#: The goal: |Spd err| and |tau err| within these (relative) of the measured row.
SPD_TOL, TAU_TOL = 0.10, 0.05

CSV_COLS = ["method", "domain", "spd_meas", "spd_sim", "spd_err", "tau_meas", "tau_sim", "tau_err", "goal_met", "spd_runs",
            "spd_basis", "spd_wall_meas", "spd_dec_meas", "tree_meas", "tree_sim", "draft_ms_meas", "draft_ms_sim", "verify_ms_meas",
            "verify_ms_sim", "glue_ms_meas", "glue_ms_sim", "ar_ms_meas", "ar_ms_sim", "ctx_mean", "prompt_len", "tokens"]


def _runs(mm: list | None) -> str:
    return "-" if not mm else f"{mm[0]:.2f}-{mm[1]:.2f}x"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def markdown(res: dict) -> str:
    g = res["goal"]
    lines = [f"Goal: |Spd err| <= {100 * g['spd_tol']:.0f}% and |tau err| <= {100 * g['tau_tol']:.0f}%: "
             f"met in {g['met']} of {g['rows']} (method, domain) rows.", "",
             "| method | domain | Spd meas | Spd sim | err | tau meas | tau sim | err | goal | Spd runs min-max | Spd wall "
             "| Spd dec. run 1 | draft ms m/s | verify ms m/s | glue ms m/s | AR ms m/s | tree m/s |", "|---" * 17 + "|"]
    f = lambda a, b: "-" if a is None else f"{a:.2f} / {b:.2f}"
    for r in res["rows"]:
        lines.append(f"| {r['method']} | {r['domain']} | {r['spd_meas']:.3f}x | {r['spd_sim']:.3f}x | {_pct(r['spd_err'])} "
                     f"| {r['tau_meas']:.3f} | {r['tau_sim']:.3f} | {_pct(r['tau_err'])} | {'yes' if r['goal_met'] else 'no'} "
                     f"| {_runs(r.get('spd_runs'))} | {r.get('spd_wall_meas', r['spd_meas']):.3f}x "
                     f"| {'-' if r['spd_dec_meas'] is None else format(r['spd_dec_meas'], '.3f') + 'x'} "
                     f"| {f(r['draft_ms_meas'], r['draft_ms_sim'])} | {f(r['verify_ms_meas'], r['verify_ms_sim'])} "
                     f"| {f(r['glue_ms_meas'], r['glue_ms_sim'])} | {f(r['ar_ms_meas'], r['ar_ms_sim'])} "
                     f"| {f(r['tree_meas'], r['tree_sim'])} |")
    if res.get("draft_overhead_ms_traces") is not None:
        lines.append(f"\nHost work per SpecBlock forward beside the network (traces, least squares): "
                     f"{res['draft_overhead_ms_traces']:.2f} ms; charged in the sim instead of calibrate's: "
                     f"{'yes' if res['inputs'].get('draft_overhead') == 'traces' else 'no'}.")
    if res["inputs"].get("latency_from") == "traces":
        lines.append(f"\nLatency: fitted from runtime traces (--latency-from traces), split: "
                     f"{res.get('trace_latency_split')}: each row is priced by a fit on the other domains' traces "
                     "(tree forward a + b*n + c*ctx from verify_s, all methods on the same target, compiled or eager; "
                     "AR ms/token a + c*ctx from the row's plain decoding; glue = "
                     "mean commit_s of the row's method; SpecBlock: calibrate's drafter curve plus a fitted host cost per "
                     "forward (+); EAGLE-3, SpS, Medusa: draft_s / forwards, all-in, forwards = the depths EAGLE-3 expands "
                     "(its configured depth cut to the node budget), the chain's depth for SpS, 1 for Medusa). lookup's "
                     "replay uses its own n-gram search times.")
        lines += ["", "| method | domain | fit domains | tree ms a / b per n / c per ctx | AR ms a / c per ctx | glue ms | draft ms/fwd |",
                  "|---" * 7 + "|"]
        for r in res["rows"]:
            fz = r.get("latency_fit")
            if fz:
                a, b, c = fz["tree_ms_a_b_c"]
                oh = "-" if fz["draft_overhead_ms"] is None else f"+{fz['draft_overhead_ms']:.2f}"
                if fz.get("draft_ms_per_forward") is not None:
                    oh = f"{fz['draft_ms_per_forward']:.2f} all-in"
                lines.append(f"| {r['method']} | {r['domain']} | {','.join(fz['fit_domains'])} | {a:.2f} / {b:.3f} / "
                             f"{1e3 * c:.2f}e-3 | {fz['ar_ms_a_c'][0]:.2f} / {1e3 * fz['ar_ms_a_c'][1]:.2f}e-3 "
                             f"| {fz['glue_ms']:.2f} | {oh} |")
    for s in res["skipped"]:
        tau = "-" if s["tau_meas"] is None else f"{s['tau_meas']:.3f}"
        lines.append(f"\nSkipped {s['method']}/{s['domain']} (measured {s['spd_meas']:.3f}x / tau {tau}): {s['reason']}")
    basis = {r.get("spd_basis", "wall") for r in res["rows"]}
    judged = ("the bench's decode-loop Spd (speedup_decode: prefill excluded, median of its runs)" if basis == {"decode"}
              else "the bench's wall-clock Spd (prefill included: this bench JSON has no speedup_decode)")
    lines += ["", f"Spd meas (judged): {judged}; Spd runs min-max: the same Spd in each of the bench's runs, the "
              "measurement's own repeatability; Spd wall: the bench's headline Spd (prefill included); Spd dec. run 1: "
              "decode loop only, from run-1 traces; the sim's Spd is decode only. m/s: measured per iteration (traces) / simulated; the measured "
              "verify ms includes greedy verification, which calibrate counts in the glue (overhead_ms)."]
    refs = sorted({r["baseline"] for r in res["rows"] if r.get("baseline", "ar") != "ar"})
    if refs:
        lines += ["", f"Compiled methods are judged against compiled plain decoding ({', '.join(refs)}: every Spd, "
                  "measured and simulated, and the AR ms, over that row, which ran in the same interleaved runs; the "
                  "bench's own Spd over eager ar is that times the compiled ar row's)."]
    lines += [f"\nWarning: {w}" for w in res["warnings"]]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str = "sim fidelity: cpu-calibrated sim vs runtime bench") -> None:
    """Simulated against measured Spd and tau, with the goal's tolerance band around y = x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2))
    for ax, k, tol, lab in ((axes[0], "spd", SPD_TOL, "Spd"), (axes[1], "tau", TAU_TOL, "tau")):
        xs = [r[f"{k}_meas"] for r in rows]
        ys = [r[f"{k}_sim"] for r in rows]
        lo, hi = (0.9 * min(xs + ys), 1.1 * max(xs + ys)) if rows else (0.5, 2.0)
        line = np.linspace(lo, hi, 2)
        ax.plot(line, line, "k-", lw=0.8)
        ax.fill_between(line, line * (1 - tol), line * (1 + tol), color="g", alpha=0.15, label=f"±{100 * tol:.0f}%")
        for r, x, y in zip(rows, xs, ys):
            ax.scatter(x, y, color="tab:green" if abs(r[f"{k}_err"]) <= tol else "tab:red", zorder=3)
            ax.annotate(f"{r['method']}/{r['domain']}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set(xlim=(lo, hi), ylim=(lo, hi), xlabel=f"measured {lab}", ylabel=f"simulated {lab}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(res: dict, out: Path) -> list[Path]:
    out.parent.mkdir(parents=True, exist_ok=True)
    files = [out.with_suffix(s) for s in (".json", ".csv", ".md", ".png")]
    files[0].write_text(json.dumps(res, indent=1) + "\n")
    with files[1].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLS, extrasaction="ignore")
        w.writeheader()
        w.writerows(res["rows"])
    files[2].write_text(markdown(res))
    plot(res["rows"], files[3], *([f"sim fidelity: trace-fitted latency ({res.get('trace_latency_split')}) vs runtime bench"]
                                   if res["inputs"].get("latency_from") == "traces" else []))
    return files
