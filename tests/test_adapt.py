"""Serving-time adaptation: the signal is what verification computed, outputs stay identical to
greedy decoding while updates land mid-query, a crashed update is reported once and serving goes
on, a harmful update is rolled back within three windows, and the bandit skips updates that cost
more than they gain. (Bandit and rollback rules alone: test_bandit.py, test_rollback.py.)"""

import copy
import json
import logging
import threading
import time

import numpy as np
import pytest
import torch

from specblock.policies.branching import RankBucketBranching
from specblock.runtime.adapt import Adapter, AdaptSettings
from specblock.runtime.adapt_signal import block1_rows
from specblock.runtime.drafters.specblock import SpecBlockDrafter
from specblock.runtime.drafters.specblock_net import SpecBlockConfig, SpecBlockNet
from specblock.runtime.engine import Engine
from specblock.q4file import quantize_q8_0
from specblock.runtime import packed, q4, q4_kernel
from specblock.runtime.drafters import pack_drafter
from specblock.runtime.target import TargetModel, default_taps
from specblock.training.specblock_step import first_block, target_pass
from tiny import hf_greedy, save_tiny, tiny_model
from tiny import run_cli as cli

V = 32
GOOD_BUCKETS = torch.tensor([0.0, 0.0, 20.0, 0.0])  # always b2: wide trees, tau well above 1
CUT_BUCKETS = torch.tensor([-20.0, -20.0, -20.0, 20.0])  # always b3: width 0, root-only trees


def make_net(target_model, taps, seed=0) -> SpecBlockNet:
    cfg = SpecBlockConfig(vocab_size=V, hidden_size=32, num_heads=4, intermediate_size=64, tap_layers=taps)
    torch.manual_seed(seed)
    net = SpecBlockNet(cfg)
    net.tie_to_target(target_model)
    with torch.no_grad():
        net.rank_head[2].bias.copy_(GOOD_BUCKETS)
    return net.eval()


def setup(seed=0, clock=time.perf_counter, pack=False, **kw):
    model = tiny_model("llama", vocab=V, seed=seed, layers=3)
    target = TargetModel(model)
    net = make_net(model, target.tap_layers, seed)
    drafter = SpecBlockDrafter(net, policy=RankBucketBranching((2, 4, 10, 0)))
    if pack:  # as drafters.build packs it beside a packed-fp16 target ("int8": beside a q4 one on the int8 kernel)
        pack_drafter(drafter, int8=pack == "int8")
    settings = AdaptSettings(**{"window": 3, "steps": 1, "batch": 2, "buffer": 8, "max_ctx": 64, "top_k": 8, **kw})
    adapter = Adapter(drafter, settings, clock=clock)
    return model, target, adapter, Engine(target, adapter, budget=16)


class VirtualClock:
    """Time that moves by ``tick`` per reading and by whatever a fake update spends: the
    bandit's costs are then the same on every machine."""

    def __init__(self, tick: float = 0.01) -> None:
        self.now, self.tick, self._lock = 0.0, tick, threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self.now += self.tick
            return self.now

    def spend(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


def prompts(n=4, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, V, int(rng.integers(1, 12))) for _ in range(n)]


def test_block1_rows_is_first_block_on_those_rows():
    model = tiny_model("qwen2", vocab=V, layers=3)
    net = make_net(model, TargetModel(model).tap_layers)
    tokens = torch.as_tensor(np.random.default_rng(1).integers(2, V, 20))[None]
    with torch.no_grad():
        tp = target_pass(model, tokens, TargetModel(model).tap_layers)
        full, _ = first_block(net, tp.taps, tokens)
        rows = torch.tensor([0, 5, 6, 17])
        torch.testing.assert_close(block1_rows(net, tp.taps, tokens, rows), full[0, rows], atol=1e-5, rtol=1e-5)


