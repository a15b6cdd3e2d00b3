"""The SpecBlock drafter: lossless with any weights, training and serving see the same blocks,
losses follow the paper's definitions, save/load round trips, errors are clear."""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from specblock.errors import SpecBlockError
from specblock.policies.branching import RankBucketBranching
from specblock.policies.tree import rank_to_bucket
from specblock.runtime.drafters.base import DraftRequest
from specblock.runtime.drafters.kvcache import KVCache
from specblock.runtime.drafters.specblock import SpecBlockDrafter
from specblock.runtime.drafters.specblock_net import SpecBlockConfig, SpecBlockNet
from specblock.runtime.engine import Engine
from specblock.runtime.target import TargetModel
from specblock.training.losses import bucket_of, rank_of, valid_prefix_mask
from specblock.training.specblock_step import first_block, seed_block, specblock_step, target_pass
from tiny import FAMILIES, tiny_model, hf_greedy

V = 16


def make(family="llama", seed=0, **cfg_kw):
    model = tiny_model(family, vocab=V, seed=seed, layers=3)
    target = TargetModel(model)
    cfg = SpecBlockConfig(vocab_size=V, hidden_size=32, num_heads=4, intermediate_size=64,
                          tap_layers=target.tap_layers, **cfg_kw)
    torch.manual_seed(seed)
    net = SpecBlockNet(cfg)
    net.tie_to_target(model)
    with torch.no_grad():  # a non-trivial shift, so the tests see it act
        for s in net.shifts:
            s.weight.add_(torch.randn_like(s.weight) * 0.1)
    return model, target, net.eval()



@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("M", [1, 2, 3])
def test_lossless_greedy(family, M):
    model, target, net = make(family)
    rng = np.random.default_rng(M)
    for length in (1, 4, 15):
        prompt = rng.integers(2, V, length)
        # (2, 4, 6, 4): the paper's setting without a zero width, so an untrained rank head
        # still grows trees.
        drafter = SpecBlockDrafter(net, M=M, max_seeds=2, policy=RankBucketBranching((2, 4, 6, 4)))
        res = Engine(target, drafter, budget=int(rng.integers(4, 30))).generate(prompt, 30)
        assert res.token_ids == hf_greedy(model, prompt, 30)
        assert max(res.stats.tree_size) > 1



def test_one_block_without_cuts_fills_its_budgets():
    """``tree_sizes``: M = 1 under widths with no 0 (the shipped serving settings) always fills a
    budget up to K times the smallest width, the one size a compiled server then warms; a 0 width or
    a second block: every size."""
    model, target, net = make("llama", seed=4)
    target.want_features = True
    rng = np.random.default_rng(6)
    prompt = np.arange(2, 14)
    for _ in range(10):
        widths = tuple(int(w) for w in rng.integers(1, 6, 4))
        drafter = SpecBlockDrafter(net, M=1, policy=RankBucketBranching(widths))
        for budget in range(1, net.cfg.K * min(widths) + 1):
            drafter.prefill(prompt, target.prefill(prompt[:-1]))
            tree = drafter.propose(DraftRequest(tokens=prompt, budget=budget, max_depth=100))
            assert (tree.size,) == drafter.tree_sizes(budget), (widths, budget)
    assert SpecBlockDrafter(net, M=1, policy=RankBucketBranching((2, 4, 10, 0))).tree_sizes(3) == (1, 3, 4)
    assert SpecBlockDrafter(net, M=1, policy=RankBucketBranching((2, 4, 10, 0))).tree_sizes(1) == (1, 2)
    assert SpecBlockDrafter(net, M=2, policy=RankBucketBranching((4, 4, 4, 4))).tree_sizes(3) == (1, 2, 3, 4)


