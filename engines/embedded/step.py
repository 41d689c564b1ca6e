"""How a model's layers run on this machine: its fp32 linears packed for oneDNN (`pack_linears_`), and its decode
step on the fused extension (`runner_for`) when every layer is of a kind the extension runs.

Numerics stand in one direction: `model` (config, forward) -> `weights` (loading) -> `quant` (quantized linears)
-> `step` (this: the kernels a model's layers get) -> `kernels` (oneDNN) / `fused` (the C++ extension) ->
`blocks` (block formats). `model` reaches this module only from inside its forward, by a local import."""

from __future__ import annotations

import torch
from torch import nn

from specbuild.engines.embedded import fused
from specbuild.engines.embedded.fused import DENSE, INT8_ROWWISE, PACKED_FP32, extension
from specbuild.engines.embedded.kernels import LINEAR_KERNELS, PackedLinear, onednn_available
from specbuild.engines.embedded.quant import BlockLinear, Int8Linear, dequantize_weight


def pack_linears_(model: nn.Module, kernel: str = "auto") -> int:
    """Swap every fp32 CPU `nn.Linear` of `model` for a `PackedLinear`; -> how many were swapped.

    kernel: "auto" (oneDNN when available, else aten), "onednn" (required: raises if unavailable), "aten" (no-op).
    An `Int8Linear` keeps its int8 kernel for decode rows and gets an fp32 oneDNN copy for prefill-sized inputs
    (`Int8Linear.prefill_min_rows`). Other layers (bf16, CUDA) are left alone."""
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"linear_kernel must be one of {', '.join(LINEAR_KERNELS)}, got {kernel!r}")
    if kernel == "aten":
        return 0
    if not onednn_available():
        if kernel == "onednn":
            raise RuntimeError("linear_kernel='onednn' but this torch build has no working oneDNN packed linear "
                               "(torch.ops.mkldnn._linear_pointwise); use linear_kernel='aten'.")
        return 0
    todo = [(name, m) for name, m in model.named_modules()
            if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
    for name, m in todo:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, PackedLinear(m))
    int8 = [m for m in model.modules() if isinstance(m, Int8Linear) and m.qweight.device.type == "cpu"]
    for m in int8:
        # Decode rows stay on the int8 kernel; a prompt's prefill (many rows) runs on an fp32 oneDNN copy of the
        # dequantized weight (int8 at 128 rows: 7.2 ms vs 3.0 ms for gate_up here; a draft's prefill of a
        # 128-token prompt 470 ms vs 273 ms for the whole fp32 target). Memory: 4 bytes per weight.
        w = dequantize_weight(m.qweight, m.scales, torch.float32)
        m.prefill_packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
        m.packed_nbytes = w.numel() * w.element_size()
    return len(todo) + len(int8)


def linear_kernel_of(model: nn.Module) -> str:
    """"onednn" if any linear of `model` is packed, else "aten" (what a manifest or a benchmark records)."""
    return "onednn" if any(isinstance(m, PackedLinear) for m in model.modules()) else "aten"


def _linear(ext, mod: nn.Module):
    """The extension's Linear for one of the engine's linear modules, or None (a kind it cannot run)."""
    none = torch.empty(0)
    bias = getattr(mod, "bias", None)
    bias = none if bias is None else bias.detach().float().contiguous()
    if isinstance(mod, PackedLinear):
        return ext.make_linear(PACKED_FP32, mod.packed, none, none, none, bias, none, 1 << 30,
                               mod.out_features, mod.in_features)
    if isinstance(mod, BlockLinear):
        prefill = mod.prefill_weight() if mod.prefill_copy else None
        return ext.make_linear(mod.kind, none, mod.qs, mod.d, mod.m if mod.m is not None else none, bias,
                               prefill if prefill is not None else none, mod.prefill_min_rows, mod.out_features,
                               mod.in_features)
    if isinstance(mod, Int8Linear):
        prefill = mod.prefill_packed if mod.prefill_packed is not None else none
        return ext.make_linear(INT8_ROWWISE, mod.qweight, none, mod.scales_bf16, none, bias, prefill,
                               mod.prefill_min_rows, mod.out_features, mod.in_features)
    if type(mod) is nn.Linear and mod.weight.dtype == torch.float32:
        return ext.make_linear(DENSE, mod.weight.detach(), none, none, none, bias, none, 1 << 30,
                               mod.out_features, mod.in_features)
    return None


def runner_for(model, cache, mode: str = "auto"):
    """A Runner of `model`'s layers over `cache` (kept on the cache, one per model), or None: eager. `mode` "fused"
    raises instead of falling back."""
    if mode == "eager":
        return None
    runners = cache.__dict__.setdefault("_fused_runners", {})
    key = id(model)
    if key in runners:
        return runners[key]
    why = _unsupported(model, cache)
    ext = None if why else extension()
    if why is None and ext is None:
        why = fused._WHY
    runner = None
    if why is None:
        runner = _make_runner(ext, model, cache)
        if runner is None:
            why = "a linear layer of a kind the fused step does not run"
    if runner is None and mode == "fused":
        raise RuntimeError(f"decode_step='fused' but {why}; use decode_step 'auto' or 'eager'.")
    runners[key] = runner
    return runner


def decode_step_of(model, cache) -> str:
    """"fused" when forwards of `model` over `cache` run on the fused step, else "eager" (what a manifest, a
    calibration or a benchmark records)."""
    return "fused" if runner_for(model, cache, getattr(cache, "decode_step", "auto")) is not None else "eager"


def _unsupported(model, cache) -> str | None:
    c = model.cfg
    w = model.embed.weight
    if w.device.type != "cpu" or w.dtype != torch.float32 or cache.k[0].dtype != torch.float32:
        return f"the fused step runs fp32 on CPU (this model: {w.dtype} on {w.device.type})"
    if c.head_dim % 16 or c.hidden_size % 8 or c.intermediate_size % 8:
        return "head_dim must be a multiple of 16 and hidden / intermediate sizes multiples of 8"
    return None


def _make_runner(ext, model, cache):
    cos, sin = model.rope_tables(cache.max_seq)
    r = ext.Runner(model.cfg.hidden_size, model.cfg.num_heads, model.cfg.num_kv_heads, model.cfg.head_dim,
                   model.cfg.intermediate_size, float(model.cfg.rms_norm_eps), cos.contiguous(), sin.contiguous(),
                   list(cache.k), list(cache.v))
    for layer in model.layers:
        lins = [_linear(ext, m) for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if any(x is None for x in lins):
            return None
        r.add_layer(layer.input_norm.weight.detach().float().contiguous(),
                    layer.post_norm.weight.detach().float().contiguous(), *lins)
    return r
