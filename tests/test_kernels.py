"""fp32 linears (engines/embedded/kernels.py): the fused extension's tiled kernel and oneDNN's packed one compute
what torch's linear computes, with batch-invariant rows; the engine uses the one measured faster on this machine by
default where the extension is built, oneDNN where it is not, and neither when told "aten"."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from specbuild.engines.embedded import fused
from specbuild.engines.embedded.kernels import PackedLinear, TiledLinear, onednn_available
from specbuild.engines.embedded.step import (auto_linear_kernel, linear_kernel_choice, linear_kernel_of,
                                             pack_linears_)
from specbuild.engines.embedded.kvcache import KVCache
from specbuild.engines.embedded.model import ragged_forward
from specbuild.engines.embedded.quant import Int8Linear, quantize_model_
from specbuild.engines.embedded.weights import load_model

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN packed linear")
needs_ext = pytest.mark.skipif(fused.extension() is None, reason=f"fused decode step: {fused.status()}")


def _pack_all(checkpoint, kernel):
    """(the model as loaded, a second copy with every fp32 linear put on `kernel`)."""
    ref, model = load_model(checkpoint), load_model(checkpoint)
    n_linears = sum(1 for m in model.modules() if type(m) is nn.Linear)
    assert pack_linears_(model, kernel) == n_linears > 0
    return ref, model


def _linear(n_out, n_in, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, n_in, generator=gen))
        if bias:
            lin.bias.copy_(torch.randn(n_out, generator=gen))
    return lin, gen


@needs_ext
@pytest.mark.parametrize("bias", [False, True])
def test_tiled_linear_computes_what_linear_computes(bias):
    lin, gen = _linear(83, 96, bias, 11)                   # 83 outputs: full weight tiles and a remainder
    tiled = TiledLinear(lin, fused.extension())
    for shape in [(1, 96), (2, 96), (3, 96), (7, 96), (8, 96), (9, 96), (12, 96), (13, 96), (2, 5, 96), (129, 96),
                  (300, 96)]:                                                              # every tile
        x = torch.randn(*shape, generator=gen)
        torch.testing.assert_close(tiled(x), lin(x), rtol=1e-4, atol=1e-4)
    x = torch.randn(3, 6, 96, generator=gen)[:, 1:4]          # a non-contiguous view, as a split produces
    torch.testing.assert_close(tiled(x), lin(x), rtol=1e-4, atol=1e-4)
    assert torch.equal(tiled.weight, lin.weight)              # the panels unpack to the layer's weight, exactly
    assert tiled.panels.shape == (6, 96, 16) and not tiled.panels[-1, :, 3:].any()   # 83 = 5 x 16 + 3, zero-padded


@needs_ext
@pytest.mark.parametrize("rows", [8, 12])        # AVX-512: one 8 x 3 and one 12 x 2 tile; AVX2: row groups
def test_tiled_outputs_are_one_fma_chain_in_input_order(rows):
    """Every output is fma(x[K-1], w[K-1], ... fma(x[0], w[0], 0)) in fp32: what makes a row's result independent
    of the tile, the row count and the vector width (AVX2 and AVX-512 builds agree bitwise). Written out in numpy:
    np.float32 products and sums round as fma does only where x * w is exact, so the inputs are small integers
    times powers of two (every product and partial sum exact in fp32) plus one inexact column that is summed
    last, where the order decides the rounding."""
    import numpy as np

    gen = torch.Generator().manual_seed(5)
    n, k = 40, 64
    w = torch.randint(-8, 8, (n, k), generator=gen).float() / 4
    x = torch.randint(-8, 8, (rows, k), generator=gen).float() / 8
    x[:, -1] = torch.tensor([1e-3, 3.3e-4, 7e-5, 2e-3, 5e-4, 9e-5, 1.7e-3, 4.4e-4, 6e-4, 2.2e-4, 8e-5, 1.1e-3])[:rows]
    # (the last column: far below the sum's ulp)
    w[:, -1] = 1.0
    lin = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    got = TiledLinear(lin, fused.extension())(x)
    xs, ws = x.numpy(), w.numpy()
    want = np.zeros((rows, n), dtype=np.float32)
    for i in range(k):                                        # in order: each step's sum rounded to fp32
        want = (want + xs[:, i:i + 1] * ws[:, i][None, :]).astype(np.float32)
    assert np.array_equal(got.numpy(), want)


@needs_ext
def test_tiled_rows_do_not_depend_on_the_other_rows_at_any_row_count():
    """Batch invariance at the kernel for every tile shape (1-12 row tiles, every panel remainder; past 12 rows a
    12-row first tile and 6-row tiles, every remainder 1-6): row i of an m-row call is bitwise row i computed
    alone, at any row count (a prefill chunk of 300 rows too)."""
    lin, gen = _linear(1001, 576, True, 12)
    tiled = TiledLinear(lin, fused.extension())
    limit = 300
    x = torch.randn(limit, 576, generator=gen)
    alone = torch.cat([tiled(x[i:i + 1]) for i in range(limit)])
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16, 18, 19, 24, 25, 72, 129, limit):
        assert torch.equal(tiled(x[:m]), alone[:m]), m


@needs_ext
@pytest.mark.skipif(not fused.cpu_has_avx512(), reason="no AVX-512 here: the engine's own build is the AVX2 one")
def test_an_avx2_build_computes_the_native_builds_bits_at_every_row_tile():
    """The AVX2 kernels (1 x 4 and 2-3 x 2 panel tiles; 4-12 rows as groups of up to 3 rows taking turns over
    blocks of k, on 2 panels and on a thread's odd last one; past 12 rows a 12-row first tile and 6-row tiles)
    against the AVX-512 ones (other tiles, another vector width), built here from the same source with
    SPECBUILD_FUSED_ISA's flags: bitwise the same outputs at every row count, K not a multiple of the k block
    (600 = 9 x 64 + 24), a remainder panel and a bias."""
    native, avx2 = fused.extension(), fused.extension_for("avx2")
    gen = torch.Generator().manual_seed(13)
    n, k = 1001, 600
    w, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    p_native, p_avx2 = native.pack_panels(w), avx2.pack_panels(w)
    assert torch.equal(p_native, p_avx2)
    x = torch.randn(160, k, generator=gen)
    for m in (*range(1, 15), 16, 18, 24, 25, 37, 160):
        want = native.tiled_linear(x[:m], p_native, bias, n)
        got = avx2.tiled_linear(x[:m], p_avx2, bias, n)
        assert torch.equal(got, want), m
    torch.testing.assert_close(want, x @ w.T + bias, rtol=1e-4, atol=1e-3)


def test_a_bad_kernel_isa_is_refused_with_the_values_it_takes(monkeypatch, capsys):
    monkeypatch.setenv("SPECBUILD_FUSED_ISA", "sse4")
    assert fused.main(["status"]) == 2
    assert "SPECBUILD_FUSED_ISA='sse4': expected one of native, avx2" in capsys.readouterr().err
    monkeypatch.setenv("SPECBUILD_FUSED_ISA", " AVX2 ")
    assert fused.isa() == "avx2" and fused.cflags()[-2:] == ["-mno-avx512f", "-mno-avxvnni"]
    monkeypatch.delenv("SPECBUILD_FUSED_ISA")
    assert fused.isa() == "native" and fused.cflags() == fused.BASE_CFLAGS


@needs_ext
def test_auto_puts_fp32_linears_on_the_kernel_measured_faster_here(tiny_llama):
    """"auto" is the machine's measured pick (tiled or oneDNN: `linear_kernel.json` beside the extension), never
    an assumption about which one wins: on a machine or a setup run where oneDNN measured faster, auto is oneDNN."""
    ref, model = _pack_all(tiny_llama, "auto")
    assert linear_kernel_of(model) == auto_linear_kernel() == linear_kernel_choice()["kernel"]
    _assert_same_logits(model, ref)


@needs_ext
def test_tiled_kernel_holds_each_weight_once_in_panels_and_a_tied_lm_head_keeps_the_embedding(tiny_llama):
    ref, model = _pack_all(tiny_llama, "tiled")
    assert linear_kernel_of(model) == "tiled"
    panel_bytes = sum(m.panels.numel() * 4 for m in model.modules() if isinstance(m, TiledLinear))
    plain_bytes = sum(m.weight.numel() * 4 for m in ref.modules() if type(m) is nn.Linear
                      and not (ref.cfg.tie_word_embeddings and m is ref.lm_head))
    tied = model.lm_head.panels.numel() * 4 if model.cfg.tie_word_embeddings else 0
    # the layers' weights moved into panels (padded to 16 outputs), no second copy; a tied lm_head's panels are
    # one, since the embedding stays for the lookup
    assert model.num_bytes() - ref.num_bytes() == panel_bytes - plain_bytes
    assert all(type(m) is not nn.Linear for m in model.modules())
    if model.cfg.tie_word_embeddings:
        assert torch.equal(model.lm_head.weight, model.embed.weight) and tied > 0
    _assert_same_logits(model, ref)


@needs_ext
def test_a_screened_fp32_head_gives_the_full_heads_argmax_bit_for_bit(monkeypatch):
    """A greedy row's token from the tiled head's Q8_0 screen (csrc/fused.cpp `bounded_argmax`): the outputs that
    the proven bound cannot rule out are computed on the panels, so the token is the argmax of the full output,
    the first of equal maxima, also where the screen alone ranks another output first or cannot tell two apart,
    and a row with a NaN, an infinity, or too many candidates is decided on the full head."""
    from specbuild.engines.embedded.sampling import greedy_ids

    monkeypatch.setattr(TiledLinear, "screen_min_out", 0)
    monkeypatch.setattr(TiledLinear, "screen_chunk_rows", 1000)     # the Q8_0 copy made in 7 pieces
    lin, gen = _linear(6003, 96, False, 5)
    with torch.no_grad():
        w0 = lin.weight[0]
        j = int(torch.where((w0[:32] > 0) & (w0[:32] < w0[:32].abs().max() / 2))[0][0])
        lin.weight[1] = w0
        lin.weight[1, j] += w0[:32].abs().max() / 127 / 4  # the same Q8_0 blocks as row 0, larger where x = w0
        lin.weight[4000] = lin.weight[7]                  # an exact tie: the first of the two wins
        lin.weight[5000] = lin.weight[1]                  # and another, after row 1
    head = TiledLinear(lin, fused.extension())
    assert head.screens()
    head.prepare_screen()
    w = lin.weight.detach()
    x = torch.cat([torch.randn(40, 96, generator=gen), 3 * torch.randn(8, 96, generator=gen),
                   w[0:1], w[7:8] * 2, -w[0:1], torch.zeros(1, 96), torch.full((1, 96), 1e-3)])
    counts = torch.empty(x.shape[0], dtype=torch.long)
    got = head.greedy_ids(x, counts)
    want = greedy_ids(head(x))
    assert got == want == head(x).argmax(-1).tolist()
    assert got[48] == 1 and got[49] == 7                  # the larger of two near-equal rows; the first of a tie
    c = counts.tolist()
    assert sorted(c)[len(c) // 2] <= 32 and max(c[:48]) >= 2      # few candidates, decided on the panels
    assert c[51] > head.SCREEN_CAP                        # x = 0: every output ties, the full head decides
    q8 = fused.extension().block_linear(fused.INT8_ACTIVATIONS[fused.Q8_0], x[48:49], *head._screen[:2],
                                        torch.empty(0), torch.empty(0), head.out_features)
    assert q8[0, 0] == q8[0, 1] and q8.argmax(-1).item() == 0    # the screen alone cannot tell rows 0 and 1 apart
    assert [head.greedy_ids(x[r:r + 1])[0] for r in range(0, x.shape[0], 5)] == want[::5]   # one row at a time
    bad = x[:4].clone()
    bad[1, 3] = float("nan")
    bad[2, 5] = float("inf")
    counts = torch.empty(4, dtype=torch.long)
    assert head.greedy_ids(bad, counts) == head(bad).argmax(-1).tolist()
    assert counts.tolist()[1:3] == [-1, -1]


@needs_ext
def test_a_greedy_verify_reads_the_screened_head_and_keeps_every_token(tiny_llama, monkeypatch):
    """The scorer takes a greedy verify's tokens from the target head's screen (`scorer.GreedyRows`), and the
    scheduler a greedy first token after the prefill: the same tokens and accepted counts as from the full logits,
    with speculation off and on; a sampling request or one still suppressing its stop ids gets the logits."""
    from specbuild.engines.embedded import Engine, SamplingParams
    from specbuild.engines.embedded.scorer import TargetScorer

    monkeypatch.setattr(TiledLinear, "screen_min_out", 0)
    eng = Engine.from_checkpoints(tiny_llama, tiny_llama, max_batch_size=4, max_seq_len=192, linear_kernel="tiled",
                                  draft_quantize="int4", online_costs=False, draft_activations="int8")
    head = eng.target.lm_head
    assert eng.scorer.screens() and head._screen is not None                   # made with the engine
    screen_bytes = sum(t.numel() * t.element_size() for t in head._screen)      # the roofline of a greedy step
    assert eng.target.greedy_step_bytes() == eng.target.step_bytes() - head.panels.numel() * 4 + screen_bytes
    # a block head's greedy_ids screens a draft's guess (not bound to be exact): a scorer never takes it
    assert eng.draft.lm_head.screens() and not TargetScorer(eng.draft, eng.scorer.cache, "cpu").screens()
    calls = []
    real = TiledLinear.greedy_ids
    monkeypatch.setattr(TiledLinear, "greedy_ids", lambda self, x, counts=None: calls.append(x.shape[0]) or
                        real(self, x, counts))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = ["The quick brown fox", "def fibonacci(n):\n", "Paris is the capital of"]

    def run():
        return [eng.generate_batch([(p, params, k) for p in prompts], proposer="draft") for k in (0, 4)]

    screened = run()
    assert len(calls) > 0 and max(calls) > len(prompts)          # verifies of K + 1 rows read the screen
    assert calls.count(1) >= 2 * len(prompts)                    # and each request's first token, after its prefill
    monkeypatch.setattr(TargetScorer, "screens", lambda self: False)
    n = len(calls)
    full = run()
    assert len(calls) == n
    for a, b in zip(screened, full):
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        assert [o.stats.num_accepted_tokens for o in a] == [o.stats.num_accepted_tokens for o in b]
    assert [o.token_ids for o in screened[0]] == [o.token_ids for o in screened[1]]
    monkeypatch.undo()
    monkeypatch.setattr(TiledLinear, "screen_min_out", 0)
    calls.clear()
    monkeypatch.setattr(TiledLinear, "greedy_ids", lambda self, x, counts=None: calls.append(x.shape[0]) or
                        real(self, x, counts))
    eng.generate("The quick brown fox", SamplingParams(max_tokens=6, temperature=0.8, seed=1), num_draft_tokens=2)
    eng.generate("The quick brown fox", SamplingParams(max_tokens=6, min_tokens=6), num_draft_tokens=2)
    assert calls == []


def test_a_required_tiled_kernel_without_the_extension_is_refused(tiny_llama, monkeypatch):
    from specbuild.engines.embedded import step

    monkeypatch.setattr(step, "extension", lambda: None)
    with pytest.raises(RuntimeError, match="linear_kernel='tiled' needs the fused extension"):
        pack_linears_(load_model(tiny_llama), "tiled")
    model = load_model(tiny_llama)
    pack_linears_(model)                                    # auto without it: oneDNN where available, else aten
    assert linear_kernel_of(model) == ("onednn" if onednn_available() else "aten")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_computes_what_linear_computes(bias):
    gen = torch.Generator().manual_seed(1)
    lin = nn.Linear(96, 80, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(80, 96, generator=gen))
        if bias:
            lin.bias.copy_(torch.randn(80, generator=gen))
    packed = PackedLinear(lin)
    for shape in [(1, 96), (7, 96), (2, 5, 96)]:
        x = torch.randn(*shape, generator=gen)
        torch.testing.assert_close(packed(x), lin(x), rtol=1e-4, atol=1e-4)
    x = torch.randn(3, 6, 96, generator=gen)[:, 1:4]          # a non-contiguous view, as a split produces
    torch.testing.assert_close(packed(x), lin(x), rtol=1e-4, atol=1e-4)


@needs_onednn
def test_packed_rows_do_not_depend_on_the_other_rows():
    """Batch invariance at the kernel: row i of a 9-row call is bitwise row i computed alone."""
    gen = torch.Generator().manual_seed(2)
    lin = nn.Linear(576, 1536, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(1536, 576, generator=gen))
    packed = PackedLinear(lin)
    x = torch.randn(9, 576, generator=gen)
    full = packed(x)
    for m in (1, 2, 5):
        assert torch.equal(packed(x[:m]), full[:m])
    assert torch.equal(packed(x[4:5]), full[4:5])


def _assert_same_logits(model, ref) -> None:
    """`model` (its linears swapped) computes what `ref` (as loaded) computes over a 25-token prompt."""
    toks = list(range(5, 30))
    with torch.inference_mode():
        a = ragged_forward(ref, _cache(ref), [0], [0], [toks], "all")
        b = ragged_forward(model, _cache(model), [0], [0], [toks], "all")
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def _cache(model, slots=2):
    c = model.cfg
    return KVCache(num_layers=c.num_layers, num_slots=slots, kv_heads=c.num_kv_heads, max_seq=128,
                   head_dim=c.head_dim, dtype=torch.float32, device="cpu")


@needs_onednn
def test_a_sequences_logits_do_not_depend_on_who_shares_its_batch(tiny_llama):
    """With packed linears the target's verify logits for one request are bitwise the same alone or batched
    with another request (aten's sgemm is not: its blocking changes with the row count)."""
    model = load_model(tiny_llama)
    assert pack_linears_(model) == model.cfg.num_layers * 4 + 1     # (qkv, o, gate_up, down) per block + lm_head
    cache = _cache(model)
    prompt, other, rows = list(range(10, 40)), list(range(50, 70)), [3, 4, 5, 6, 7]
    with torch.inference_mode():
        ragged_forward(model, cache, [0], [0], [prompt], "none")
        ragged_forward(model, cache, [1], [0], [other], "none")
        alone = ragged_forward(model, cache, [0], [len(prompt)], [rows], "all")
        shared = ragged_forward(model, cache, [0, 1], [len(prompt), len(other)], [rows, [9]], "all")[:len(rows)]
    assert torch.equal(alone, shared)


@needs_onednn
def test_pack_swaps_only_fp32_linears_and_keeps_the_models_output(tiny_llama):
    ref, model = _pack_all(tiny_llama, "onednn")
    assert linear_kernel_of(model) == "onednn" and linear_kernel_of(ref) == "aten"
    assert model.num_bytes() == ref.num_bytes() + ref.lm_head.weight.numel() * 4   # tied lm_head: own packed copy
    _assert_same_logits(model, ref)
    assert pack_linears_(load_model(tiny_llama), "aten") == 0


@needs_onednn
def test_an_int8_linear_keeps_int8_for_decode_rows_and_prefills_on_an_fp32_copy():
    from specbuild.engines.embedded.quant import dequantize_weight

    gen = torch.Generator().manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 96))
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(96, 64, generator=gen))
    q = quantize_model_(model, "int8")[0]
    assert isinstance(q, Int8Linear)
    decode, prefill = torch.randn(1, 3, 64, generator=gen), torch.randn(1, 40, 64, generator=gen)
    before_decode, before_prefill = q(decode), q(prefill)
    assert pack_linears_(model) == 1 and q.prefill_packed is not None
    assert torch.equal(q(decode), before_decode)                      # the int8 kernel, untouched
    ref = nn.functional.linear(prefill, dequantize_weight(q.qweight, q.scales), q.bias)
    got = q(prefill)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)         # fp32 on the dequantized weight ...
    assert not torch.equal(got, before_prefill)                       # ... not the bf16-activation int8 kernel


