"""One serving-time adaptation update: the worker thread's whole job (``adapt.Adapter`` decides
when, and swaps the result in). Kept apart from the serving side so that one module reads as the
schedule (windows, bandit, rollback, cores) and this one as the update's loss and optimisation.

An update of an arm is ``steps`` Adam steps with a fresh optimiser, starting from the weights now
serving, on queries drawn from the buffer with probability proportional to their error signal
``s``; the loss per query is ``L_draft + rank_weight * L_rank + lam * KL(p_theta || p_theta0)`` on
the positions the valid-prefix mask keeps (``theta_0``: the frozen pretrained net)."""

from __future__ import annotations

import copy
from typing import Callable, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from specblock.runtime.adapt_signal import QueryRecord, Sample, block1_rows
from specblock.runtime.drafters.specblock_net import SpecBlockNet, bucket_of, rank_of
from specblock.runtime.target import native_bf16

HEAD_PREFIXES = ("lm_head.", "norm.", "rank_head.")  # the heads arm; full trains all but embed.weight


class UpdateSettings(Protocol):
    """What an update reads of ``adapt.AdaptSettings``."""

    steps: int
    batch: int
    lr_heads: float
    lr_full: float
    max_ctx: int
    rank_weight: float
    lam: float
    seed: int
    amp: str


class UpdateTrainer:
    """``theta_train`` (float32) and what its updates need: ``theta_0`` for the anchor, the trained
    parameter names, the replay RNG and a cache of the frozen backbone's states per query (reused
    across heads updates until the backbone changes). Used by the worker thread only."""

    def __init__(self, theta_0: SpecBlockNet, settings: UpdateSettings) -> None:
        self.theta_0, self.cfg = theta_0, settings
        self.theta_train = copy.deepcopy(theta_0)
        self.names = [n for n, _ in theta_0.named_parameters() if n != "embed.weight"]
        self._rng = np.random.default_rng(settings.seed)
        self._cache: dict = {}
        dev = next(theta_0.parameters()).device
        # bf16 products where they are native (CUDA, a CPU with AMX / AVX512-BF16; training's
        # --amp auto rule): one update then costs about half (``docs/real_model.md``). theta_0's
        # head is frozen, so its bf16 copy is made once here rather than cast again per call.
        self.amp = settings.amp == "bf16" or (settings.amp == "auto" and native_bf16(dev))
        w0 = theta_0.lm_head.weight.detach()
        self._w0 = w0.to(torch.bfloat16) if self.amp else w0

    def start_weights(self) -> dict[str, torch.Tensor]:
        """``theta_0``'s trainable tensors: the first weights serving."""
        return {n: p.detach().clone() for n, p in self.theta_0.named_parameters() if n in self.names}

    def samples(self, records: list[QueryRecord]) -> tuple[list[Sample], np.ndarray]:
        """Frozen samples of the buffered queries and their replay weights (the error signal s);
        drops cached states of queries no longer buffered."""
        K = self.theta_0.cfg.K
        pairs = [(r, smp) for r in records if (smp := r.sample(K, self.cfg.max_ctx)) is not None]
        samples = [smp for _, smp in pairs]
        w = np.array([r.s for r, _ in pairs], dtype=float) + 1e-3
        keep = {(smp.uid, smp.n) for smp in samples}
        self._cache = {k: v for k, v in self._cache.items() if k[1:3] in keep}
        return samples, w / w.sum()

    def step(self, arm: str, records: list[QueryRecord], master: dict, backbone: int) -> dict:
        """One update of ``arm`` from the serving weights ``master`` (``backbone``: their backbone's
        version, which keys the cached states). Returns the trained tensors (float32)."""
        samples, weights = self.samples(records)
        net = self.theta_train
        params = dict(net.named_parameters())
        with torch.no_grad():
            for n, t in master.items():
                params[n].copy_(t)
        names = [n for n in self.names if arm == "full" or n.startswith(HEAD_PREFIXES)]
        for n, p in params.items():
            p.requires_grad_(n in names)
        if not samples:
            return {}
        opt = torch.optim.Adam([params[n] for n in names], lr=self.cfg.lr_full if arm == "full" else self.cfg.lr_heads)
        for _ in range(self.cfg.steps):
            pick = self._rng.choice(len(samples), size=min(self.cfg.batch, len(samples)), replace=False, p=weights)
            # One autocast region per step: the trained weights are cast once, not once per sample.
            with torch.autocast(self._w0.device.type, dtype=torch.bfloat16, enabled=self.amp):
                loss = sum(self.sample_loss(net, samples[i], arm, backbone) for i in pick) / len(pick)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        net.requires_grad_(False)
        return {n: params[n].detach().clone() for n in names}

    def _cached(self, key: tuple, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        if key not in self._cache:
            with torch.no_grad():
                self._cache[key] = fn()
        return self._cache[key]

    def sample_loss(self, net: SpecBlockNet, s: Sample, arm: str, bb: int) -> torch.Tensor:
        """Masked draft loss + rank loss + lam * KL to theta_0 on one query.

        Depth by depth, only the rows the valid-prefix mask keeps get V-sized logits (the same
        mask and per-depth normalisation as ``training.losses.block_loss``; with a weak drafter
        most deep positions are masked, so this skips most LM-head work)."""
        dev = next(net.parameters()).device
        args = (s.taps.to(dev), s.tokens.to(dev), s.rows)
        if arm == "full":
            hq = block1_rows(net, *args)
        else:  # the backbone is frozen in a heads update: its states are reused across updates
            hq = self._cached(("hq", s.uid, s.n, bb), lambda: block1_rows(net, *args))
        h0 = self._cached(("h0", s.uid, s.n), lambda: self.theta_0.norm(block1_rows(self.theta_0, *args)))
        w0 = self._w0
        t2d = net.t2d() if getattr(net.cfg, "draft_vocab", None) is not None else None
        alive = s.valid[:, 0].to(dev)
        total = hq.new_zeros(())
        for k in range(net.cfg.K):
            idx = alive.nonzero()[:, 0]
            if idx.numel() == 0:
                break
            logits, rank_logits, _, lse = net.heads(hq[idx, k], with_lse=True)
            ids, p_star = s.y_ids[idx.cpu(), k].to(dev), s.y_lp[idx.cpu(), k].to(dev).softmax(-1)
            if t2d is not None:  # a reduced draft vocabulary: target ids to head rows, no mass off the map
                rows = t2d[ids]
                p_star = p_star * (rows >= 0)
                p_star = p_star / p_star.sum(-1, keepdim=True).clamp_min(1e-20)
                ids = rows.clamp_min(0)
            ce = lse - (p_star * logits.gather(-1, ids)).sum(-1)  # soft CE vs the renormalised top-k
            rank = rank_of(logits.detach(), ids[:, 0])
            rank_ce = F.cross_entropy(rank_logits.float(), bucket_of(rank))
            logq = logits - lse[:, None]
            logq0 = (h0[idx, k].to(w0.dtype) @ w0.T).float().log_softmax(-1)
            kl = (logq.exp() * (logq - logq0)).sum(-1)
            total = total + ce.mean() + self.cfg.rank_weight * rank_ce + self.cfg.lam * kl.mean()
            if k + 1 < net.cfg.K:
                nxt = torch.zeros_like(alive)
                nxt[idx[rank == 0]] = True
                alive = nxt & s.valid[:, k + 1].to(dev)
        return total

