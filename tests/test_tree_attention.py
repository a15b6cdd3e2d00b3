"""The compiled target's fused attention op (``runtime/tree_attention.py``): HF's attention result,
each row alone, and the same bits wherever a row's visible keys sit (same order)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specblock.runtime import tree_attention

pytestmark = pytest.mark.skipif(not tree_attention.load(), reason="the fused attention op needs AVX512F/DQ and a compiler")
MIN = torch.finfo(torch.float32).min


def hf(q, k, v, mask, scale):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = q.shape[1] // k.shape[1], True
    return sdpa_attention_forward(module, q, k, v, mask, scaling=scale)[0]


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 12), span=st.integers(1, 80), d=st.sampled_from([8, 16, 24, 64]), kv=st.sampled_from([1, 3]),
       seed=st.integers(0, 2**16))
def test_equals_hf_attention_and_each_row_alone(rows, span, d, kv, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 3 * kv, rows, d, generator=g)
    k, v = torch.randn(2, 1, kv, span + 7, d, generator=g)[:, :, :, :span]  # a longer cache read in place
    visible = torch.rand(rows, span, generator=g) > 0.5
    visible[:, 0] = True
    mask = torch.where(visible, 0.0, MIN)[None, None]
    out = tree_attention.tree_attention(q, k, v, mask, d**-0.5)
    torch.testing.assert_close(out, hf(q, k, v, mask, d**-0.5), atol=2e-6, rtol=2e-6)
    alone = torch.cat([tree_attention.tree_attention(q[:, :, i:i + 1], k, v, mask[:, :, i:i + 1], d**-0.5)
                       for i in range(rows)], 1)
    assert torch.equal(out, alone)


@settings(max_examples=30, deadline=None)
@given(n_visible=st.integers(1, 40), span=st.integers(40, 100), seed=st.integers(0, 2**16))
def test_a_rows_bits_do_not_depend_on_where_its_keys_sit(n_visible, span, seed):
    """The committed tokens and a node's ancestors sit in other slots in a tree than in plain
    decoding; in the same order they give the same bits (the sums meet the same terms in turn)."""
    g = torch.Generator().manual_seed(seed)
    d = 64
    q = torch.randn(1, 9, 1, d, generator=g)
    keys, values = torch.randn(2, 1, 3, n_visible, d, generator=g)
    outs = []
    for layout in range(3):
        slots = torch.sort(torch.randperm(span, generator=g)[:n_visible]).values if layout else torch.arange(n_visible)
        k, v = torch.randn(2, 1, 3, span, d, generator=g)  # other keys fill the masked slots
        k[:, :, slots], v[:, :, slots] = keys, values
        mask = torch.full((1, 1, 1, span), MIN)
        mask[..., slots] = 0.0
        outs.append(tree_attention.tree_attention(q, k, v, mask, 0.125))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])



@settings(max_examples=40, deadline=None)
@given(span=st.integers(1, 600), ends=st.lists(st.integers(1, 600), min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_rows_that_end_early_in_a_long_span(span, ends, seed):
    """A compiled step's span is the whole buffer (``StaticTarget.one_span``): each row's visible
    slots end far before it, and the op stops at each row's last one (skipping hidden slots 64 at a
    time, then 16, whatever the span's tail): HF's result, and the row's own bits."""
    g = torch.Generator().manual_seed(seed)
    rows = len(ends)
    q = torch.randn(1, 6, rows, 16, generator=g)
    k, v = torch.randn(2, 1, 2, span, 16, generator=g)
    visible = torch.rand(rows, span, generator=g) > 0.3
    for i, end in enumerate(ends):
        end = min(end, span)
        visible[i, end:] = False
        visible[i, end - 1] = True
    mask = torch.where(visible, 0.0, MIN)[None, None]
    out = tree_attention.tree_attention(q, k, v, mask, 0.25)
    torch.testing.assert_close(out, hf(q, k, v, mask, 0.25), atol=2e-6, rtol=2e-6)
    alone = torch.cat([tree_attention.tree_attention(q[:, :, i:i + 1], k, v, mask[:, :, i:i + 1], 0.25)
                       for i in range(rows)], 1)
    assert torch.equal(out, alone)


def test_a_long_causal_prompt_goes_in_chunks_with_each_rows_own_bits():
    """A prompt's thousands of queries go in chunks whose scratch stays in L2, each row stopping at
    its last visible slot (the compiled prefill pads the span past the prompt): 9 heads x 300 rows
    over 512 slots make 11 chunks here. Rows keep their own bits; a row that sees nothing keeps
    softmax's answer over the whole span."""
    g = torch.Generator().manual_seed(0)
    n, span, d = 300, 512, 64
    q = torch.randn(1, 9, n, d, generator=g)
    k, v = torch.randn(2, 1, 3, span, d, generator=g)
    mask = torch.full((n, span), MIN).triu(1)
    mask[n // 2] = MIN
    mask = mask[None, None].contiguous()
    out = tree_attention.tree_attention(q, k, v, mask, d**-0.5)
    torch.testing.assert_close(out, hf(q, k, v, mask, d**-0.5), atol=2e-6, rtol=2e-6)
    alone = torch.cat([tree_attention.tree_attention(q[:, :, i:i + 1], k, v, mask[:, :, i:i + 1], d**-0.5)
                       for i in range(n)], 1)
    assert torch.equal(out, alone)


def test_a_row_that_sees_nothing_averages_every_slot_as_softmax_does():
    q, k, v = torch.randn(1, 3, 2, 16), torch.randn(1, 1, 9, 16), torch.randn(1, 1, 9, 16)
    mask = torch.full((1, 1, 2, 9), MIN)
    mask[0, 0, 1, 4] = 0.0
    out = tree_attention.tree_attention(q, k, v, mask, 0.25)
    torch.testing.assert_close(out, hf(q, k, v, mask, 0.25), atol=2e-6, rtol=2e-6)


def test_refuses_what_it_does_not_compute():
    q, k = torch.randn(1, 6, 2, 16), torch.randn(1, 2, 10, 16)
    mask = torch.zeros(1, 1, 2, 10)
    with pytest.raises(RuntimeError, match="float32"):
        tree_attention.tree_attention(q.double(), k.double(), k.double(), mask.double(), 0.25)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        tree_attention.tree_attention(q, k, k, mask[..., :9], 0.25)
    assert not tree_attention.applies(q.bfloat16(), k.bfloat16(), mask.bfloat16())
    assert not tree_attention.applies(q, k, None) and tree_attention.applies(q, k, mask)