def test_an_unknown_linear_kernel_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="linear_kernel must be one of auto, tiled, onednn, aten"):
        pack_linears_(load_model(tiny_llama), "mkl")


@needs_onednn
def test_engine_packs_by_default_and_honours_aten_in_engine_config(tiny_llama, tmp_path):
    from specbuild.engines.embedded.engine import Engine
    from specbuild.engines.embedded.sampling import SamplingParams

    eng = Engine.from_checkpoints(tiny_llama, max_batch_size=2, max_seq_len=128)
    assert linear_kernel_of(eng.target) == auto_linear_kernel() != "aten"      # tiled or oneDNN, as measured
    out_packed = eng.generate("The quick brown", SamplingParams(max_tokens=6)).token_ids

    engine_dir = tmp_path / "engine"
    shutil.copytree(tiny_llama, engine_dir / "target")
    (engine_dir / "engine_config.json").write_text(json.dumps(
        {"target": "target", "max_batch_size": 2, "max_seq_len": 128, "linear_kernel": "aten"}))
    eng2 = Engine.from_build_dir(engine_dir)
    assert linear_kernel_of(eng2.target) == "aten"
    out_aten = eng2.generate("The quick brown", SamplingParams(max_tokens=6)).token_ids
    assert len(out_packed) == len(out_aten) == 6


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def test_onednn_sees_a_bounded_set_of_row_counts():
    """oneDNN caches a primitive per input shape (~0.5 MB each): 200 distinct row counts through the raw op grew a
    process by ~127 MB here, and ragged serving batches grew the soak's engine by 7 MB/min. The bucketed call keeps
    oneDNN to 1..16 rows and 8 buckets (chunks of 256 above)."""
    from specbuild.engines.embedded.kernels import ROW_BUCKETS, onednn_linear, row_bucket

    assert [row_bucket(m) for m in (1, 7, 16, 17, 25, 200, 256, 257)] == [1, 7, 16, 24, 32, 256, 256, 256]
    seen = {row_bucket(m) for m in range(1, 2000)}
    assert seen == set(range(1, 17)) | set(ROW_BUCKETS)
    w = torch.randn(1536, 576)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    x = torch.randn(700, 576)
    torch.testing.assert_close(onednn_linear(x, packed, None), x @ w.T, rtol=1e-4, atol=1e-3)
    for m in range(1, 40):
        onednn_linear(x[:m], packed, None)
    before = _rss_mb()
    for m in range(40, 440, 2):
        onednn_linear(x[:m], packed, None)
    assert _rss_mb() - before < 40


