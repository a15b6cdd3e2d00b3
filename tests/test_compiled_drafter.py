"""SpecBlock's block 1 on static buffers (``compiled/drafter.py``): the same trees as the eager
drafter, whatever the padding and the stale slots, and lossless on the compiled target."""

import numpy as np
import pytest
import torch

from specblock.compiled import compile_drafter
from specblock.compiled.drafter import ROWS, StaticSpecBlockDrafter
from specblock.compiled.target import StaticTarget
from specblock.policies.branching import RankBucketBranching
from specblock.runtime.drafters.base import DraftRequest
from specblock.runtime.drafters.lookup import LookupDrafter
from specblock.runtime.drafters.specblock import SpecBlockDrafter
from specblock.runtime import tree_attention
from specblock.runtime.engine import Engine
from test_specblock import make
from tiny import hf_greedy

WIDTHS = (2, 4, 6, 4)  # no zero width: an untrained rank head still grows trees


class Recorder:
    """Wraps a drafter; keeps every tree it proposes (tokens and parents)."""

    def __init__(self, inner) -> None:
        self.inner, self.trees = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, req: DraftRequest):
        tree = self.inner.propose(req)
        self.trees.append((tree.tokens.copy(), tree.parent.copy()))
        return tree


def decode(target, drafter, prompt, n=30, budget=12):
    rec = Recorder(drafter)
    res = Engine(target, rec, budget=budget).generate(prompt, n)
    return res, rec.trees


@pytest.mark.parametrize("M", [1, 2])
def test_static_block_proposes_the_eager_trees(M):
    """Padded rows, stale slots and the span mask change nothing: tree for tree the same
    proposals as the eager drafter, across prompts of 1, 5 and 20 tokens (the first block after a
    long prompt runs unpadded), in one drafter reused across prompts."""
    model, target, net = make(seed=3)
    eager = SpecBlockDrafter(net, M=M, policy=RankBucketBranching(WIDTHS))
    static = StaticSpecBlockDrafter(SpecBlockDrafter(net, M=M, policy=RankBucketBranching(WIDTHS)),
                                    capacity=target.max_context + ROWS + net.cfg.K, compile=False)
    rng = np.random.default_rng(M)
    for length in (20, 1, 5):
        prompt = rng.integers(2, 16, length)
        a, trees_a = decode(target, eager, prompt)
        b, trees_b = decode(target, static, prompt)
        assert a.token_ids == b.token_ids == hf_greedy(model, prompt, 30)
        assert len(trees_a) == len(trees_b) and max(len(t[0]) for t in trees_b) > 1
        for (ta, pa), (tb, pb) in zip(trees_a, trees_b):
            np.testing.assert_array_equal(ta, tb)
            np.testing.assert_array_equal(pa, pb)


def test_deep_accepts_fall_back_to_an_unpadded_step():
    """A path longer than ROWS - 1 accepted at once (prompt lookup's chain on a repeated text,
    grafted on SpecBlock's tree) makes more new positions than a padded step holds: that step runs
    unpadded, and decoding stays lossless and in step with the eager drafter."""
    from specblock.runtime.drafters.lookup_branch import LookupBranch

    model, target, net = make(seed=5)
    prompt = np.tile(np.arange(2, 12), 4)
    eager = LookupBranch(SpecBlockDrafter(net, M=1, policy=RankBucketBranching(WIDTHS)), nodes=ROWS + 4)
    static = LookupBranch(StaticSpecBlockDrafter(SpecBlockDrafter(net, M=1, policy=RankBucketBranching(WIDTHS)),
                                                 capacity=target.max_context + 32, compile=False), nodes=ROWS + 4)
    calls = []
    real_step = static.inner._step
    static.inner._step = lambda taps, *a: calls.append(taps.shape[0]) or real_step(taps, *a)
    a, trees_a = decode(target, eager, prompt, n=40, budget=20)
    b, trees_b = decode(target, static, prompt, n=40, budget=20)
    assert a.token_ids == b.token_ids == hf_greedy(model, prompt, 40)
    assert [t[0].tolist() for t in trees_a] == [t[0].tolist() for t in trees_b]
    assert max(calls) > ROWS  # some step had more new positions than a padded step holds


def test_compile_drafter_wraps_specblock_and_leaves_others():
    model, target, net = make()
    drafter = compile_drafter(SpecBlockDrafter(net, M=1), target)
    assert isinstance(drafter, StaticSpecBlockDrafter) and drafter.compiled
    other = LookupDrafter()
    assert compile_drafter(other, target) is other


