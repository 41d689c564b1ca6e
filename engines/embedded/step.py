"""How a model's layers run on this machine: its fp32 linears on the faster of the fused extension's tiled kernel
and oneDNN, as measured here (`pack_linears_`, `auto_linear_kernel`), and its decode step on the fused extension
(`runner_for`) when every layer is of a kind the extension runs.

Numerics stand in one direction: `model` (config, forward) -> `weights` (loading) -> `quant` (quantized linears)
-> `step` (this: the kernels a model's layers get) -> `kernels` (tiled, oneDNN) / `fused` (the C++ extension) ->
`blocks` (block formats). `model` reaches this module only from inside its forward, by a local import."""

from __future__ import annotations

import json
import logging
import statistics
import time

import torch
from torch import nn

from specbuild.engines.embedded import fused
from specbuild.engines.embedded.fused import DENSE, INT8_ROWWISE, PACKED_FP32, TILED_FP32, extension
from specbuild.engines.embedded.kernels import LINEAR_KERNELS, PackedLinear, TiledLinear, onednn_available
from specbuild.engines.embedded.quant import BlockLinear, Int8Linear, dequantize_weight

log = logging.getLogger(__name__)
CHOICE_FILE = "linear_kernel.json"      # in fused.build_dir(): the fp32 kernel measured fastest on this machine
STABLE_SPREAD = 1.25     # a measurement whose median repetition is slower than its fastest by more is not saved
# ... nor one during which this process got less than this share of its threads' cores: other work held them. A
# steady competitor (one busy process per core) slows both kernels alike, so the spread misses it, and it moved
# the pick: a setup beside a test run measured 191.9 vs 176.0 ms (25x slower, spread 1.14) and saved oneDNN,
# where the quiet machine measures the tiled kernel at 6.6 ms against 10.6 (AMD EPYC Zen 4).
MIN_CPU_SHARE = 0.75
_CHOICE: dict | None = None


def pack_linears_(model: nn.Module, kernel: str = "auto") -> int:
    """Put every fp32 CPU `nn.Linear` of `model` on a faster kernel; -> how many were swapped.

    kernel: "auto" (whichever of the fused extension's tiled kernel and oneDNN measured faster here, see
    `auto_linear_kernel`; oneDNN without the extension; aten without either),
    "tiled" / "onednn" (required: raises if unavailable), "aten" (no-op). Tiled layers hold their weight in the
    kernel's panels (`kernels.TiledLinear`), oneDNN ones in its reordered layout (`kernels.PackedLinear`).
    An `Int8Linear` keeps its int8 kernel for decode rows and gets an fp32 oneDNN copy for prefill-sized inputs
    (`Int8Linear.prefill_min_rows`). Other layers (bf16, CUDA) are left alone."""
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"linear_kernel must be one of {', '.join(LINEAR_KERNELS)}, got {kernel!r}")
    if kernel == "aten":
        return 0
    ext = extension() if kernel in ("auto", "tiled") else None
    if kernel == "tiled" and ext is None:
        raise RuntimeError(f"linear_kernel='tiled' needs the fused extension, which is not loaded here "
                           f"({fused._WHY}); run `make setup`, or use linear_kernel 'auto'.")
    if kernel == "auto" and ext is not None and auto_linear_kernel() != "tiled":
        ext = None                                             # oneDNN measured faster on this machine
    todo = [(name, m) for name, m in model.named_modules()
            if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]
    if ext is not None:
        wrap = lambda m: TiledLinear(m, ext)  # noqa: E731
    elif onednn_available():
        wrap = PackedLinear
    else:
        if kernel == "onednn":
            raise RuntimeError("linear_kernel='onednn' but this torch build has no working oneDNN packed linear "
                               "(torch.ops.mkldnn._linear_pointwise); use linear_kernel='aten'.")
        return 0
    for name, m in todo:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, wrap(m))
    int8 = [m for m in model.modules() if isinstance(m, Int8Linear) and m.qweight.device.type == "cpu"] \
        if onednn_available() else []
    for m in int8:
        # Decode rows stay on the int8 kernel; a prompt's prefill (many rows) runs on an fp32 oneDNN copy of the
        # dequantized weight (int8 at 128 rows: 7.2 ms vs 3.0 ms for gate_up here; a draft's prefill of a
        # 128-token prompt 470 ms vs 273 ms for the whole fp32 target). Memory: 4 bytes per weight.
        w = dequantize_weight(m.qweight, m.scales, torch.float32)
        m.prefill_packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
        m.packed_nbytes = w.numel() * w.element_size()
    return len(todo) + len(int8)