@needs_ext
@needs_onednn
@pytest.mark.parametrize("faster", ["tiled", "onednn"])
def test_auto_follows_the_kernel_measured_faster_on_this_machine(tiny_llama, monkeypatch, faster):
    from specbuild.engines.embedded import step

    monkeypatch.setattr(step, "_CHOICE", {"kernel": faster, "tiled_ms": 1.0, "onednn_ms": 1.0})
    model = load_model(tiny_llama)
    pack_linears_(model)
    assert linear_kernel_of(model) == faster
    assert isinstance(model.layers[0].gate_up, TiledLinear if faster == "tiled" else PackedLinear)


@needs_ext
@needs_onednn
def test_the_measured_choice_is_saved_beside_the_extension_and_read_back(monkeypatch, tmp_path):
    from specbuild.engines.embedded import step

    monkeypatch.setattr(step, "_CHOICE", None)
    monkeypatch.setattr(fused, "build_dir", lambda: tmp_path)
    got = step.linear_kernel_choice()
    assert got["kernel"] in ("tiled", "onednn") and got["tiled_ms"] > 0 and got["onednn_ms"] > 0
    assert got["kernel"] == ("tiled" if got["tiled_ms"] <= got["onednn_ms"] else "onednn")
    assert got["stable"] == (got["spread"] <= step.STABLE_SPREAD and got["cpu_share"] >= step.MIN_CPU_SHARE)
    if got["stable"]:
        assert json.loads((tmp_path / step.CHOICE_FILE).read_text())["kernel"] == got["kernel"]
    else:                                   # measured on a busy machine: this process only
        assert not (tmp_path / step.CHOICE_FILE).exists()
    (tmp_path / step.CHOICE_FILE).write_text(json.dumps({**got, "kernel": "onednn", "stable": True}))   # read back
    monkeypatch.setattr(step, "_CHOICE", None)
    monkeypatch.setattr(step, "measure_linear_kernels", lambda: pytest.fail("measured again"))
    assert step.auto_linear_kernel() == "onednn"


