"""The fused CPU decode step (engines/embedded/fused.py, csrc/fused.cpp) and the block-quantized int4 draft.

The extension is built by `make setup`; where it is not built these tests skip with the reason and the engine
runs eager (every other test then exercises the eager path).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specbuild.engines.embedded import Engine, SamplingParams, fused, step
from specbuild.engines.embedded.kvcache import KVCache
from specbuild.engines.embedded.model import ragged_forward
from specbuild.engines.embedded.quant import BlockLinear, dequantize_blocks, quantize_blocks, quantize_model_
from specbuild.engines.embedded.weights import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
needs_ext = pytest.mark.skipif(fused.extension() is None, reason=f"fused decode step: {fused.status()}")


def _cache(model, mode, slots=4, max_seq=160):
    c = model.cfg
    return KVCache(num_layers=c.num_layers, num_slots=slots, kv_heads=c.num_kv_heads, max_seq=max_seq,
                   head_dim=c.head_dim, dtype=torch.float32, device="cpu", decode_step=mode)


# ---- blocks: exactly gguf-py's ---------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["q4_1", "q8_0"])
def test_blocks_of_a_dequantized_gguf_weight_are_recovered_bit_for_bit(scheme):
    """gguf-py (upstream's own code) quantizes and dequantizes; our quantizer finds the very same blocks back."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType.Q4_1 if scheme == "q4_1" else GGMLQuantizationType.Q8_0
    w = np.random.default_rng(0).standard_normal((48, 128)).astype(np.float32)
    raw = quants.quantize(w, qtype)                                       # [48, bytes per row]
    deq = torch.from_numpy(quants.dequantize(raw, qtype))
    qs, d, m, exact = quantize_blocks(deq, scheme)
    assert exact == 1.0
    assert torch.equal(dequantize_blocks(qs, d, m, scheme), deq)
    blocks = raw.reshape(48, 4, -1)                                       # per block: d (fp16) [m (fp16)] qs
    assert np.array_equal(d.half().numpy().view(np.uint8).reshape(48, 4, 2), blocks[..., :2])
    if scheme == "q4_1":
        assert np.array_equal(m.half().numpy().view(np.uint8).reshape(48, 4, 2), blocks[..., 2:4])
        assert np.array_equal(qs.numpy(), blocks[..., 4:])
    else:
        assert np.array_equal(qs.numpy().view(np.uint8), blocks[..., 2:])
    # an ordinary weight is not a GGUF's: plain min/max blocks, close but not exact
    plain = torch.from_numpy(w)
    qs2, d2, m2, exact2 = quantize_blocks(plain, scheme)
    assert exact2 < 0.5
    err = (dequantize_blocks(qs2, d2, m2, scheme) - plain).abs().max()
    assert err <= (0.3 if scheme == "q4_1" else 0.03) * plain.abs().max()


@needs_ext
@pytest.mark.parametrize("scheme", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 20])
def test_block_kernel_computes_what_the_dequantized_linear_computes(scheme, rows):
    gen = torch.Generator().manual_seed(rows)
    lin = torch.nn.Linear(96, 40, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=gen))
    q, _ = BlockLinear.from_linear(lin, scheme)
    x = torch.randn(rows, 96, generator=gen)
    ref = torch.nn.functional.linear(x, q.dense_weight(), lin.bias)
    got = fused.block_linear(q.kind, x, q.qs, q.d, q.m, q.bias, 40)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    # a row's output does not depend on the others nor on its place in the kernel's groups of 4 rows (one fixed
    # order of additions per output)
    for r in range(rows):
        alone = fused.block_linear(q.kind, x[r:r + 1].clone(), q.qs, q.d, q.m, q.bias, 40)
        assert torch.equal(alone[0], got[r]), r