def test_signal_is_what_verification_computed():
    """Taps at every committed position and the target's top-k at every generated one, equal to
    a fresh full-sequence target pass: the signal needs no extra target forward."""
    model, target, adapter, engine = setup(arms=("skip",))
    prompt = prompts(1, seed=3)[0]
    res = engine.generate(prompt, 20)
    rec = adapter.record
    tokens, taps = rec.tokens_and_taps()
    assert tokens.tolist() == prompt.tolist() + res.token_ids[: len(tokens) - len(prompt)]
    with torch.no_grad():
        ref = target_pass(model, torch.as_tensor(tokens)[None], target.tap_layers)
    torch.testing.assert_close(taps, ref.taps[0, :-1], atol=1e-4, rtol=1e-4)
    smp = rec.sample(K=4, max_ctx=10_000)
    pos = smp.rows + 1  # depth-1 label position of each block
    assert smp.y_ids[:, 0, 0].tolist() == ref.y_star[0, pos].tolist()
    assert rec.s == sum(d - a for d, a in zip(res.stats.tree_depth, res.stats.accepted))


@pytest.mark.parametrize("arms", [("heads",), ("full",), ("skip", "heads", "full")])
def test_greedy_output_unchanged_while_updates_land_mid_query(arms):
    model, target, adapter, engine = setup(arms=arms)
    # Waiting in the serving thread is for the test only: it makes updates land between the
    # iterations of a query (the drafter's cache is then rebuilt under the new weights).
    for p in prompts(4):
        res = engine.generate(p, 30, on_tokens=lambda _: adapter.wait(10))
        assert res.token_ids == hf_greedy(model, p, 30)
    adapter.close()
    assert adapter.swaps >= (2 if len(arms) == 1 else 1) and adapter.failures == 0
    if arms == ("heads",):  # heads-only moved the output side and left the backbone alone
        served, base = adapter.theta_inf, adapter.theta_0
        assert not torch.equal(served.lm_head.weight.float(), base.lm_head.weight)
        assert torch.equal(served.layers[0].qkv.weight.float(), base.layers[0].qkv.weight)


def test_adapting_under_a_lookup_branch_stays_greedy_and_learns_from_its_own_depth():
    """``specblock+adapt+lookup``: the branch grafts prompt lookup's chain onto the adapting
    drafter's trees. The output stays the target's greedy decoding while updates land, and the
    signal's ``s`` counts the drafter's own misses, not those of a grafted chain."""
    from specblock.runtime.drafters.lookup_branch import LookupBranch

    model, target, adapter, _ = setup(arms=("heads",))
    engine = Engine(target, LookupBranch(adapter, nodes=3, inner_budget=16), budget=19)
    own, propose = [], adapter.inner.propose

    def spy(req):  # the drafter's own tree depth, before the branch grafts onto it
        tree = propose(req)
        own.append(tree.max_depth)
        return tree

    adapter.inner.propose = spy
    rng = np.random.default_rng(7)
    deeper = 0
    for _ in range(4):
        own.clear()
        p = np.tile(rng.integers(2, V, 4), 3)  # repeats: lookup finds chains to graft
        res = engine.generate(p, 30, on_tokens=lambda _: adapter.wait(10))
        assert res.token_ids == hf_greedy(model, p, 30)
        deeper += sum(d > o for d, o in zip(res.stats.tree_depth, own))
        assert adapter.record.s == sum(max(0, o - a) for o, a in zip(own, res.stats.accepted))
    adapter.close()
    assert adapter.swaps >= 1 and adapter.failures == 0 and deeper > 0


@pytest.mark.parametrize("arm", ["heads", "full"])
def test_a_bf16_update_learns_what_the_fp32_one_learns(arm):
    """``amp="bf16"`` (the default where bf16 products are native, e.g. AMX: about half an update's
    time on the real model) autocasts the update's products; the trained weights stay float32, and
    the update moves them and the loss on the buffered queries as the fp32 update does."""
    states, losses = {}, {}
    for amp in ("off", "bf16"):
        model, target, adapter, engine = setup(arms=(arm,), window=10**6, steps=4, batch=4, amp=amp)  # every query in each step
        assert adapter.trainer.amp == (amp == "bf16")
        for p in prompts(4):
            engine.generate(p, 30)
        trainer, records = adapter.trainer, list(adapter.buffer)
        samples, _ = trainer.samples(records)

        def loss(weights: dict) -> float:
            net = copy.deepcopy(trainer.theta_0)
            net.load_state_dict({**net.state_dict(), **weights})
            with torch.no_grad():
                return float(sum(trainer.sample_loss(net, smp, "full", -1) for smp in samples))

        states[amp] = trainer.step(arm, records, adapter.master, 0)
        losses[amp] = (loss(adapter.master), loss(states[amp]))
        adapter.close()
    assert all(t.dtype == torch.float32 for t in states["bf16"].values())
    change = {amp: after - before for amp, (before, after) in losses.items()}
    assert change["bf16"] == pytest.approx(change["off"], rel=0.25)
    if arm == "heads":  # (a full update of this random tiny drafter need not lower the loss in 4 steps)
        assert change["off"] < 0
    for n, t in states["off"].items():
        moved = (t - adapter.master[n]).norm()
        assert (states["bf16"][n] - t).norm() <= 0.25 * moved + 1e-6, n


