"""Latency presets: roofline models for A100-80GB, H100, H200 x Llama-3.1-8B, Qwen3-8B, Qwen3-32B,
the ``paper`` preset that reproduces the digest's breakdown, and ``cpu-calibrated``.

A roofline forward costs ``max(bytes / (BW * eff_bw), flops / (peak * eff_flops)) + launch``:
decoding at batch 1 reads every weight once per forward and the KV cache of every request, and
does 2 FLOPs per weight per token plus attention. Every number is written beside its source or
marked as our assumption. Names: ``<gpu>-<model>``, e.g. ``a100-llama3.1-8b``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specblock.sim.latency import CalibratedLatency, LatencyModel, TableLatency, load_measurements

BF16 = 2  # bytes per parameter / activation element


@dataclass(frozen=True)
class Gpu:
    name: str
    bw_gbs: float  # peak HBM bandwidth, GB/s (vendor datasheet)
    bf16_tflops: float  # peak dense bf16 tensor-core TFLOP/s (vendor datasheet, no sparsity)
    # Efficiency factors (our assumptions): decode GEMVs reach ~80% of peak bandwidth in tuned
    # kernels; small-M GEMMs (tree verification, M <= 64) reach ~50% of peak FLOPs.
    eff_bw: float = 0.80
    eff_flops: float = 0.50
    # Per-forward launch/host overhead for a CUDA-graph-free HF-style forward (assumption: ~15 us
    # per layer of kernel launches, folded into one constant per model in `launch_ms`).
    launch_us_per_layer: float = 15.0


GPUS = {
    "a100": Gpu("A100-80GB SXM", bw_gbs=2039, bf16_tflops=312),  # NVIDIA A100 datasheet
    "h100": Gpu("H100 SXM", bw_gbs=3350, bf16_tflops=989),  # NVIDIA H100 datasheet
    "h200": Gpu("H200 SXM", bw_gbs=4800, bf16_tflops=989),  # NVIDIA H200 datasheet
}


@dataclass(frozen=True)
class Model:
    """Shapes from each model's public config.json on the Hugging Face Hub."""

    name: str
    params_b: float  # total parameters, billions (incl. embeddings; lm_head read every forward)
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, every layer, kv_heads x head_dim, bf16.
        return 2 * self.layers * self.kv_heads * self.head_dim * BF16

    @property
    def layer_params(self) -> float:
        attn = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        return attn + 3 * self.hidden * self.ffn


MODELS = {
    # meta-llama/Llama-3.1-8B: 32 layers, d 4096, 32 q / 8 kv heads x 128, ffn 14336, vocab 128256.
    # KV = 2 * 32 * 8 * 128 * 2 B = 128 KiB per token.
    "llama3.1-8b": Model("Llama-3.1-8B", 8.03, 32, 4096, 32, 8, 128, 14336, 128256),
    # Qwen/Qwen3-8B: 36 layers, d 4096, 32 q / 8 kv heads x 128, ffn 12288, vocab 151936.
    # KV = 2 * 36 * 8 * 128 * 2 B = 144 KiB per token.
    "qwen3-8b": Model("Qwen3-8B", 8.19, 36, 4096, 32, 8, 128, 12288, 151936),
    # Qwen/Qwen3-32B: 64 layers, d 5120, 64 q / 8 kv heads x 128, ffn 25600, vocab 151936.
    # KV = 2 * 64 * 8 * 128 * 2 B = 256 KiB per token.
    "qwen3-32b": Model("Qwen3-32B", 32.8, 64, 5120, 64, 8, 128, 25600, 151936),
}

#: SpS draft models (assumption: the smallest public sibling sharing the tokenizer).
SPS_DRAFT = {"llama3.1-8b": 1.24, "qwen3-8b": 0.60, "qwen3-32b": 0.60}  # Llama-3.2-1B, Qwen3-0.6B
#: EAGLE-3 / SpecBlock draft vocabulary (EAGLE-3 ships a 32k draft vocab; we assume SpecBlock too).
DRAFT_VOCAB = 32000