@needs_onednn
def test_the_roofline_counts_what_a_step_streams_whatever_the_kernel(tiny_llama):
    """A step reads every layer's weights and the lm_head, not the embedding table (one row per token): with the
    tied lm_head on its own tensor that is the model's bytes; with oneDNN's reordered copy, the copy and not the
    table."""
    ref = load_model(tiny_llama)
    emb = ref.embed.weight.numel() * 4
    if ref.cfg.tie_word_embeddings:
        assert ref.step_bytes() == ref.num_bytes()
    else:
        assert ref.step_bytes() == ref.num_bytes() - emb
    packed = load_model(tiny_llama)
    pack_linears_(packed, "onednn")
    assert packed.step_bytes() == packed.num_bytes() - emb
    assert packed.step_bytes() == ref.step_bytes()              # the same weights stream, in another layout


def test_a_choice_measured_on_a_busy_machine_is_used_but_not_saved(monkeypatch, tmp_path):
    from specbuild.engines.embedded import step

    busy = {"kernel": "onednn", "tiled_ms": 152.7, "onednn_ms": 128.3, "spread": 1.9, "stable": False}
    monkeypatch.setattr(step, "_CHOICE", None)
    monkeypatch.setattr(fused, "build_dir", lambda: tmp_path)
    monkeypatch.setattr(step, "measure_linear_kernels", lambda: dict(busy))
    assert step.linear_kernel_choice() == busy and not (tmp_path / step.CHOICE_FILE).exists()
    quiet = {**busy, "kernel": "tiled", "tiled_ms": 5.7, "onednn_ms": 7.3, "spread": 1.02, "cpu_share": 0.98,
             "stable": True}
    monkeypatch.setattr(step, "_CHOICE", None)                       # the next process measures again
    monkeypatch.setattr(step, "measure_linear_kernels", lambda: dict(quiet))
    assert step.linear_kernel_choice()["kernel"] == "tiled"
    assert json.loads((tmp_path / step.CHOICE_FILE).read_text())["kernel"] == "tiled"
    # a choice saved before the stability checks (no "stable", or no "cpu_share": perhaps a busy machine's) is
    # measured again
    for old in ({"kernel": "onednn", "tiled_ms": 152.7, "onednn_ms": 128.3},
                {"kernel": "onednn", "tiled_ms": 191.9, "onednn_ms": 176.0, "spread": 1.14, "stable": True}):
        (tmp_path / step.CHOICE_FILE).write_text(json.dumps(old))
        monkeypatch.setattr(step, "_CHOICE", None)
        assert step.linear_kernel_choice()["kernel"] == "tiled"
        assert json.loads((tmp_path / step.CHOICE_FILE).read_text())["stable"] is True