def test_the_cli_the_config_and_the_adapter_share_one_set_of_defaults():
    from specblock.runtime.cli import build_parser
    from specblock.runtime.config import RunConfig

    cfg = RunConfig()
    ours = {k: v for k, v in cfg.adapt_settings().items() if k in ("window", "lam", "arms", "amp", "lr_heads", "lr_full")}
    assert ours == {k: getattr(AdaptSettings(), k) for k in ours}
    args = vars(build_parser().parse_args([]))
    assert {k: args[f"adapt_{k}"] for k in ("amp", "lr_heads", "lr_full")} == {k: ours[k] for k in ("amp", "lr_heads", "lr_full")}


def test_bench_refuses_adaptation_settings_on_a_method_that_does_not_adapt(tmp_path, capsys):
    from specblock.runtime.cli import main

    flags = ["bench", "--target", "lab", "--domains", "code", "--prompts", "1", "--runs", "1", "--out", str(tmp_path / "b")]
    for item in ("specblock:adapt_lr_heads=1e-4", "specblock:adapt_amp=off", "specblock:adapt_window=64"):
        assert main(flags + ["--methods", "specblock", "--set", item]) == 2
        err = capsys.readouterr().err.strip()
        assert "is for specblock+adapt" in err and item.split(":")[1].split("=")[0] in err and "\n" not in err
    assert main(flags + ["--methods", "specblock+adapt", "--set", "specblock+adapt:adapt_lr_full=0"]) == 2
    assert "adapt_lr_full" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


def test_unknown_amp_setting_is_refused():
    with pytest.raises(ValueError, match="amp 'fp8'"):
        AdaptSettings(amp="fp8")


@pytest.mark.skipif(not packed.available(), reason="torch has no fbgemm on this machine")
@pytest.mark.parametrize("kind", ["fp16", pytest.param("int8", marks=pytest.mark.skipif(
    not (q4_kernel.load() and q4_kernel.vnni_supports()), reason="the int8 kernel needs AVX512-VNNI"))])
def test_a_packed_drafter_trains_plain_copies_and_serves_each_update_repacked(kind):
    """Beside a packed-fp16 target the adapting drafter serves packed (it used to serve unpacked fp32
    weights, a fifth slower per step on the real model); its training copies are plain linears (a
    packed forward has no gradient), and an update that lands is packed again before it serves.
    "int8": the same for a drafter on the int8 kernel (beside a q4 target on it): each update is
    rounded to Q8_0 again, under the same key."""
    model, target, adapter, engine = setup(arms=("heads",), pack=kind)
    served = packed.PackedLinear if kind == "fp16" else q4.Int8Linear
    assert isinstance(adapter.theta_inf.lm_head, served)
    for net in (adapter.theta_0, adapter.theta_train):
        assert not any(isinstance(m, (packed.PackedLinear, q4.Int8Linear)) for m in net.modules())
    for p in prompts(4):
        assert engine.generate(p, 30, on_tokens=lambda _: adapter.wait(10)).token_ids == hf_greedy(model, p, 30)
    adapter.close()
    assert adapter.swaps >= 1 and adapter.failures == 0
    head = adapter.theta_inf.lm_head
    assert not torch.equal(head.weight.float(), adapter.theta_0.lm_head.weight)  # the update moved it
    x = torch.randn(5, head.in_features)
    if kind == "fp16":
        torch.testing.assert_close(head(x), torch.nn.functional.linear(x, head.weight, head.bias), atol=2e-3, rtol=2e-3)
        return
    fresh = torch.nn.Linear(head.in_features, head.out_features, bias=False)
    fresh.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    assert torch.equal(head(x), q4.Int8Linear(fresh, *quantize_q8_0(fresh.weight), kernel="int8")(x))  # served what it holds
    assert torch.equal(fresh.weight, head.weight)  # which was already its own Q8_0 rounding