@needs_ext
@pytest.mark.parametrize("scheme", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 9])
def test_int8_activations_approximate_the_linear_and_keep_rows_independent(scheme, rows):
    """The draft's integer kernels (x rounded to 8 bits per block of 32): close to the dequantized linear, not
    equal to it (another computation), and a row's output does not depend on the other rows."""
    gen = torch.Generator().manual_seed(100 + rows)
    lin = torch.nn.Linear(576, 72, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(72, 576, generator=gen) * 0.05)
    q, _ = BlockLinear.from_linear(lin, scheme)
    x = torch.randn(rows, 576, generator=gen)
    ref = torch.nn.functional.linear(x, q.dense_weight(), lin.bias)
    fp32 = fused.block_linear(q.kind, x, q.qs, q.d, q.m, q.bias, 72)
    q.activations = "int8"
    assert q.kernel_kind == fused.INT8_ACTIVATIONS[q.kind]
    got = q(x)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.03, rel                                  # 8-bit x: ~1 % here; fp32 activations ~1e-7
    assert not torch.equal(got, fp32)
    for r in range(rows):
        assert torch.equal(q(x[r:r + 1].clone())[0], got[r]), r


@needs_ext
@pytest.mark.parametrize("scheme", ["q4_1", "q8_0"])
def test_block_kernels_refuse_blocks_in_the_other_layout(scheme):
    """The int8-activation kinds read blocks interleaved by 16 rows, the fp32 ones as stored: handed the other
    layout (40 rows: not a multiple of 16, so the byte counts differ), a kernel refuses instead of reading past
    the tensor's end."""
    from specbuild.engines.embedded.blocks import interleave_blocks

    lin = torch.nn.Linear(96, 40, bias=False)
    q, _ = BlockLinear.from_linear(lin, scheme)
    x = torch.randn(2, 96)
    stored = (q.qs, q.d, q.m)
    inter = interleave_blocks(*stored)
    for kind, blocks in ((fused.INT8_ACTIVATIONS[q.kind], stored), (q.kind, inter)):
        with pytest.raises(RuntimeError, match="not in its layout"):
            fused.block_linear(kind, x, *blocks, None, 40)
    assert fused.block_linear(fused.INT8_ACTIVATIONS[q.kind], x, *inter, None, 40).shape == (2, 40)
    assert fused.block_linear(q.kind, x, *stored, None, 40).shape == (2, 40)


def _isa_ext(isa: str):
    """The extension to test: the engine's own, or its AVX2 kernels built beside it (skipped on a CPU without
    AVX-512, whose own build is the AVX2 one)."""
    if isa == "native":
        return fused.extension()
    if not fused.cpu_has_avx512():
        pytest.skip("no AVX-512 here: the native build is the AVX2 one")
    return fused.extension_for(isa)


@needs_ext
@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("scheme", ["q4_1", "q8_0"])
@pytest.mark.parametrize("k", [96, 128, 576, 1536])
def test_block_int8_kernels_are_the_q8_scheme_exactly(scheme, k, isa):
    """The Q4_1 / Q8_0 x int8 kernels against the scheme written out in numpy: x rounded per block of 32 (xd =
    max|x| / 127, xq = rint(x / xd) in fp32), the integer dots <q_b, xq_b>, then sum_b d_b xd_b <q_b, xq_b> (+ m_b
    sum(x_b) for Q4_1), with d and m rounded to fp16 as GGUF stores them (these weights are not a GGUF's: their
    fp32 scales are not fp16 values, so the kernel must read the rounded ones). Whatever vector path the machine's build takes (weights interleaved by 16 rows: AVX-512 with
    or without VNNI one vector per group, AVX2 two halves; 24 rows are a whole group and a zero-padded one), each
    output is that sum to within fp32 rounding; a block, a row or a lane in the wrong place is off by far more."""
    gen = torch.Generator().manual_seed(k)
    _assert_q8_scheme_exactly(torch.randn(24, k, generator=gen) * 0.05, torch.randn(3, k, generator=gen), scheme,
                              _isa_ext(isa))


