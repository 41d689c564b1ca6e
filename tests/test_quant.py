"""int8 weight-only quantization: accuracy of the quantized linear, shapes, stored format round trip,
and a quantized engine model that still agrees with its fp32 original."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specbuild.engines.embedded.quant import (Int8Linear, dequantize_weight, load_quantized_state_dict_,
                                              quantize_model_, quantize_weight, save_quantized_model)
from specbuild.engines.embedded.weights import load_quantized_model
from specbuild.core.errors import SourceError, UsageError


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def test_quantize_weight_per_channel_bounds():
    torch.manual_seed(0)
    w = torch.randn(48, 40) * torch.linspace(0.01, 10, 48)[:, None]     # rows of very different scale
    q, s = quantize_weight(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and s.shape == (48,)
    assert int(q.abs().max()) == 127
    # Per-row rounding error is at most half a step of that row's own scale.
    err = (dequantize_weight(q, s) - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-6).all())


@pytest.mark.parametrize("shape", [(1, 64), (3, 64), (2, 5, 64), (40, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_close_to_fp32(shape, bias):
    torch.manual_seed(1)
    lin = nn.Linear(64, 96, bias=bias)
    q = Int8Linear.from_linear(lin)
    x = torch.randn(*shape)
    y, ref = q(x), lin(x)
    assert y.shape == ref.shape == (*shape[:-1], 96)
    assert y.dtype == x.dtype
    # int8 weights (~0.4% error) plus bf16 activations (~0.4%): well under 3%.
    assert _rel_err(y, ref) < 0.03


def test_int8_linear_rejects_bad_tensors():
    with pytest.raises(UsageError, match="int8"):
        Int8Linear(torch.zeros(4, 4), torch.ones(4))
    with pytest.raises(UsageError, match="scales"):
        Int8Linear(torch.zeros(4, 4, dtype=torch.int8), torch.ones(3))


def test_interleaved_blocks_hold_fp16_scales_and_refuse_what_fp16_cannot_hold():
    """The int8-activation kernels read each block's d and m in fp16, as GGUF stores them: a GGUF's own blocks
    (fp16 values already) keep every bit, other weights get their scales rounded, and a scale beyond fp16's range
    is refused with the fix instead of becoming inf in a kernel."""
    from specbuild.engines.embedded.blocks import interleave_blocks, quantize_blocks

    w = torch.randn(20, 64, generator=torch.Generator().manual_seed(3))
    qs, d, m, _ = quantize_blocks(w, "q4_1")
    _, di, mi = interleave_blocks(qs, d, m)
    assert di.dtype == mi.dtype == torch.float16 and di.shape == (2, 2, 16)
    assert torch.equal(di.float()[0, :, :].T, d.half().float()[:16])          # group 0: rows 0..15, per block
    assert torch.equal(mi.float()[1, :, :4].T, m.half().float()[16:])         # group 1: rows 16..19, then zeros
    assert not bool(mi[1, :, 4:].any())
    gguf_d, gguf_m = d.half().float(), m.half().float()                      # a GGUF's scales: kept bit for bit
    assert torch.equal(interleave_blocks(qs, gguf_d, gguf_m)[1].float()[0].T, gguf_d[:16])
    with pytest.raises(UsageError, match="fp16.*--draft-activations fp32"):
        interleave_blocks(qs, d * 1e6, m)


def test_quantize_model_swaps_linears_and_skips():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    quantize_model_(model, skip=("3",))
    assert isinstance(model[0], nn.Embedding)
    assert isinstance(model[1], Int8Linear)
    assert isinstance(model[3], nn.Linear) and not isinstance(model[3], Int8Linear)
    with pytest.raises(UsageError, match="unknown quantization scheme 'int2'"):
        quantize_model_(model, "int2")
    with pytest.raises(UsageError, match="in_features % 32"):       # refused before anything is swapped
        quantize_model_(model, "int4")
    assert isinstance(model[1], Int8Linear) and type(model[3]) is nn.Linear


def test_quantized_state_dict_round_trip(tmp_path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(2)
    model = quantize_model_(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8, bias=False)))
    save_file(model.state_dict(), str(tmp_path / "q.safetensors"))
    fresh = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8, bias=False))
    load_quantized_state_dict_(fresh, load_file(str(tmp_path / "q.safetensors")))
    x = torch.randn(5, 16)
    assert torch.equal(fresh(x), model(x))
    assert torch.equal(fresh[0].qweight, model[0].qweight) and torch.equal(fresh[0].scales, model[0].scales)
    with pytest.raises(UsageError, match="qweight"):
        load_quantized_state_dict_(fresh, {"x.weight": torch.zeros(2, 2)})


def _engine_logits(model, ids: list[int]) -> torch.Tensor:
    from specbuild.engines.embedded.kvcache import KVCache
    from specbuild.engines.embedded.model import BatchMeta

    c = model.cfg
    cache = KVCache(num_layers=c.num_layers, num_slots=1, kv_heads=c.num_kv_heads, max_seq=len(ids),
                    head_dim=c.head_dim, dtype=torch.float32, device="cpu")
    pos = torch.arange(len(ids))[None, :]
    meta = BatchMeta([0], pos, torch.ones_like(pos, dtype=torch.bool), cache.scratch_slot, "cpu",
                     attn_len=len(ids))
    with torch.inference_mode():
        return model(torch.tensor([ids]), meta, cache)        # [T, V]


def test_engine_model_int8_round_trip_and_agreement(tmp_path, tiny_llama):
    from specbuild.engines.embedded.weights import load_model, read_config

    ref = load_model(tiny_llama)
    q = quantize_model_(load_model(tiny_llama))
    n_linear = sum(isinstance(m, Int8Linear) for m in q.modules())
    assert n_linear == 4 * ref.cfg.num_layers + 1                         # qkv, o, gate_up, down + lm_head
    info = save_quantized_model(q, tmp_path / "draft", hf_config=read_config(tiny_llama), scheme="int8")
    assert info["quantized_linears"] == n_linear
    loaded = load_quantized_model(tmp_path / "draft")
    for (k1, v1), (k2, v2) in zip(q.state_dict().items(), loaded.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2), k1
    ids = list(range(3, 40))
    lq, lref = _engine_logits(loaded, ids), _engine_logits(ref, ids)
    assert torch.equal(lq, _engine_logits(q, ids))                        # loaded == in-memory quantized
    assert _rel_err(lq, lref) < 0.05
    agree = float((lq.argmax(-1) == lref.argmax(-1)).float().mean())
    assert agree >= 0.8, agree
    # int8 storage really is smaller than the fp32 weights it replaces
    assert info["bytes"] < ref.num_bytes()


def test_load_quantized_model_errors(tmp_path, tiny_llama):
    with pytest.raises(SourceError, match="draft-quantize int8"):
        load_quantized_model(tiny_llama)                                       # an fp checkpoint, not int8