def test_crashed_update_is_reported_once_and_serving_goes_on(monkeypatch, caplog):
    calls = []
    real = Adapter.train_step

    def crash_first(self, arm):
        calls.append(arm)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(self, arm)

    monkeypatch.setattr(Adapter, "train_step", crash_first)
    model, target, adapter, engine = setup(arms=("heads",))
    with caplog.at_level(logging.WARNING, logger="specblock.runtime.adapt"):
        for p in prompts(3, seed=1):
            res = engine.generate(p, 25, on_tokens=lambda _: adapter.wait(10))
            assert res.token_ids == hf_greedy(model, p, 25)
    adapter.close()
    failed = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 1 and "boom" in failed[0].getMessage()
    assert adapter.failures == adapter.summary()["adapt_failures"] == 1
    assert len(calls) > 1 and adapter.swaps >= 1  # adaptation went on after the crash


def test_harmful_update_is_rolled_back_within_three_windows(monkeypatch):
    def scramble_once(self, arm):
        first = not getattr(self, "_scrambled", False)
        self._scrambled = True
        return {"rank_head.2.bias": CUT_BUCKETS.clone()} if first else {}

    monkeypatch.setattr(Adapter, "train_step", scramble_once)
    model, target, adapter, engine = setup(arms=("heads",), window=4)
    for p in prompts(5, seed=2):
        res = engine.generate(p, 30)
        assert res.token_ids == hf_greedy(model, p, 30)
    adapter.close()
    w = adapter.windows
    landed = next(i for i, x in enumerate(w) if x["swaps"] >= 1)  # the scrambling update
    rolled = next(i for i, x in enumerate(w) if x["rollback"] == "rollback")
    assert landed <= rolled <= landed + 2  # judged on the window it landed in and the next two
    assert torch.equal(adapter.theta_inf.rank_head[2].bias.float(), adapter.theta_0.rank_head[2].bias)
    assert res.stats.tree_size[-1] > 1  # the restored drafter drafts again (the scrambled one could not)


def test_bandit_skips_updates_that_cost_more_than_they_gain(monkeypatch):
    clock = VirtualClock(tick=0.01)  # one window of 2 iterations: ~0.01 virtual seconds

    def slow_and_useless(self, arm):
        clock.spend(0.15)  # measured cost: many windows of wall time; no change to the drafter
        return {}

    monkeypatch.setattr(Adapter, "train_step", slow_and_useless)
    model, target, adapter, engine = setup(window=2, clock=clock)
    # Waiting in the serving thread lands each update right after it was chosen, so which
    # windows judge it does not depend on thread timing either.
    for p in prompts(8, seed=4):
        engine.generate(p, 30, on_tokens=lambda _: adapter.wait(10))
    adapter.wait(10)
    adapter.close()
    b = adapter.bandit
    assert b.value("skip") > max(b.value("heads"), b.value("full"))
    played = adapter.played
    assert played["heads"] >= 1 and played["full"] >= 1  # each explored once
    assert played["skip"] > 2 * (played["heads"] + played["full"])
    judged = [w for w in adapter.windows if w["judged"] in ("heads", "full")]
    assert judged and all(w["cost"] > 5 for w in judged)  # the update outlasted several windows


def test_serving_leaves_the_worker_its_core_while_an_update_runs(monkeypatch):
    """With as many serving threads as cores, an update in flight oversubscribed the CPU (the real
    model's T(1) about 3x). Serving drops to the cores the worker leaves and gets them back when
    the update lands; outputs stay greedy."""
    from specblock.runtime import adapt

    monkeypatch.setattr(adapt, "available_cores", lambda: 2, raising=False)  # a 2-core machine
    release = threading.Event()

    def held(self, arm):
        release.wait(10)  # in flight until serving has looked at its threads
        return {}

    monkeypatch.setattr(Adapter, "train_step", held)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model, target, adapter, engine = setup(arms=("heads",))
        seen = []

        def look(_):
            seen.append((adapter.busy, torch.get_num_threads()))
            if adapter.busy:
                release.set()

        for p in prompts(3, seed=5):
            assert engine.generate(p, 30, on_tokens=look).token_ids == hf_greedy(model, p, 30)
        adapter.wait(10)
        adapter.close()
        assert any(busy for busy, _ in seen) and any(not busy for busy, _ in seen)
        assert {n for busy, n in seen if busy} == {1} and {n for busy, n in seen if not busy} == {2}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------- CLI