@needs_ext
@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_q4_1_int8_kernel_is_exact_at_its_integer_limits(sign, isa):
    """Without VNNI the Q4_1 x int8 kernel sums a block's byte products in 16-bit lanes before widening them
    (exact while |sum| <= 32767: 8 pairs of 15 x 127 = 30480 at most). The largest codes (15, all but one element
    of each block) against the largest int8 activations (+-127 everywhere) reach that bound: still the scheme's
    exact sums."""
    w = torch.full((24, 576), 0.05)
    w[:, ::32] = -0.05                                      # each block's minimum: code 0, every other element 15
    _assert_q8_scheme_exactly(w, torch.full((3, 576), 0.7 * sign), "q4_1", _isa_ext(isa))


@needs_ext
@pytest.mark.parametrize("isa", ["native", "avx2"])
@pytest.mark.parametrize("signs", [(1.0, 1.0), (1.0, -1.0), (-1.0, 1.0), (-1.0, -1.0)])
def test_q8_0_int8_kernel_is_exact_at_its_integer_limits(signs, isa):
    """With VNNI the Q8_0 x int8 kernel multiplies x + 128 (unsigned) by the signed codes and takes 128 times the
    codes' sum off a block; without, it moves the codes' signs onto x. Codes of +-127 everywhere against int8
    activations of +-127 everywhere (the largest products, and x + 128 at 255 or 1) in every sign pairing, and
    rows of alternating signs: the scheme's exact sums on either path."""
    ws, xs = signs
    w = torch.full((24, 576), 0.05 * ws)
    w[12:, 1::2] *= -1                                      # half the rows alternate their codes' signs
    x = torch.full((3, 576), 0.7 * xs)
    x[2, ::2] *= -1
    _assert_q8_scheme_exactly(w, x, "q8_0", _isa_ext(isa))


@needs_ext
@pytest.mark.parametrize("scheme", ["q4_1", "q8_0"])
def test_block_int8_kernels_give_the_same_bits_on_avx512_as_on_avx2(scheme):
    """The AVX-512 build's int8 dots (with VNNI: Q8_0 as (x + 128) . w less 128 sum(w), Q4_1 in 32-bit lanes) against
    the AVX2 build's (the codes' signs moved onto x; Q4_1 in 16-bit lanes): the same integers per block, so the same
    outputs bit for bit, at 1-9 rows (the row tiles 4 + 4 + 1) and 40 outputs (two groups and a padded one)."""
    if not fused.cpu_has_avx512():
        pytest.skip("no AVX-512 here: the native build is the AVX2 one")
    native, avx2 = fused.extension(), fused.extension_for("avx2")
    gen = torch.Generator().manual_seed(7)
    lin = torch.nn.Linear(576, 40, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 576, generator=gen) * 0.05)
    q, _ = BlockLinear.from_linear(lin, scheme)
    q.activations = "int8"
    qs, d, m = q.kernel_blocks()
    m = m if m is not None else torch.empty(0)
    for rows in (1, 2, 3, 5, 9):
        x = torch.randn(rows, 576, generator=gen)
        a = native.block_linear(q.kernel_kind, x, qs, d, m, torch.empty(0), 40)
        b = avx2.block_linear(q.kernel_kind, x, qs, d, m, torch.empty(0), 40)
        assert torch.equal(a, b), (scheme, rows, (a - b).abs().max().item())


