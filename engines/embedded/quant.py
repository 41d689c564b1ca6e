"""Weight-only int8 quantization for the embedded engine (the demo draft runs on it).

Scheme ``"int8"``: every ``nn.Linear`` weight ``W [out, in]`` is stored as symmetric per-output-channel int8
``Q = round(W / s)``, ``s = max|W_row| / 127`` (one fp32 scale per output row). Activations stay floating point.

On CPU the matmul runs on PyTorch's int8 weight-only kernel ``torch.ops.aten._weight_int8pack_mm(x, Q, s)``
(the kernel gpt-fast uses), fed with bf16 activations: that kernel is vectorized for bf16 and reads 1 byte per
weight instead of 4, so a memory-bound decode step costs a fraction of the fp32 one (all 121 linears of
SmolLM2-135M, lm_head included, at 1 row on the 2-core AVX2 box: 6.2 ms int8 against 31.9 ms fp32). Its
fp32-activation path is *not* vectorized (9 ms for the 49152x576 lm_head, slower than fp32), hence bf16.
Measured there it also beats fp32 for wide inputs (lm_head, 256 rows: 53 ms against 112 ms), so prefill uses it.
Elsewhere (CUDA, or a torch without the op) the module dequantizes on the fly: ``F.linear(x, Q.to(x.dtype)) * s``.

Stored format (``save_int8_model`` / ``load_int8_model``): ``config.json`` (the HF config plus a
``specbuild_quantization`` entry) and ``model.int8.safetensors`` holding the engine model's state dict, where each
quantized linear is ``<module>.qweight`` int8 ``[out, in]``, ``<module>.scales`` float32 ``[out]`` (+ ``.bias``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specbuild.pipeline.errors import UsageError

SCHEMES = ("int8",)


def _has_pack_kernel() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``W [out, in]`` -> (``Q`` int8 ``[out, in]``, ``s`` float32 ``[out]``) with ``W ~= Q * s[:, None]``."""
    if weight.dim() != 2:
        raise UsageError(f"int8 quantization needs a 2-D weight, got shape {tuple(weight.shape)}.")
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0                      # [out]
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)      # [out, in]
    return q.contiguous(), scales.contiguous()


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (qweight.to(torch.float32) * scales.float()[:, None]).to(dtype)