@needs_ext
@needs_onednn
def test_a_pick_measured_while_other_work_held_the_cores_is_not_saved(monkeypatch, tmp_path):
    """A steady competitor (one busy process per core) slows both kernels alike: the repetitions agree (spread
    1.14 in the case that moved a real pick) but this process got half the CPU it asked for. The measurement
    reads its own CPU time: here every core it asks for is made to look half taken."""
    from specbuild.engines.embedded import step

    real_wall = step.time.perf_counter

    def cpu_half_of_wall():                   # the process's CPU seconds = half of its threads' wall seconds
        return real_wall() * step._usable_threads() * 0.5

    monkeypatch.setattr(step, "_process_cpu_s", cpu_half_of_wall)
    got = step.measure_linear_kernels(reps=2)
    assert 0.45 < got["cpu_share"] < 0.55 and got["stable"] is False
    assert "50% of its threads' cores" in step.busy_reason(got) or got["spread"] > step.STABLE_SPREAD
    monkeypatch.setattr(step, "_CHOICE", None)
    monkeypatch.setattr(fused, "build_dir", lambda: tmp_path)
    monkeypatch.setattr(step, "measure_linear_kernels", lambda: dict(got))
    assert step.linear_kernel_choice()["kernel"] == got["kernel"]
    assert not (tmp_path / step.CHOICE_FILE).exists()                 # this process only; the next measures again