def test_compiled_block_is_lossless_on_the_compiled_target(monkeypatch, tmp_path):
    """The real thing: inductor-compiled block 1 beside the compiled target, one graph per row
    bucket and span, the same trees as the eager drafter."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model, _, net = make(seed=7)
    target = StaticTarget(model, compile=True, buckets=(8,))
    eager = SpecBlockDrafter(net, M=1, policy=RankBucketBranching(WIDTHS))
    static = compile_drafter(SpecBlockDrafter(net, M=1, policy=RankBucketBranching(WIDTHS)), target)
    graphs = counters["stats"]["unique_graphs"]
    prompt = np.random.default_rng(0).integers(2, 16, 12)
    _, trees_a = decode(StaticTarget(model, compile=False, buckets=(8,)), eager, prompt, n=24, budget=6)
    b, trees_b = decode(target, static, prompt, n=24, budget=6)
    assert b.token_ids == hf_greedy(model, prompt, 24)
    assert [t[0].tolist() for t in trees_a] == [t[0].tolist() for t in trees_b]
    shapes = static.block.shapes
    assert len({span for _, span in shapes}) == 1 and {4} <= {rows for rows, _ in shapes}  # one span
    assert counters["stats"]["unique_graphs"] - graphs == 1 + len(shapes)  # the target's one bucket, a graph a shape


def test_cli_compile_builds_the_static_drafter_but_not_for_adapt(tmp_path, capsys, monkeypatch):
    """``--compile`` reaches the drafter through ``cli.maybe_compile_drafter``; ``--adapt`` keeps it
    eager (the adapting drafter's weights change while it serves). The target and the drafter run
    their static steps uncompiled here: the wiring is what is tested, the compiled step above."""
    import json

    from specblock.runtime import cli
    from specblock.runtime.drafters.specblock_net import SpecBlockConfig, SpecBlockNet
    from specblock.runtime.target import TargetModel
    from tiny import save_tiny

    save_tiny(tmp_path / "t", "llama", vocab=96, ctx=128, layers=3)
    target = TargetModel.load(tmp_path / "t", "float32", "cpu")
    cfg = SpecBlockConfig(vocab_size=96, hidden_size=32, num_heads=4, intermediate_size=64, tap_layers=target.tap_layers)
    net = SpecBlockNet(cfg)
    net.tie_to_target(target.model)
    net.save(tmp_path / "d")
    built = []
    monkeypatch.setattr(cli, "maybe_compile", lambda t, c, m="whole": StaticTarget.wrap(t, compile=False) if c else t)
    monkeypatch.setattr(cli, "maybe_compile_drafter", lambda d, t: built.append(
        StaticSpecBlockDrafter(d, capacity=t.max_context + 16, compile=False)) or built[-1])
    args = ["--target", str(tmp_path / "t"), "--method", "specblock", "--drafter", str(tmp_path / "d"), "--widths",
            "2,4,6,4", "--prompt", "abc abc", "--max-new-tokens", "16", "--dtype", "float32", "--json", "--compile"]
    assert cli.main(args + ["--compare", "ar"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["identical_to_ar"] is True and rec["mean_tree_size"] > 1
    assert len(built) == 1 and built[0].cached > 0  # it served: its buffers hold the context
    assert cli.main(args + ["--adapt"]) == 0
    assert len(built) == 1


def test_serving_json_compiles_the_drafter_beside_an_eager_target(tmp_path, capsys, monkeypatch):
    """A drafter's ``serving.json`` may say ``drafter_compiled`` (its step measured faster compiled
    beside an eager target): the CLI and the bench compile it without ``--compile``; the CLI's
    ``--eager-drafter`` and the bench's ``--set METHOD:drafter_compiled=false`` keep it eager. The
    wiring is tested; the step uncompiled."""
    import json
    import shutil

    from specblock.runtime import cli
    from specblock.runtime.config import DEFAULT_DRAFTERS

    d = tmp_path / "specblock"
    shutil.copytree(DEFAULT_DRAFTERS / "specblock", d)
    (d / "serving.json").write_text(json.dumps({"budget": 4, "M": 1, "drafter_compiled": True}))
    built = []
    monkeypatch.setattr(cli, "maybe_compile_drafter", lambda dr, t: built.append(
        StaticSpecBlockDrafter(dr, capacity=t.max_context + 16, compile=False)) or built[-1])
    args = ["--target", "lab", "--method", "specblock", "--drafter", str(d), "--prompt", "def add(a, b):",
            "--max-new-tokens", "12", "--dtype", "float32", "--json", "--no-warmup"]
    assert cli.main(args + ["--compare", "ar"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["identical_to_ar"] is True
    assert len(built) == 1 and built[0].cached > 0  # beside the eager target, and it served
    assert cli.main(args + ["--eager-drafter"]) == 0  # the user's flag over the file
    assert len(built) == 1
    capsys.readouterr()
    bench = ["bench", "--target", "lab", "--dtype", "float32", "--domains", "code", "--prompts", "1", "--runs", "1",
             "--max-new-tokens", "8", "--out", str(tmp_path / "b"), "--set", f"specblock:drafter={d}"]
    assert cli.main(bench + ["--methods", "specblock"]) == 0
    assert len(built) > 1
    n = len(built)
    assert cli.main(bench + ["--methods", "specblock", "--set", "specblock:drafter_compiled=false"]) == 0
    assert len(built) == n
    assert json.loads((tmp_path / "b.json").read_text())["rows"][1]["match_rate"] == 1.0
    (d / "serving.json").write_text(json.dumps({"drafter_compiled": "yes"}))
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "drafter_compiled" in err and "true or false" in err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (experiments/gpu_check.sh runs it where one is)")
def test_cuda_graph_block_proposes_the_eager_trees():
    """CUDA: the buffers on the device, the block compiled with mode='reduce-overhead' (CUDA graphs)."""
    model, _, net = make(seed=7)
    prompt = np.random.default_rng(0).integers(2, 16, 12)
    ref = hf_greedy(model, prompt, 24)  # on the CPU copy, before the move
    model, net = model.cuda(), net.cuda()
    target = StaticTarget(model, compile=True, buckets=(8,))
    eager = SpecBlockDrafter(net, M=1, policy=RankBucketBranching(WIDTHS))
    static = compile_drafter(SpecBlockDrafter(net, M=1, policy=RankBucketBranching(WIDTHS)), target)
    _, trees_a = decode(StaticTarget(model, compile=False, buckets=(8,)), eager, prompt, n=24, budget=6)
    b, trees_b = decode(target, static, prompt, n=24, budget=6)
    assert b.token_ids == ref
    assert [t[0].tolist() for t in trees_a] == [t[0].tolist() for t in trees_b]


def test_bench_refuses_drafter_compiled_where_there_is_no_compiled_drafter(tmp_path, capsys):
    from specblock.runtime.cli import main

    flags = ["bench", "--target", "lab", "--domains", "code", "--prompts", "1", "--runs", "1", "--out", str(tmp_path / "b")]
    for m in ("parallelspec", "specblock+adapt", "falcon+lookup"):
        assert main(flags + ["--methods", m, "--set", f"{m}:drafter_compiled=true"]) == 2
        err = capsys.readouterr().err.strip()
        assert "only specblock, eagle3, medusa, sps have a compiled drafter" in err and "\n" not in err
    assert not (tmp_path / "b.json").exists()


def test_warm_compiles_each_row_bucket_and_leaves_the_buffers_empty(monkeypatch, tmp_path):
    """Before a server listens (``Session.warm_compiled``): the block of every row bucket compiled at
    the first span, the drafter's state reset; decoding afterwards compiles no drafter graph."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model, _, net = make(seed=7)
    target = StaticTarget(model, compile=True, buckets=(8,))
    static = compile_drafter(SpecBlockDrafter(net, M=1, policy=RankBucketBranching(WIDTHS)), target)
    span = static.capacity if static.one_span else 256
    assert static.warm() == [(4, span), (8, span)] and static.cached == 0 and static._new is None
    target.want_features = True
    target.warm(8)
    graphs = counters["stats"]["unique_graphs"]
    prompt = np.random.default_rng(0).integers(2, 16, 12)
    b, _ = decode(target, static, prompt, n=24, budget=6)
    assert b.token_ids == hf_greedy(model, prompt, 24)
    assert counters["stats"]["unique_graphs"] == graphs and len(static.block.shapes) == 2