def _assert_q8_scheme_exactly(w: torch.Tensor, x: torch.Tensor, scheme: str, ext) -> None:
    k = w.shape[1]
    lin = torch.nn.Linear(k, 24, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    q, _ = BlockLinear.from_linear(lin, scheme)
    q.activations = "int8"
    qs, d, m = q.kernel_blocks()
    got = ext.block_linear(q.kernel_kind, x, qs, d, m if m is not None else torch.empty(0), torch.empty(0),
                           24).double().numpy()
    nb = k // 32
    if scheme == "q4_1":
        qs = q.qs.numpy().reshape(24, nb, 16)
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)      # [N, nb, 32]: elements 0..31
        d, m = q.d.half().float().numpy().reshape(24, nb), q.m.half().float().numpy().reshape(24, nb)
    else:
        codes = q.qs.numpy().view(np.int8).reshape(24, nb, 32).astype(np.int64)
        d, m = q.d.half().float().numpy().reshape(24, nb), np.zeros((24, nb), np.float32)
    xb = x.numpy().reshape(3, nb, 32)
    amax = np.abs(xb).max(-1)
    xd = (amax / np.float32(127)).astype(np.float32)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xq = np.rint(xb * inv[..., None]).astype(np.int64)                             # [rows, nb, 32]
    dots = np.einsum("nbi,rbi->rnb", codes, xq).astype(np.float64)
    scale = (d[None] * xd[:, None, :]).astype(np.float32).astype(np.float64)       # the fp32 product d_b xd_b
    sums = xb.astype(np.float64).sum(-1)
    ref = (dots * scale).sum(-1) + (m[None].astype(np.float64) * sums[:, None, :]).sum(-1)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


# ---- the fused layers against eager PyTorch ------------------------------------------------------------------
@needs_ext
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_fused_layers_compute_what_eager_computes(arch, request):
    model = load_model(request.getfixturevalue(arch), dtype="float32")
    eager, fast = _cache(model, "eager"), _cache(model, "fused")
    assert step.decode_step_of(model, fast) == "fused" and step.decode_step_of(model, eager) == "eager"
    prompts = [[5, 9, 14, 2, 7] * 6, [3, 4] * 9, [11] * 3]
    for cache in (eager, fast):                                           # ragged prefill into three slots
        ragged_forward(model, cache, [0, 2, 3], [0, 0, 0], prompts, "none")
    # then a ragged step: a verify of 4 positions, a decode step, a second prompt chunk
    rows, starts = [[6, 1, 8, 8], [9], [12, 13]], [30, 18, 3]
    le = ragged_forward(model, eager, [0, 2, 3], starts, rows, "all")
    lf = ragged_forward(model, fast, [0, 2, 3], starts, rows, "all")
    torch.testing.assert_close(lf, le, rtol=1e-4, atol=2e-4)
    assert torch.equal(lf.argmax(-1), le.argmax(-1))
    for layer in range(model.cfg.num_layers):                             # the caches hold the same K/V
        torch.testing.assert_close(fast.k[layer][:4, :, :34], eager.k[layer][:4, :, :34], rtol=1e-4, atol=2e-4)


@needs_ext
def test_fused_rows_do_not_depend_on_who_shares_the_batch(tiny_llama):
    model = load_model(tiny_llama, dtype="float32")
    from specbuild.engines.embedded.step import pack_linears_

    pack_linears_(model)
    a, b = _cache(model, "fused"), _cache(model, "fused")
    p = [7, 8, 9, 10, 11, 12]
    alone = ragged_forward(model, a, [1], [0], [p], "all")
    batched = ragged_forward(model, b, [0, 1, 2], [0, 0, 0], [[3, 3, 3], p, [4] * 10], "all")
    assert torch.equal(batched[3:9], alone)


@needs_ext
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_llama_draft", "tiny_qwen2"])
def test_a_verify_gives_each_row_the_bits_of_decoding_it_alone(arch, request):
    """Lossless speculation rests on this: the rows of one sequence scored in one forward (a verify of K + 1, here
    20 rows: more queries than one attention segment holds, over more positions than one block) are bitwise the
    rows that decoding them one per forward gives, and they leave the same K/V in the cache."""
    from specbuild.engines.embedded.step import pack_linears_

    model = load_model(request.getfixturevalue(arch), dtype="float32")
    pack_linears_(model)
    a, b = _cache(model, "fused"), _cache(model, "fused")
    ctx = [(7 * i) % 50 + 3 for i in range(40)]
    rows = [(5 * i) % 40 + 2 for i in range(20)]
    for c in (a, b):
        ragged_forward(model, c, [0, 1], [0, 0], [ctx, ctx[:9]], "none")
    together = ragged_forward(model, a, [0, 1], [40, 9], [rows, [4]], "all")
    alone = [ragged_forward(model, b, [0], [40 + i], [[t]], "all") for i, t in enumerate(rows)]
    assert torch.equal(together[:20], torch.cat(alone))
    for ka, kb in zip(a.k + a.v, b.k + b.v):
        assert torch.equal(ka[0], kb[0])