def test_one_block_with_cuts_takes_only_the_sizes_it_names():
    """``tree_sizes`` at M = 1 under widths with a 0 (the paper's (2, 4, 10, 0)): whatever buckets the
    rank head predicts, each tree's size is among those named, so a compiled server never meets an
    unwarmed size away from the context's end; the list leaves out what no run of widths can make."""
    model, target, net = make("llama", seed=4)
    target.want_features = True
    rng = np.random.default_rng(7)
    prompt = np.arange(2, 14)
    drafter = SpecBlockDrafter(net, M=1, policy=RankBucketBranching((2, 4, 10, 0)))
    buckets = rng.integers(0, 4, (40, net.cfg.K))
    original = drafter._candidates
    seen: dict[int, set[int]] = {b: set() for b in (1, 2, 3, 5, 8)}
    for row in buckets:  # the rank head's buckets forced, one run of them a tree
        drafter._candidates = lambda hq, row=row: (lambda c: (c[0], c[1], np.broadcast_to(row, c[2].shape).copy(), c[3]))(
            original(hq))
        for budget in seen:
            drafter.prefill(prompt, target.prefill(prompt[:-1]))
            tree = drafter.propose(DraftRequest(tokens=prompt, budget=budget, max_depth=100))
            assert tree.size in drafter.tree_sizes(budget), (row, budget, tree.size)
            seen[budget].add(tree.size)
    assert all(seen[b] == set(drafter.tree_sizes(b)) for b in seen), seen  # these 40 runs meet every size named
    assert 2 not in drafter.tree_sizes(3)

@pytest.mark.parametrize("shift,broadcast", [(False, True), (True, False)])
def test_ablations_stay_lossless(shift, broadcast):
    model, target, net = make(shift=shift, prefix_broadcast=broadcast)
    prompt = np.arange(2, 12)
    drafter = SpecBlockDrafter(net, policy=RankBucketBranching((2, 4, 6, 4)))
    res = Engine(target, drafter, budget=20).generate(prompt, 25)
    assert res.token_ids == hf_greedy(model, prompt, 25)


def test_serving_blocks_equal_training_blocks():
    """Block 1 at the root, and block 2 from a seed, computed by the runtime drafter, equal the
    training step's blocks at the same positions: training teaches exactly what serving runs."""
    model, target, net = make("qwen2", seed=2)
    tokens = torch.as_tensor(np.random.default_rng(0).integers(2, V, 14))[None]
    with torch.no_grad():
        tp = target_pass(model, tokens, target.tap_layers)
        hq_train, ctx_kv = first_block(net, tp.taps.to(torch.float32), tokens)
    target.want_features = True
    for root_pos in (1, 6, 12):
        prompt = tokens[0, : root_pos + 1].numpy()
        drafter = SpecBlockDrafter(net)
        drafter.prefill(prompt, target.prefill(prompt[:-1]))
        drafter._root_pos = root_pos
        with torch.no_grad():
            hq_serve, _ = drafter._first_block(int(prompt[-1]))
            torch.testing.assert_close(hq_serve[0, 0], hq_train[0, root_pos - 1], atol=2e-4, rtol=2e-4)
            # Block 2 from the spine node at depth j of every first block, seeded with the
            # sequence's token there; compare the row of this root.
            j, p = 2, root_pos - 1
            rows = torch.arange(hq_train.shape[1])
            seed_pos = (rows + j)[None]
            seed_tok = tokens[:, seed_pos[0].clamp(max=tokens.shape[1] - 1)]
            hq2_train = seed_block(net, ctx_kv, hq_train[:, :, j - 1], seed_tok, seed_pos)
            g = net.g_from_drafter(hq_train[0, p, j - 1][None], seed_tok[0, p][None])
            hq2_serve = drafter._seed_block(g, seed_pos[0, p][None])
            torch.testing.assert_close(hq2_serve[0, 0], hq2_train[0, p], atol=2e-4, rtol=2e-4)
            # A seed block only reads the cache: the same with no free row left in its storage.
            c = drafter.cache
            drafter.cache = KVCache(tuple(t[:, :, : c.n] for t in c.keys), tuple(t[:, :, : c.n] for t in c.values), c.n)
            torch.testing.assert_close(drafter._seed_block(g, seed_pos[0, p][None]), hq2_serve, atol=0, rtol=0)