@pytest.mark.skipif(not tree_attention.load(), reason="the fused attention op needs AVX512F/DQ and a compiler")
def test_one_span_serves_every_context_once_warmed(monkeypatch, tmp_path):
    """Where the drafter attends in the fused op, its compiled block attends over the whole buffer:
    a decode that grows past 256 slots after ``warm`` compiles no drafter graph, with the eager
    drafter's trees; with power-of-two spans (``one_span = False``) the same decode compiles the
    next span mid-request (what a bench or a server paid before)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model, _, net = make(seed=7)
    check_one_span(model, lambda: SpecBlockDrafter(net, M=1, policy=RankBucketBranching(WIDTHS)), budget=6)


def check_one_span(model, new_drafter, budget: int) -> None:
    """A 240-token prompt decoded 30 tokens past 256 slots on a 512-position target, by the eager
    drafter and by its compiled form warmed with one span and with power-of-two spans (one row
    bucket each: fewer graphs to compile): plain greedy's tokens and the eager trees either way,
    and no drafter graph compiled after ``warm`` exactly when the span is the whole buffer."""
    from torch._dynamo.utils import counters

    from specblock.runtime.target import TargetModel

    model.config.max_position_embeddings = 512
    target = TargetModel(model)
    prompt = np.random.default_rng(1).integers(2, 16, 240)
    _, trees_a = decode(target, new_drafter(), prompt, n=30, budget=budget)
    for one_span in (True, False):
        static = compile_drafter(new_drafter(), target)
        assert static.one_span  # fp32 on the CPU with the op: the default
        static.one_span, static.row_buckets = one_span, (ROWS,)
        static.warm()
        graphs = counters["stats"]["unique_graphs"]
        b, trees_b = decode(target, static, prompt, n=30, budget=budget)
        assert b.token_ids == hf_greedy(model, prompt, 30)
        assert [t[0].tolist() for t in trees_a] == [t[0].tolist() for t in trees_b]
        assert max(len(t[0]) for t in trees_b) > 1
        assert (counters["stats"]["unique_graphs"] == graphs) is one_span