@needs_ext
def test_a_forward_in_pieces_with_another_prefill_between_gives_the_same_bits(tiny_llama, monkeypatch):
    """`ragged_forward(between=...)` runs the layers in pieces and calls `between` after each (the scheduler
    prefills a newcomer there, into another slot of the same cache): the rows and the cache they write are
    bitwise those of one whole forward, and so is the newcomer's prefill. A layer range out of bounds is
    refused. A model whose step streams less than PIECES_MIN_BYTES runs whole (`between` is never called)."""
    from specbuild.engines.embedded import model as model_mod
    from specbuild.engines.embedded.step import pack_linears_, runner_for

    model = load_model(tiny_llama, dtype="float32")
    pack_linears_(model)
    small = _cache(model, "fused")
    assert model.step_bytes() < model_mod.PIECES_MIN_BYTES
    ragged_forward(model, small, [0], [0], [[5, 6]], "all", between=lambda: pytest.fail("a small model in pieces"))
    monkeypatch.setattr(model_mod, "PIECES_MIN_BYTES", 0)
    a, b = _cache(model, "fused"), _cache(model, "fused")
    ctx, rows, newcomer = [5, 6, 7, 8], [[9, 10, 11], [12, 13]], [14, 15, 16, 17, 18]
    for c in (a, b):
        ragged_forward(model, c, [0, 1], [0, 0], [ctx, ctx[:2]], "none")
    whole = ragged_forward(model, a, [0, 1], [4, 2], rows, "all")
    alone = ragged_forward(model, a, [2], [0], [newcomer], "all")
    calls, seen = [], []

    def between():
        calls.append(len(calls))
        if len(calls) == 1:
            seen.append(ragged_forward(model, b, [2], [0], [newcomer], "all"))

    pieces = ragged_forward(model, b, [0, 1], [4, 2], rows, "all", between=between)
    assert len(calls) == model_mod.PIECES and torch.equal(pieces, whole) and torch.equal(seen[0], alone)
    for ka, kb in zip(a.k + a.v, b.k + b.v):
        assert torch.equal(ka, kb)
    runner = runner_for(model, a)
    x = torch.zeros(1, model.cfg.hidden_size)
    with pytest.raises(RuntimeError, match="layer range"):
        runner.forward(x, torch.tensor([0]), torch.tensor([0]), 2, model.cfg.num_layers + 1)


def test_a_required_fused_step_that_is_missing_is_refused(tiny_llama, monkeypatch):
    model = load_model(tiny_llama, dtype="float32")
    monkeypatch.setattr(fused, "_EXT", None)
    monkeypatch.setattr(fused, "_TRIED", True)
    monkeypatch.setattr(fused, "_WHY", "not built on this machine (test)")
    with pytest.raises(RuntimeError, match="decode_step='fused' but not built on this machine"):
        step.runner_for(model, _cache(model, "fused"), "fused")
    assert step.runner_for(model, _cache(model, "auto"), "auto") is None        # auto: eager, not an error