def auto_linear_kernel() -> str:
    """The kernel linear_kernel "auto" puts fp32 linears on here: the faster of "tiled" and "onednn" as measured on
    this machine (`measure_linear_kernels`, once, cached beside the extension), "onednn" without the extension,
    "aten" without either."""
    if extension() is None:
        return "onednn" if onednn_available() else "aten"
    if not onednn_available():
        return "tiled"
    return linear_kernel_choice()["kernel"]


def linear_kernel_choice() -> dict:
    """{"kernel", "tiled_ms", "onednn_ms", ...}: read from the extension's build dir, else measured now and saved."""
    global _CHOICE
    if _CHOICE is not None:
        return _CHOICE
    path = fused.build_dir() / CHOICE_FILE
    try:
        got = json.loads(path.read_text())
        # one saved before the stability checks (no "stable", or no "cpu_share") may be a busy machine's:
        # measured again, once
        if got.get("kernel") in ("tiled", "onednn") and got.get("stable") is True and "cpu_share" in got:
            _CHOICE = got
            return got
    except (OSError, ValueError):
        pass
    _CHOICE = measure_linear_kernels()
    log.info("fp32 linears: %s (measured here: tiled %.2f ms, oneDNN %.2f ms)", _CHOICE["kernel"],
             _CHOICE["tiled_ms"], _CHOICE["onednn_ms"])
    if not _CHOICE.get("stable", True):
        # another process took the cores while it measured (a fresh clone's setup beside a test run measured both
        # kernels 25x slower and picked the other one): this process uses it; the next one measures again
        log.info("the fp32 kernel pick is not saved: %s", busy_reason(_CHOICE))
        return _CHOICE
    try:
        from specbuild.core.manifest import atomic_write_text

        atomic_write_text(path, json.dumps(_CHOICE, indent=2) + "\n")
    except OSError as e:                       # a read-only cache: measured again by the next process
        log.info("could not save %s: %s", path, e)
    return _CHOICE


def measure_linear_kernels(reps: int = 5) -> dict:
    """Time the tiled kernel and oneDNN's packed linear on this machine, round-robin, on decode-shaped work: 12
    distinct 3072 x 576 fp32 weights (85 MB: more than a last-level cache, so they stream from memory as a model's
    layers do) at 1 row (a decode step) and 9 rows (a verify of K = 8). -> the faster ("tiled" on a tie: it keeps
    no library call between Python and the kernel) by each one's fastest repetition, and whether the timings were
    stable. Not by vendor or ISA: on a 2-core AVX2 AMD EPYC the first tiled kernel read weights at 21-24 GB/s where
    oneDNN read 13-18 (bench/README.md, "Linears"); on an Intel Xeon oneDNN may win, and then it is used."""
    from specbuild.engines.embedded.kernels import onednn_linear

    ext = extension()
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(3072, 576, generator=gen) for _ in range(12)]
    panels = [ext.pack_panels(w) for w in ws]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws]
    xs = [torch.randn(m, 576, generator=gen) for m in (1, 9)]
    none = torch.empty(0)

    def tiled():
        for x in xs:
            for p in panels:
                ext.tiled_linear(x, p, none, 3072)

    def onednn():
        for x in xs:
            for p in packed:
                onednn_linear(x, p, None)

    times: dict = {"tiled": [], "onednn": []}
    with torch.inference_mode():
        tiled(), onednn()                                          # warm-up
        cpu0, wall0 = _process_cpu_s(), time.perf_counter()
        for _ in range(reps):
            for name, fn in (("tiled", tiled), ("onednn", onednn)):
                # once untimed: the other kernel's workers (torch's OpenMP threads or the extension's own) may
                # still spin on a core just after it returns; the timed run then meets this kernel's own state
                fn()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        share = (_process_cpu_s() - cpu0) / ((time.perf_counter() - wall0) * _usable_threads())
    # the least disturbed repetition of each (round-robin, so a burst of other work hits both alike); the median
    # over the minimum says how much the machine moved under it
    t, o = min(times["tiled"]) * 1e3, min(times["onednn"]) * 1e3
    spread = max(statistics.median(v) / min(v) for v in times.values())
    from specbuild.core.machine import describe

    return {"kernel": "tiled" if t <= o else "onednn", "tiled_ms": round(t, 3), "onednn_ms": round(o, 3),
            "spread": round(spread, 3), "cpu_share": round(share, 3),
            "stable": spread <= STABLE_SPREAD and share >= MIN_CPU_SHARE,
            "work": "12 x [3072, 576] fp32 weights at 1 and 9 rows", "reps": reps, "threads": torch.get_num_threads(),
            "machine": describe()}