@dataclass
class RooflineLatency:
    """Roofline :class:`LatencyModel` for one GPU and one target."""

    gpu: Gpu
    model: Model
    overhead_ms: float = 1.0  # assumption: tree build, acceptance, KV pruning, sampling per iteration

    def _forward_ms(self, weight_bytes: float, flops: float, kv_bytes: float, layers: int) -> float:
        g = self.gpu
        t_mem = (weight_bytes + kv_bytes) / (g.bw_gbs * 1e9 * g.eff_bw)
        t_cmp = flops / (g.bf16_tflops * 1e12 * g.eff_flops)
        return 1e3 * max(t_mem, t_cmp) + layers * g.launch_us_per_layer * 1e-3

    def target_ms(self, n: int, ctx: float, batch: int = 1) -> float:
        m = self.model
        weights = m.params_b * 1e9 * BF16
        kv = batch * ctx * m.kv_bytes_per_token  # every request reads its own KV once
        # 2 FLOPs per weight per token; attention: QK^T and PV, 4 * heads * head_dim per
        # (query, key) pair and layer; each request's n/batch queries see ctx keys.
        attn = 4 * m.layers * m.heads * m.head_dim * n * ctx
        return self._forward_ms(weights, 2 * m.params_b * 1e9 * n + attn, kv, m.layers)

    def draft_params(self, drafter: str) -> tuple[float, int]:
        """(parameters read per forward, decoder layers) of each drafter (all assumptions)."""
        m = self.model
        head = DRAFT_VOCAB * m.hidden
        fc = 3 * m.hidden * m.hidden  # EAGLE-3 fusion of low/mid/top features (3h -> h)
        if drafter == "eagle3":  # one decoder layer of the target's shape + fusion + draft lm_head
            return m.layer_params + fc + head, 1
        if drafter == "specblock":
            # Two decoder layers (the layer-wise shift needs >= 2) + one shift W (2h -> h) + fusion
            # + draft lm_head + rank head (negligible). The digest gives no size: our assumption,
            # consistent with its 3.5 ms per block vs 2.4 ms per EAGLE-3 step.
            return 2 * m.layer_params + 2 * m.hidden * m.hidden + fc + head, 2
        if drafter == "medusa":  # Medusa-1: 4 heads, each ResBlock (h x h) + full-vocab lm_head
            return 4 * (m.hidden * m.hidden + m.vocab * m.hidden), 1
        if drafter == "sps":
            return SPS_DRAFT[_key(m)] * 1e9, 16
        raise KeyError(f"roofline preset has no drafter {drafter!r}")

    def draft_ms(self, drafter: str, n_query: int, ctx: float, batch: int = 1, first: bool = False) -> float:
        params, layers = self.draft_params(drafter)
        m = self.model
        # Drafters keep a KV cache of the context too; one layer's worth per drafter layer.
        kv = batch * ctx * 2 * layers * m.kv_heads * m.head_dim * BF16
        return self._forward_ms(params * BF16, 2 * params * n_query, kv, layers)


def _key(m: Model) -> str:
    return next(k for k, v in MODELS.items() if v is m)


# --------------------------------------------------------------------------- the paper preset
def paper_latency() -> TableLatency:
    """The digest's breakdown for Llama-3.1-8B on an A100-80GB (batch 1, T = 0).

    * verification of a tree: 37 ms "either way" (EAGLE-3 and SpecBlock), taken flat in n;
    * EAGLE-3: 17 ms for depth 7 -> 17/7 = 2.43 ms per drafter forward;
    * SpecBlock: 7 ms for 2 blocks -> 3.5 ms per block forward;
    * Medusa, SpS: from their T_D% with the same 37 ms verify, T_D = d / (d + 37):
      Medusa 6% -> 2.36 ms (one forward); SpS 38% -> 22.7 ms over gamma = 5 forwards (our gamma);
    * T_target(1), plain AR decoding: the digest gives none. We take 26.8 ms, what the EAGLE-3
      row implies (Spd 2.92 = tau 5.89 x T1 / (37 + 17) ms). `experiments/paper_consistency.py`
      shows what the other choice (from the SpecBlock row, 32.0 ms) changes.
    """
    return TableLatency(
        t1_ms=26.8,
        verify_ms=37.0,
        draft_ms_per_forward={"eagle3": 17.0 / 7, "specblock": 3.5, "medusa": 0.06 / 0.94 * 37.0,
                              "sps": 0.38 / 0.62 * 37.0 / 5},
        overhead_ms=0.0,
    )


DEFAULT_CPU_JSON = Path(__file__).parent / "data" / "latency_cpu.json"


def latency_preset(name: str, latency_file: str | None = None) -> tuple[LatencyModel, str]:
    """Resolve a preset name to (latency model, target model key)."""
    if name == "paper":
        return paper_latency(), "llama3.1-8b"
    if name == "cpu-calibrated":
        meas = load_measurements(latency_file or DEFAULT_CPU_JSON)
        return CalibratedLatency(meas), "llama3.1-8b"
    gpu, _, model = name.partition("-")
    if gpu in GPUS and model in MODELS:
        return RooflineLatency(GPUS[gpu], MODELS[model]), model
    raise KeyError(f"unknown preset {name!r}; known: {', '.join(preset_names())}")


def preset_names() -> list[str]:
    return ["paper", "cpu-calibrated", "table"] + [f"{g}-{m}" for g in GPUS for m in MODELS]