# ---- the int4 self-draft ------------------------------------------------------------------------------------
@pytest.mark.parametrize("draft_kv,activations", [("shared", "fp32"), ("own", "fp32"), ("shared", "int8")])
def test_an_int4_self_draft_is_lossless(tiny_llama, draft_kv, activations):
    eng = Engine.from_checkpoints(tiny_llama, tiny_llama, max_batch_size=4, max_seq_len=192, draft_kv=draft_kv,
                                  draft_quantize="int4", online_costs=False, draft_activations=activations)
    assert any(isinstance(m, BlockLinear) for m in eng.draft.modules())
    assert all(m.activations == activations for m in eng.draft.modules() if isinstance(m, BlockLinear))
    assert isinstance(eng.draft.lm_head, BlockLinear) and eng.draft.lm_head.scheme == "q8_0"
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = ["The quick brown fox", "def fibonacci(n):\n", "Paris is the capital of"]
    plain = [eng.generate(p, params, num_draft_tokens=0).token_ids for p in prompts]
    spec = eng.generate_batch([(p, params, 4) for p in prompts], proposer="draft")
    assert [o.token_ids for o in spec] == plain
    assert sum(o.stats.num_draft_tokens for o in spec) > 0
    if activations == "int8" and fused.extension() is not None:    # greedy drafts: the screened head's tokens
        assert eng.draft.lm_head._screen is not None               # made with the engine, not in a request
        calls = []
        real, screens = BlockLinear.greedy_ids, BlockLinear.screens
        BlockLinear.greedy_ids = lambda self, x: calls.append(1) or real(self, x)
        try:
            screened = eng.generate_batch([(p, params, 4) for p in prompts], proposer="draft")
            BlockLinear.screens = lambda self: False                    # the full head's logits, then argmax
            full = eng.generate_batch([(p, params, 4) for p in prompts], proposer="draft")
        finally:
            BlockLinear.greedy_ids, BlockLinear.screens = real, screens
        assert len(calls) >= sum(o.stats.num_drafts for o in screened) > 0
        assert [o.token_ids for o in screened] == [o.token_ids for o in full] == plain
        assert [o.stats.num_accepted_tokens for o in screened] == [o.stats.num_accepted_tokens for o in full]


def test_int4_of_a_gguf_derived_model_holds_the_targets_weights(tiny_llama):
    """A model whose weights are dequantized Q4_1 / Q8_0 blocks (as the demo target is): the int4 draft's weights
    equal the target's, so its logits differ only by the order of additions."""
    from gguf import GGMLQuantizationType, quants

    model = load_model(tiny_llama, dtype="float32")
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear):
                qtype = GGMLQuantizationType.Q8_0 if name == "lm_head" else GGMLQuantizationType.Q4_1
                w = mod.weight.detach().numpy()
                mod.weight.copy_(torch.from_numpy(quants.dequantize(quants.quantize(w, qtype), qtype)))
    draft = load_model(tiny_llama, dtype="float32")
    draft.load_state_dict(model.state_dict())
    quantize_model_(draft, "int4")
    assert draft.quantization_exact == 1.0
    for name, mod in draft.named_modules():
        if isinstance(mod, BlockLinear):
            assert torch.equal(mod.dense_weight(), model.get_submodule(name).weight)