@pytest.mark.parametrize("k", [4, 10])  # fewer candidates than the rank statistics' 10, and as many (serving's default)
def test_serving_heads_equal_the_training_heads(k):
    """Serving's one shared top-k gives the candidates and rank logits that ``heads`` followed by a
    log-softmax top-k gives (the training path), so the rank head reads the same statistics."""
    _, _, net = make("llama", seed=3)
    hq = torch.randn(2, 3, net.cfg.K, 32)
    with torch.no_grad():
        logits, rank = net.heads(hq)
        want = torch.log_softmax(logits, -1).topk(k, dim=-1)
        logp, rows, rank_s = net.serving_heads(hq, k)
    torch.testing.assert_close(logp, want.values, atol=1e-5, rtol=1e-5)
    assert torch.equal(rows, want.indices)
    torch.testing.assert_close(rank_s, rank, atol=1e-5, rtol=1e-5)


def test_valid_prefix_mask_follows_the_paper():
    correct = torch.tensor([[True, False, True, True], [True, True, True, False]])
    valid = torch.ones_like(correct)
    assert valid_prefix_mask(correct, valid).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert valid_prefix_mask(correct, valid, enabled=False).tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    valid[1, 2:] = False
    assert valid_prefix_mask(correct, valid).tolist()[1] == [1, 1, 0, 0]


@given(st.lists(st.floats(-5, 5), min_size=12, max_size=12, unique=True), st.integers(0, 11))
def test_rank_buckets_agree_between_training_and_policies(logits, tgt):
    x = torch.tensor(logits)
    r = int(rank_of(x, torch.tensor(tgt)))
    assert r == int((x > x[tgt]).sum())
    assert int(bucket_of(torch.tensor(r))) == int(rank_to_bucket(r))


def test_training_learns_a_fixed_batch():
    model, target, net = make("llama", seed=4)
    net.train()
    tokens = torch.as_tensor(np.random.default_rng(1).integers(2, V, (2, 33)))
    tp = target_pass(model, tokens, target.tap_layers)
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(0)

    def top1_at_depth1():
        with torch.no_grad():
            return float(specblock_step(net, tp, gen, 1.0).blocks[0].top1[..., 0].float().mean())

    before = top1_at_depth1()
    for _ in range(150):
        res = specblock_step(net, tp, gen, rank_weight=1.0)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
    after = top1_at_depth1()
    assert after > before + 0.2 and after > 0.35


def test_save_load_round_trip_and_vocab_mismatch(tmp_path):
    model, target, net = make()
    net.save(tmp_path / "d")
    d = SpecBlockDrafter.load(tmp_path / "d", target)
    loaded = d.net.state_dict()
    for name, a in net.state_dict().items():  # saved in bf16; embedding and LM head come from the target
        want = a if name in ("embed.weight", "lm_head.weight") else a.to(torch.bfloat16).float()
        torch.testing.assert_close(want, loaded[name].float())
    other = TargetModel(tiny_model("llama", vocab=V + 4, layers=3))
    with pytest.raises(SpecBlockError, match="trained for vocab"):
        SpecBlockDrafter.load(tmp_path / "d", other)
    with pytest.raises(SpecBlockError, match="no SpecBlock drafter"):
        SpecBlockDrafter.load(tmp_path / "missing", target)


def test_cli_specblock_with_compare(tmp_path, capsys):
    """Through the CLI, sharing one target with the plain-decoding baseline."""
    import json

    from specblock.runtime.cli import main
    from tiny import save_tiny

    save_tiny(tmp_path / "t", "llama", vocab=96, ctx=128, layers=3)
    target = TargetModel.load(tmp_path / "t", "float32", "cpu")
    cfg = SpecBlockConfig(vocab_size=96, hidden_size=32, num_heads=4, intermediate_size=64, tap_layers=target.tap_layers)
    net = SpecBlockNet(cfg)
    net.tie_to_target(target.model)
    net.save(tmp_path / "d")
    code = main(["--target", str(tmp_path / "t"), "--method", "specblock", "--drafter", str(tmp_path / "d"),
                 "--widths", "2,4,6,4", "--prompt", "abc abc", "--max-new-tokens", "16", "--dtype", "float32",
                 "--compare", "ar", "--json"])
    rec = json.loads(capsys.readouterr().out)
    assert code == 0 and rec["identical_to_ar"] is True and rec["mean_tree_size"] > 1