@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapt")
    target_dir = save_tiny(root / "target", "llama", vocab=96, ctx=128)
    model = tiny_model("llama", vocab=96, ctx=128)
    cfg = SpecBlockConfig(vocab_size=96, hidden_size=32, num_heads=4, intermediate_size=64, tap_layers=default_taps(2))
    net = SpecBlockNet(cfg)
    net.tie_to_target(model)
    net.save(root / "drafter")
    prompts_file = root / "p.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("abcabc", "hello there", "def f(x):")))
    return target_dir, root / "drafter", prompts_file



def test_cli_adapt_json_reports_windows_and_stays_identical(dirs, capsys):
    target_dir, drafter_dir, pf = dirs
    code, out, err = cli(capsys, "--target", target_dir, "--method", "specblock", "--drafter", drafter_dir,
                         "--prompt-file", pf, "--max-new-tokens", 20, "--dtype", "float32", "--json",
                         "--compare", "ar", "--adapt", "--adapt-window", 3, "--adapt-arms", "skip,heads")
    assert code == 0, err
    recs = [json.loads(x) for x in out.strip().splitlines()]
    assert all(r["identical_to_ar"] for r in recs)
    windows = sum((r["adapt_windows"] for r in recs[:-1]), [])
    assert windows and {"window", "tau", "tokens_per_s", "arm", "rollback"} <= windows[0].keys()
    assert recs[-1]["adapt_windows"] == len(windows) and set(recs[-1]["adapt_arms"]) >= {"skip", "heads"}


def test_cli_adapt_with_a_lookup_branch_stays_identical(dirs, capsys):
    target_dir, drafter_dir, pf = dirs
    code, out, err = cli(capsys, "--target", target_dir, "--method", "specblock", "--drafter", drafter_dir,
                         "--prompt-file", pf, "--max-new-tokens", 20, "--dtype", "float32", "--json",
                         "--compare", "ar", "--adapt", "--adapt-window", 3, "--lookup-branch", 2)
    assert code == 0, err
    recs = [json.loads(x) for x in out.strip().splitlines()]
    assert all(r["identical_to_ar"] and r["lookup_branch"] == 2 for r in recs[:-1])
    assert recs[-1]["adapt_windows"] >= 1


def test_cli_adapt_text_mode_prints_windows_to_stderr(dirs, capsys):
    target_dir, drafter_dir, pf = dirs
    code, out, err = cli(capsys, "--target", target_dir, "--method", "specblock", "--drafter", drafter_dir,
                         "--prompt-file", pf, "--max-new-tokens", 12, "--dtype", "float32", "--adapt", "--adapt-window", 4)
    assert code == 0 and "[adapt] window 0: tau" in err and "tokens/s" in err


@pytest.mark.parametrize("args,needle", [
    (["--method", "lookup", "--adapt"], "--adapt"),
    (["--method", "specblock", "--adapt", "--adapt-arms", "skip,bogus"], "--adapt-arms"),
    (["--method", "specblock", "--adapt", "--adapt-arms", "heads,heads"], "--adapt-arms"),
    (["--method", "specblock", "--adapt", "--adapt-window", "1"], "--adapt-window"),
    (["--method", "specblock", "--adapt", "--adapt-lambda", "-0.5"], "--adapt-lambda"),
    (["--method", "specblock", "--adapt", "--adapt-lr-heads", "0"], "--adapt-lr-heads"),
    (["--method", "specblock", "--adapt", "--adapt-lr-full", "nan"], "--adapt-lr-full"),
])
def test_cli_bad_adapt_settings_are_one_line_and_status_2(dirs, capsys, args, needle):
    code, _, err = cli(capsys, "--target", dirs[0], "--prompt", "x", *args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