@needs_ext
@needs_ext
@pytest.mark.parametrize("n", [1, 7, 31, 32, 33, 95, 49152])
def test_argmax_rows_is_torch_argmax_with_its_ties_nans_and_infinities(n):
    """The greedy paths' argmax (sampling.greedy_ids) runs on the extension: for each row it must be the index
    torch.argmax gives, the first of equal maxima (in any lane, the vector part or the tail) and the first NaN."""
    from specbuild.engines.embedded.sampling import greedy_ids

    gen = torch.Generator().manual_seed(n)
    rows = [torch.randn(n, generator=gen), torch.randint(-2, 2, (n,), generator=gen).float(),
            torch.full((n,), float("-inf")), torch.zeros(n), -torch.zeros(n)]
    for at in {0, n // 2, n - 1}:
        for special in (float("nan"), float("inf")):
            r = torch.randint(-2, 2, (n,), generator=gen).float()
            r[at] = special
            rows.append(r)
            if n > 2:
                r2 = r.clone()
                r2[(at + n // 3) % n] = special
                rows.append(r2)
    x = torch.stack(rows)
    assert fused.argmax_rows(x) == x.argmax(-1).tolist()
    assert greedy_ids(x[1:3]) == x[1:3].argmax(-1).tolist()
    assert fused.argmax_rows(x[:, :n].t().contiguous().t()) == x.argmax(-1).tolist()     # not contiguous


@needs_ext
def test_a_screened_greedy_head_picks_its_q8_argmax_not_the_screens():
    """A greedy draft's Q8_0 head picks its token among the best candidates of a Q4_1 copy, scored on its own
    Q8_0 blocks (csrc/fused.cpp `screened_argmax`): the token is the full head's argmax, also on rows where the
    Q4_1 copy alone would rank another token first (so the candidates are decided on Q8_0, not on the screen),
    and a row with NaN logits falls back to the full head."""
    gen = torch.Generator().manual_seed(11)
    lin = torch.nn.Linear(96, 3000, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(3000, 96, generator=gen) * 0.05)
    head, _ = BlockLinear.from_linear(lin, "q8_0")
    head.activations = "int8"
    assert head.screens()
    x = torch.randn(64, 96, generator=gen)
    full = head(x).argmax(-1).tolist()
    assert head.greedy_ids(x) == full
    assert [head.greedy_ids(x[r:r + 1])[0] for r in range(0, 64, 9)] == full[::9]
    qs, d, m, _ = quantize_blocks(head.dense_weight(), "q4_1")
    q4 = BlockLinear(qs, d, m)
    q4.activations = "int8"
    assert q4(x).argmax(-1).tolist() != full                 # the screen alone would pick other tokens
    bad = x[:3].clone()
    bad[1] = float("nan")
    assert head.greedy_ids(bad) == head(bad).argmax(-1).tolist()


def test_kernel_loops_give_the_same_bits_from_any_thread_and_at_once():
    """The kernels' loops run on the extension's own workers (not torch's OpenMP, which slowed every loop of a
    serving thread: csrc/fused.cpp, Pool). Whichever thread calls, and with four calling at once (one gets the
    workers, the rest run serially), every call gives the bits the main thread computes."""
    import threading

    from specbuild.engines.embedded.blocks import interleave_blocks
    from specbuild.engines.embedded.kernels import TiledLinear

    gen = torch.Generator().manual_seed(5)
    lin = torch.nn.Linear(576, 1000, bias=True)          # 63 panels: several chunks per worker
    with torch.no_grad():
        lin.weight.copy_(torch.randn(1000, 576, generator=gen) * 0.05)
    tiled = TiledLinear(lin, fused.extension())
    q, _ = BlockLinear.from_linear(lin, "q4_1")
    inter = interleave_blocks(q.qs, q.d, q.m)
    xs = [torch.randn(m, 576, generator=gen) for m in (1, 3, 9)]
    calls = [lambda x=x: tiled(x) for x in xs] + \
            [lambda x=x: fused.block_linear(fused.INT8_ACTIVATIONS[q.kind], x, *inter, None, 1000) for x in xs]
    want = [c() for c in calls]
    bad: list[str] = []

    def caller(t: int) -> None:
        for rep in range(15):
            for i, c in enumerate(calls):
                if not torch.equal(c(), want[i]):
                    bad.append(f"thread {t} rep {rep} call {i}")

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a kernel call never returned"
    assert not bad, bad[:5]


def test_import_specbuild_sets_a_passive_openmp_wait_policy_only_before_torch_and_only_for_ours(tmp_path):
    """`import specbuild` before torch sets OMP_WAIT_POLICY=passive (torch's OpenMP workers would spin on the
    cores the kernels' workers use); not over the user's own choice, not after torch (too late: it says so), and
    never for a foreign program (llama.cpp runs as its users run it)."""
    import os
    import subprocess
    import sys

    probe = ("import os, sys\n{first}\nimport specbuild\nfrom specbuild.core.machine import foreign_env\n"
             "print(os.environ.get('OMP_WAIT_POLICY'), specbuild.OMP_THREADS_SPIN, "
             "foreign_env().get('OMP_WAIT_POLICY'))")

    def run(first: str, **env) -> str:
        base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        out = subprocess.run([sys.executable, "-c", probe.format(first=first)], capture_output=True, text=True,
                             env={**base, **env}, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert run("") == "passive False None"
    assert run("", OMP_WAIT_POLICY="active") == "active False active"
    assert run("import torch") == "None True None"