def busy_reason(choice: dict) -> str:
    """Why a measured pick was not trusted (`stable` false): the machine was busy while it measured."""
    if choice.get("spread", 1.0) > STABLE_SPREAD:
        return (f"the timings varied {choice['spread']:.2f}x between repetitions (the machine was busy; at most "
                f"{STABLE_SPREAD:.2f}x is kept)")
    return (f"this process got {choice.get('cpu_share', 0):.0%} of its threads' cores while it measured (other work "
            f"held them; at least {MIN_CPU_SHARE:.0%} is kept)")


def _process_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _usable_threads() -> int:
    """The threads a parallel kernel runs on: torch's, but no more than the cores this process may use."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(torch.get_num_threads(), cores))


def linear_kernel_of(model: nn.Module) -> str:
    """"tiled" / "onednn" when the model's fp32 linears run on that kernel, else "aten" (what a manifest, a
    calibration or a benchmark records)."""
    for m in model.modules():
        if isinstance(m, TiledLinear):
            return "tiled"
        if isinstance(m, PackedLinear):
            return "onednn"
    return "aten"


def _linear(ext, mod: nn.Module):
    """The extension's Linear for one of the engine's linear modules, or None (a kind it cannot run)."""
    none = torch.empty(0)
    bias = getattr(mod, "bias", None)
    bias = none if bias is None else bias.detach().float().contiguous()
    if isinstance(mod, TiledLinear):
        return ext.make_linear(TILED_FP32, mod.panels, none, none, none, bias, none, 1 << 30,
                               mod.out_features, mod.in_features)
    if isinstance(mod, PackedLinear):
        return ext.make_linear(PACKED_FP32, mod.packed, none, none, none, bias, none, 1 << 30,
                               mod.out_features, mod.in_features)
    if isinstance(mod, BlockLinear):
        prefill = mod.prefill_weight() if mod.prefill_copy else None
        qs, d, m = mod.kernel_blocks()
        return ext.make_linear(mod.kernel_kind, none, qs, d, m if m is not None else none, bias,
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
    if cache.k[0].dtype != torch.float32:
        return f"the fused step runs fp32 on CPU (this cache: {cache.k[0].dtype})"
    return _unsupported_model(model)


def _unsupported_model(model) -> str | None:
    c = model.cfg
    w = model.embed.weight
    if w.device.type != "cpu" or w.dtype != torch.float32:
        return f"the fused step runs fp32 on CPU (this model: {w.dtype} on {w.device.type})"
    if c.head_dim % 16 or c.hidden_size % 8 or c.intermediate_size % 8:
        return "head_dim must be a multiple of 16 and hidden / intermediate sizes multiples of 8"
    return None


def bf16_prefill_unavailable() -> str | None:
    """Why EngineConfig.prefill_precision "bf16" cannot run here (None: it can): it needs the fused extension,
    built with AVX-512 BF16 (vdpbf16ps: AMD Zen 4 and later, Intel Cooper Lake / Sapphire Rapids and later)."""
    ext = extension()
    if ext is None:
        return f"the fused extension is not built here ({fused._WHY or 'not loaded in this process'})"
    if not ext.has_bf16_prefill():
        return (f"this build of the fused extension has no AVX-512 BF16 kernels (the CPU lacks avx512_bf16, or "
                f"SPECBUILD_FUSED_ISA={fused.isa()})")
    return None


def prepare_bf16_prefill_(model) -> None:
    """Give each layer's linears of `model` a bf16 copy of their weight (`ext.pack_panels_bf16`: rounded to nearest
    even, ~2 bytes a weight beside the fp32 ones) for prompts' rows: the fused step then computes a prefill's
    linears as bf16 products with fp32 sums (csrc/fused.cpp `bf16_gemm`, twice the fp32 FMA's work per instruction)
    and every other row (a decode step, a verify, a draft) in fp32 as before. Every output is one chain over its
    inputs in order, so a prompt's cache is the same whatever chunk or batch its rows come in, with speculation on
    or off: the output is lossless against this engine without speculation, not against the fp32 model's own
    prompt cache. Call before the first forward (the runner is made then); raises where it cannot run."""
    why = bf16_prefill_unavailable()
    if why is not None:
        from specbuild.engines.embedded.config import ConfigError

        raise ConfigError(f"prefill_precision 'bf16' cannot run here: {why}; use prefill_precision 'fp32'.")
    why = _unsupported_model(model)
    if why is not None:
        from specbuild.engines.embedded.config import ConfigError

        raise ConfigError(f"prefill_precision 'bf16' needs the fused step: {why}.")
    ext = extension()
    panels = []
    for layer in model.layers:
        ps = []
        for m in (layer.qkv, layer.o, layer.gate_up, layer.down):
            w = getattr(m, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dtype != torch.float32 or w.shape[1] % 2:
                from specbuild.engines.embedded.config import ConfigError

                raise ConfigError(f"prefill_precision 'bf16' needs fp32 linears with an even input size "
                                  f"(got {type(m).__name__}); use prefill_precision 'fp32'.")
            ps.append(ext.pack_panels_bf16(w.detach().float().contiguous()))
        panels.append(ps)
    model._bf16_prefill = panels


def _make_runner(ext, model, cache):
    cos, sin = model.rope_tables(cache.max_seq)
    r = ext.Runner(model.cfg.hidden_size, model.cfg.num_heads, model.cfg.num_kv_heads, model.cfg.head_dim,
                   model.cfg.intermediate_size, float(model.cfg.rms_norm_eps), cos.contiguous(), sin.contiguous(),
                   list(cache.k), list(cache.v))
    bf16 = getattr(model, "_bf16_prefill", None)           # prepare_bf16_prefill_'s copies, per layer
    for i, layer in enumerate(model.layers):
        lins = [_linear(ext, m) for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if any(x is None for x in lins):
            return None
        if bf16 is not None:
            lins = [ext.with_bf16_prefill(lin, p) for lin, p in zip(lins, bf16[i])]
        r.add_layer(layer.input_norm.weight.detach().float().contiguous(),
                    layer.post_norm.weight.detach().float().contiguous(), *lins)
    return r


def main() -> int:
    """`python -m specbuild.engines.embedded.step`: measure (or read) which fp32 linear kernel "auto" uses here."""
    if extension() is None:
        print(f"fp32 linears: {auto_linear_kernel()} (the fused extension is not built: {fused._WHY})")
        return 0
    if not onednn_available():
        print("fp32 linears: tiled (no oneDNN packed linear in this torch build)")
        return 0
    c = linear_kernel_choice()
    where = (fused.build_dir() / CHOICE_FILE if c.get("stable", True) else
             f"{busy_reason(c)}: not saved, measured again by the next process")
    print(f"fp32 linears: {c['kernel']} (measured on this machine: tiled {c['tiled_ms']:.2f} ms, oneDNN "
          f"{c['onednn_ms']:.2f} ms for {c['work']}; {where})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