def test_traces_carry_rank_head_cuts_for_the_simulator(tmp_path):
    """Where the rank head ends a branch (width 0) there is no node; the trace's ``cuts`` say
    where, and the simulator's trace reader takes them in. Stays lossless."""
    import io

    from specblock.sim.traces import observations, read_traces

    model, target, net = make()
    prompt = np.arange(2, 12)
    for widths in ((0, 0, 0, 0), (1, 1, 1, 0)):
        buf = io.StringIO()
        drafter = SpecBlockDrafter(net, M=2, policy=RankBucketBranching(widths))
        res = Engine(target, drafter, budget=20, trace=buf).generate(prompt, 12)
        assert res.token_ids == hf_greedy(model, prompt, 12)
        recs = [__import__("json").loads(line) for line in buf.getvalue().splitlines()]
        cuts = [r["cuts"] for r in recs]
        assert all(len(c["parent"]) == len(c["bucket"]) == len(c["block"]) for c in cuts)
        if widths == (0, 0, 0, 0):  # every first position is cut at the root
            assert all(r["tree_size"] == 1 and c["parent"] == [0] and c["block"] == [0] for r, c in zip(recs, cuts))
        for r, c in zip(recs, cuts):  # a cut's parent is a node of the tree, in b3 when widths end there
            assert all(0 <= p < r["tree_size"] for p in c["parent"])
            assert all(widths[b] == 0 for b in c["bucket"])
        path = tmp_path / f"t{widths[0]}.jsonl"
        path.write_text(buf.getvalue())
        assert len(read_traces([path])) == len(recs)
        observations(read_traces([path]))  # the fitter accepts them


def test_shared_norm_weighs_every_valid_position_alike():
    """The paper's 1/N_k averages each in-block index over its own valid positions; the shared
    option divides every index by N_1. With one valid position at k = 2 out of four at k = 1,
    the k = 2 term weighs 4x less under the shared norm."""
    from specblock.training.losses import block_loss

    torch.manual_seed(0)
    logits = torch.randn(4, 2, 5)
    normed = torch.randn(4, 2, 3)
    e_target = torch.randn(4, 2, 3)
    lse = torch.logsumexp(logits, -1)
    y = logits.argmax(-1)
    y[1:, 0] = (y[1:, 0] + 1) % 5  # only row 0 is right at k = 1, so only it reaches k = 2
    valid = torch.ones(4, 2, dtype=torch.bool)
    rank = torch.zeros(4, 2, 4)
    ce = lse - (normed * e_target).sum(-1)
    per_k = block_loss(logits, rank, normed, lse, e_target, y, valid)
    shared = block_loss(logits, rank, normed, lse, e_target, y, valid, per_k_norm=False)
    torch.testing.assert_close(per_k.draft, ce[:, 0].mean() + ce[0, 1])
    torch.testing.assert_close(shared.draft, ce[:, 0].mean() + ce[0, 1] / 4)


def test_per_k_norm_flag_undoes_shared_norm():
    """A fine-tune adds its flags after a script's own: ``--per-k-norm`` after ``--shared-norm``
    brings back the paper's 1/N_k; either alone does what it says; the default is the paper's."""
    from specblock.training.drafter import build_parser

    base = ["--target", "t", "--run-dir", "r"]
    parse = lambda *f: build_parser().parse_args([*base, *f]).per_k_norm
    assert parse() is True
    assert parse("--shared-norm") is False
    assert parse("--shared-norm", "--per-k-norm") is True
    assert parse("--per-k-norm", "--shared-norm") is False