class Int8Linear(nn.Module):
    """Drop-in for ``nn.Linear`` holding int8 weights + per-row scales. ``forward(x)`` keeps ``x.dtype``."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2 or scales.shape != (qweight.shape[0],):
            raise UsageError(f"Int8Linear wants int8 [out, in] weights and [out] scales, got "
                             f"{qweight.dtype} {tuple(qweight.shape)} and {tuple(scales.shape)}.")
        self.out_features, self.in_features = qweight.shape
        # A fresh copy: the CPU kernel segfaults on int8 weights that are not suitably aligned (as safetensors
        # may hand them out, at any byte offset of the file).
        self.register_buffer("qweight", qweight.contiguous().clone())
        self.register_buffer("scales", scales.float().contiguous())
        self.register_buffer("scales_bf16", self.scales.to(torch.bfloat16), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        q, s = quantize_weight(linear.weight)
        return cls(q, s, linear.bias)

    # Set by kernels.pack_linears_: an fp32 oneDNN copy of the dequantized weight for inputs of at least
    # `prefill_min_rows` rows (a prompt's prefill), where the int8 kernel is 2.4x slower than fp32 packed.
    prefill_packed = None
    prefill_min_rows = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # x: [..., in] -> [..., out]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)               # [rows, in]
        if self.prefill_packed is not None and x2.shape[0] >= self.prefill_min_rows:
            y = torch.ops.mkldnn._linear_pointwise(x2.float().contiguous(), self.prefill_packed, self.bias,
                                                   "none", [], "").to(x.dtype)
            return y.reshape(*lead, self.out_features)
        if x2.device.type == "cpu" and _has_pack_kernel():
            y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), self.qweight,
                                                   self.scales_bf16).to(x.dtype)
        else:
            y = F.linear(x2, self.qweight.to(x2.dtype)) * self.scales.to(x2.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def _linear_like(module: nn.Module) -> bool:
    """``nn.Linear`` or a module that behaves like one (a 2-D ``weight`` and ``F.linear`` semantics)."""
    if isinstance(module, nn.Linear):
        return True
    w = getattr(module, "weight", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 2 and hasattr(module, "in_features")
            and hasattr(module, "out_features") and not isinstance(module, nn.Embedding))


def quantize_model_(model: nn.Module, scheme: str = "int8", *, skip: tuple[str, ...] = ()) -> nn.Module:
    """Swap every Linear-like submodule of ``model`` for an ``Int8Linear`` in place and return ``model``.

    ``skip`` lists qualified module names (or name suffixes, e.g. ``"lm_head"``) to leave in floating point.
    Embeddings stay floating point; a tied lm_head gets its own int8 copy (the embedding keeps its weights).
    """
    if scheme not in SCHEMES:
        raise UsageError(f"unknown quantization scheme {scheme!r}; choose one of {', '.join(SCHEMES)}.")
    targets = [(name, mod) for name, mod in model.named_modules()
               if name and _linear_like(mod) and not any(name == s or name.endswith("." + s) for s in skip)]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        q = Int8Linear.from_linear(mod)
        setattr(parent, child, q.to(mod.weight.device))
    return model


def load_quantized_state_dict_(model: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """Replace the Linear-like modules named in ``tensors`` (``<m>.qweight``) by ``Int8Linear`` with those values."""
    names = sorted(k[: -len(".qweight")] for k in tensors if k.endswith(".qweight"))
    if not names:
        raise UsageError("no `<module>.qweight` tensors found: this is not an int8 weight file written by "
                         "specbuild; rebuild the engine with `specbuild build --draft-quantize int8 --force`.")
    for name in names:
        try:
            old = model.get_submodule(name)
        except AttributeError as e:
            raise UsageError(f"int8 weights name module {name!r}, which the model does not have; the weight file "
                             "and the model config disagree: rebuild with `specbuild build --force`.") from e
        q = Int8Linear(tensors[f"{name}.qweight"], tensors[f"{name}.scales"], tensors.get(f"{name}.bias"))
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        dev = getattr(getattr(old, "weight", None), "device", q.qweight.device)
        setattr(parent, child, q if dev.type == "meta" else q.to(dev))
    return model


INT8_WEIGHTS = "model.int8.safetensors"   # engine-module names: Int8Linear .qweight/.scales(/.bias) + fp tensors


def save_int8_model(model: nn.Module, out_dir, *, hf_config: dict) -> dict:
    """Write a quantized engine ``Transformer`` to ``out_dir``: ``config.json`` (the HF config, with a
    ``specbuild_quantization`` entry) and ``model.int8.safetensors`` (every tensor, engine-module names)."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:          # a tied weight is stored once per name: safetensors wants copies
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t.contiguous()
    save_file(tensors, str(out_dir / INT8_WEIGHTS), metadata={"format": "pt", "specbuild_quantization": "int8"})
    n_q = sum(1 for m in model.modules() if isinstance(m, Int8Linear))
    cfg = {**hf_config, "specbuild_quantization": {"scheme": "int8", "weights": INT8_WEIGHTS,
                                                   "granularity": "per-output-channel", "quantized_linears": n_q}}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return {"scheme": "int8", "weights": INT8_WEIGHTS, "quantized_linears": n_q,
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def load_int8_model(model_dir, *, dtype="float32", device="cpu") -> nn.Module:
    """Load a directory written by ``save_int8_model`` into the engine's ``Transformer`` (int8 linears)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from specbuild.engines.embedded.model import ModelConfig, Transformer, rope_inv_freq
    from specbuild.engines.embedded.weights import torch_dtype
    from specbuild.pipeline.errors import SourceError

    model_dir = Path(model_dir)
    path = model_dir / INT8_WEIGHTS
    if not path.is_file() or not (model_dir / "config.json").is_file():
        raise SourceError(f"{model_dir} has no {INT8_WEIGHTS} + config.json: it is not an int8 draft written by "
                          "`specbuild build --draft-quantize int8`; rebuild the engine.")
    cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    tensors = load_file(str(path))
    with torch.device("meta"):
        model = Transformer(cfg)
    load_quantized_state_dict_(model, tensors)
    dt = torch_dtype(dtype)
    rest = {k: (v.to(dt) if v.is_floating_point() else v) for k, v in tensors.items()
            if not k.endswith((".qweight", ".scales")) and not _is_int8_bias(model, k)}
    missing, unexpected = model.load_state_dict(rest, strict=False, assign=True)
    missing = [k for k in missing if not k.endswith((".qweight", ".scales", ".bias"))]
    if missing or unexpected:
        raise SourceError(f"{path}: tensors do not match the model config (missing {missing[:3]}, unexpected "
                          f"{unexpected[:3]}); rebuild with `specbuild build --force`.")
    model.inv_freq = rope_inv_freq(cfg)
    return model.to(device).eval().requires_grad_(False)


def _is_int8_bias(model: nn.Module, key: str) -> bool:
    owner, _, leaf = key.rpartition(".")
    return leaf == "bias" and isinstance(model.get_submodule(owner), Int8Linear)
