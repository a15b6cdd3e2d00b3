"""``--compile`` for drafter training: the compiled vocabulary-wide part of a step gives the eager
step's loss and gradients, and a method without the hook says so before the target loads."""

import copy

import numpy as np
import pytest
import torch

from specblock.errors import SpecBlockError
from specblock.training import recipes
from specblock.training.drafter import build_parser, check_args
from specblock.training.specblock_step import target_pass
from tiny import tiny_model

V = 16


def _tiny(method: str):
    model = tiny_model("llama", vocab=V, seed=3, layers=3)
    args = build_parser().parse_args(["--method", method, "--target", "t", "--run-dir", "r", "--intermediate", "64"])
    args.d2t = None
    torch.manual_seed(0)
    net = recipes.get(method).build(model, args)
    return model, args, net


def _loss_and_grads(recipe, net, tp, args):
    gen = torch.Generator().manual_seed(0)
    loss = recipe.step(net, tp, gen, args, 0.5).loss
    params = [p for p in net.parameters() if p.requires_grad]
    return loss.detach(), torch.autograd.grad(loss, params)


@pytest.mark.parametrize("method", ["specblock", "eagle3"])
def test_compiled_step_matches_eager(method):
    model, args, net = _tiny(method)
    recipe = recipes.get(method)
    tokens = torch.as_tensor(np.random.default_rng(1).integers(2, V, (2, 17)))
    tp = target_pass(model, tokens, tuple(net.cfg.tap_layers), net)
    compiled = copy.deepcopy(net)
    recipe.compile(compiled)
    loss, grads = _loss_and_grads(recipe, net, tp, args)
    closs, cgrads = _loss_and_grads(recipe, compiled, tp, args)
    assert torch.allclose(closs, loss, rtol=1e-5, atol=1e-5)
    for g, cg in zip(grads, cgrads):
        assert torch.allclose(cg, g, rtol=1e-4, atol=1e-6)


def test_compile_flag_names_the_methods_that_have_it(tmp_path):
    args = build_parser().parse_args(["--method", "medusa", "--target", "t", "--run-dir", str(tmp_path / "r"), "--compile"])
    with pytest.raises(SpecBlockError, match="--compile is wired for specblock, eagle3 only so far; drop it"):
        check_args(args)
