"""Weight-only quantization for the embedded engine's drafts: ``"int8"`` (per-channel) and ``"int4"`` (GGUF blocks).

Scheme ``"int8"``: every ``nn.Linear`` weight ``W [out, in]`` is stored as symmetric per-output-channel int8
``Q = round(W / s)``, ``s = max|W_row| / 127`` (one fp32 scale per output row). Activations stay floating point.

On CPU the matmul runs on PyTorch's int8 weight-only kernel ``torch.ops.aten._weight_int8pack_mm(x, Q, s)``
(the kernel gpt-fast uses), fed with bf16 activations: that kernel is vectorized for bf16 and reads 1 byte per
weight instead of 4, so a memory-bound decode step costs a fraction of the fp32 one (all 121 linears of
SmolLM2-135M, lm_head included, at 1 row on the 2-core AVX2 box: 6.2 ms int8 against 31.9 ms fp32). Its
fp32-activation path is *not* vectorized (9 ms for the 49152x576 lm_head, slower than fp32), hence bf16.
Measured there it also beats fp32 for wide inputs (lm_head, 256 rows: 53 ms against 112 ms), so prefill uses it.
Elsewhere (CUDA, or a torch without the op) the module dequantizes on the fly: ``F.linear(x, Q.to(x.dtype)) * s``.

Scheme ``"int4"``: every layer's linear as **Q4_1** blocks (32 weights along the input, ``w = d * q + m``,
q in 0..15: 0.625 bytes per weight) and the lm_head as **Q8_0** blocks (``w = d * q``, q in -127..127), the
layouts of GGUF and llama.cpp. The blocks are found by `quantize_blocks`, which first tries to *recover* them:
when a weight is the dequantization of such blocks (the demo target is SmolLM2's Q4_1 GGUF, dequantized by
transformers), fp16 d and m and the q that reproduce every weight bit for bit exist and are found, so the draft
holds exactly the target's weights; elsewhere they are ordinary min/max blocks with fp32 d and m. The build
reports the fraction of weights held exactly. The matmul runs on the fused extension's block kernels
(csrc/fused.cpp: fp32 activations, the same products as the target's); without it, on a dequantized copy.

Stored format (``save_quantized_model``; read by ``weights.load_quantized_model``): ``config.json`` (the HF config plus a
``specbuild_quantization`` entry) and ``model.<scheme>.safetensors`` holding the engine model's state dict, where
an int8 linear is ``<module>.qweight`` int8 ``[out, in]``, ``<module>.scales`` float32 ``[out]`` (+ ``.bias``) and
a block linear is ``<module>.qs`` (uint8 ``[out, in/32, 16]``: Q4_1, or int8 ``[out, in/32, 32]``: Q8_0),
``<module>.d`` (and for Q4_1 ``<module>.m``) float32 ``[out, in/32]`` (+ ``.bias``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specbuild.core.errors import UsageError

from specbuild.core.constants import DRAFT_ACTIVATIONS, DRAFT_QUANTIZATIONS as SCHEMES

from specbuild.engines.embedded.blocks import (BLOCK, dequantize_blocks, interleave_blocks,  # noqa: F401
                                               quantize_blocks)


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

    # Set by step.pack_linears_: an fp32 oneDNN copy of the dequantized weight for inputs of at least
    # `prefill_min_rows` rows (a prompt's prefill), where the int8 kernel is 2.4x slower than fp32 packed.
    prefill_packed = None
    prefill_min_rows = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # x: [..., in] -> [..., out]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)               # [rows, in]
        if self.prefill_packed is not None and x2.shape[0] >= self.prefill_min_rows:
            from specbuild.engines.embedded.kernels import onednn_linear

            y = onednn_linear(x2.float().contiguous(), self.prefill_packed, self.bias)
            return y.to(x.dtype).reshape(*lead, self.out_features)
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


def set_block_activations_(model: nn.Module, activations: str) -> int:
    """Run every BlockLinear of `model` with "fp32" or "int8" activations (EngineConfig.draft_activations);
    -> how many. "int8" takes effect on the fused extension's kernels (without them: fp32, the dense fallback)."""
    if activations not in DRAFT_ACTIVATIONS:
        raise UsageError(f"draft activations must be one of {', '.join(DRAFT_ACTIVATIONS)}, got {activations!r}")
    n = 0
    for m in model.modules():
        if isinstance(m, BlockLinear):
            m.activations = activations
            n += 1
    return n


class BlockLinear(nn.Module):
    """Drop-in for ``nn.Linear`` with Q4_1 (``qs`` uint8) or Q8_0 (``qs`` int8) block weights; fp32 activations.
    Runs on the fused extension's kernel; without it (or for prompt-sized inputs) on a dequantized fp32 copy made
    the first time it is needed."""

    prefill_min_rows = 16
    activations = "fp32"        # "int8": x rounded to 8 bits per block on the extension's integer kernel (cheaper,
                                # not the target's numbers: engine_config `draft_activations`; csrc/fused.cpp)
    prefill_copy = False        # keep an fp32 oneDNN copy for prompt-sized inputs (a draft with its own KV cache
                                # prefills prompts; a self-draft sharing the target's cache never does): 8 B/weight

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bias: torch.Tensor | None = None):
        super().__init__()
        if qs.dtype not in (torch.uint8, torch.int8) or qs.dim() != 3 or d.shape != qs.shape[:2]:
            raise UsageError(f"BlockLinear wants qs [out, blocks, 16|32] uint8/int8 and d [out, blocks], got "
                             f"{qs.dtype} {tuple(qs.shape)} and {tuple(d.shape)}.")
        self.scheme = "q4_1" if qs.dtype == torch.uint8 else "q8_0"
        if (self.scheme == "q4_1") != (m is not None):
            raise UsageError("a Q4_1 BlockLinear needs m; a Q8_0 one has none.")
        self.kind = 1 if self.scheme == "q4_1" else 2
        self.out_features, self.in_features = qs.shape[0], qs.shape[1] * BLOCK
        self.register_buffer("qs", qs.contiguous().clone())
        self.register_buffer("d", d.float().contiguous())
        self.register_buffer("m", None if m is None else m.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self._dense = None          # dequantized fp32 copy (eager fallback), made on first need
        self._packed = None         # its oneDNN-reordered form (prompt-sized inputs)
        self._interleaved = None    # the int8-activation kernels' layout (blocks.interleave_blocks), on first need
        self._screen = None         # a Q8_0 head's Q4_1 copy, interleaved, for greedy_ids (prepare_screen)

    @classmethod
    def from_linear(cls, linear: nn.Module, scheme: str) -> tuple["BlockLinear", float]:
        qs, d, m, fraction = quantize_blocks(linear.weight, scheme)
        return cls(qs, d, m, getattr(linear, "bias", None)), fraction

    @property
    def kernel_kind(self) -> int:
        """The extension's kind: Q4_1 / Q8_0 with fp32 activations, Q4_1_Q8 / Q8_0_Q8 with int8 ones (fused.py)."""
        from specbuild.engines.embedded.fused import INT8_ACTIVATIONS

        return INT8_ACTIVATIONS[self.kind] if self.activations == "int8" else self.kind

    def kernel_blocks(self) -> tuple:
        """(qs, d, m) as the kernel of `kernel_kind` reads them: as stored for fp32 activations; for int8 ones
        interleaved by 16 output rows (made once, ~the size of qs)."""
        if self.activations != "int8":
            return self.qs, self.d, self.m
        if self._interleaved is None:
            self._interleaved = interleave_blocks(self.qs, self.d, self.m)
        return self._interleaved

    def dense_weight(self) -> torch.Tensor:
        if self._dense is None:
            self._dense = dequantize_blocks(self.qs, self.d, self.m, self.scheme)
        return self._dense

    def prefill_weight(self):
        """The oneDNN-packed fp32 copy for prompt-sized inputs (None where oneDNN packing is not available)."""
        from specbuild.engines.embedded.kernels import onednn_available

        if self._packed is None and self.qs.device.type == "cpu" and onednn_available():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.dense_weight().contiguous())
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from specbuild.engines.embedded.fused import block_linear

        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        y = None
        if (x2.shape[0] < self.prefill_min_rows or not self.prefill_copy) and x2.device.type == "cpu":
            y = block_linear(self.kernel_kind, x2, *self.kernel_blocks(), self.bias, self.out_features)
        if y is None:
            packed = self.prefill_weight() if x2.device.type == "cpu" and self.prefill_copy else None
            if packed is not None:
                from specbuild.engines.embedded.kernels import onednn_linear

                y = onednn_linear(x2, packed, self.bias)
            else:
                y = F.linear(x2, self.dense_weight().to(x2.device), self.bias)
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def screens(self) -> bool:
        """Does `greedy_ids` screen on a Q4_1 copy? A Q8_0 head on int8 activations, on the extension's kernels."""
        from specbuild.engines.embedded.fused import INT8_ACTIVATIONS, Q8_0, extension

        return (self.kernel_kind == INT8_ACTIVATIONS[Q8_0] and self.qs.device.type == "cpu"
                and extension() is not None)

    def prepare_screen(self) -> None:
        """Make the Q4_1 screening copy `greedy_ids` reads (~18 MB for a 49152 x 576 head; a second or two), now
        rather than in the first request's first draft step."""
        if self._screen is None and self.screens():
            w = self.dense_weight()
            qs, d, m, _ = quantize_blocks(w, "q4_1")
            self._screen = interleave_blocks(qs, d, m)

    def greedy_ids(self, x: torch.Tensor) -> list[int]:
        """Each row's argmax of this layer's output for x [M, in] (the greedy draft's token). A Q8_0 head on int8
        activations screens the vocabulary on a Q4_1 copy and decides among its best candidates on its own blocks
        (csrc/fused.cpp `screened_argmax`: the same token as the full head's argmax whenever the Q4_1 copy ranks
        that token among its best 8, and the full head where a logit is NaN); else the argmax of `forward`."""
        from specbuild.engines.embedded.sampling import greedy_ids

        x2 = x.reshape(-1, self.in_features).float().contiguous()
        if self.bias is None and x2.shape[0] < self.prefill_min_rows and self.screens():
            from specbuild.engines.embedded.fused import extension

            self.prepare_screen()
            qs8, d8, _ = self.kernel_blocks()
            return extension().screened_argmax(x2, *self._screen, qs8, d8, self.out_features)
        return greedy_ids(self(x2))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme} blocks of {BLOCK}"


# ---- whole models --------------------------------------------------------------------------------------------
def _linear_like(module: nn.Module) -> bool:
    """``nn.Linear`` or a module that behaves like one (a 2-D ``weight`` and ``F.linear`` semantics)."""
    if isinstance(module, nn.Linear):
        return True
    w = getattr(module, "weight", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 2 and hasattr(module, "in_features")
            and hasattr(module, "out_features") and not isinstance(module, nn.Embedding))


def quantize_model_(model: nn.Module, scheme: str = "int8", *, skip: tuple[str, ...] = ()) -> nn.Module:
    """Swap every Linear-like submodule of ``model`` for its quantized form in place and return ``model``.

    ``"int8"``: ``Int8Linear`` everywhere; ``"int4"``: Q4_1 ``BlockLinear`` for the layers and a Q8_0 one for the
    lm_head (the output layer decides every draft token: its 8-bit blocks keep acceptance up). ``skip`` lists
    qualified module names (or name suffixes, e.g. ``"lm_head"``) to leave in floating point. Embeddings stay
    floating point; a tied lm_head gets its own quantized copy (the embedding keeps its weights). The fraction of
    weights the blocks hold exactly is in ``model.quantization_exact`` (int4)."""
    if scheme not in SCHEMES:
        raise UsageError(f"unknown quantization scheme {scheme!r}; choose one of {', '.join(SCHEMES)}.")
    targets = [(name, mod) for name, mod in model.named_modules()
               if name and _linear_like(mod) and not any(name == s or name.endswith("." + s) for s in skip)]
    bad = [name for name, mod in targets if scheme == "int4" and mod.in_features % BLOCK]
    if bad:
        raise UsageError(f"int4 blocks need in_features % {BLOCK} == 0, but {bad[:3]} have "
                         f"{[model.get_submodule(n).in_features for n in bad[:3]]}; use --draft-quantize int8.")
    exact = total = 0
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if scheme == "int8":
            q = Int8Linear.from_linear(mod)
        else:
            q, fraction = BlockLinear.from_linear(mod, "q8_0" if child == "lm_head" else "q4_1")
            n = mod.weight.numel()
            exact, total = exact + fraction * n, total + n
        setattr(parent, child, q.to(mod.weight.device))
    if scheme == "int4":
        model.quantization_exact = exact / total if total else 1.0
    return model


def load_quantized_state_dict_(model: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """Replace the Linear-like modules named in ``tensors`` (``<m>.qweight`` int8, ``<m>.qs`` blocks) by their
    quantized modules with those values."""
    names = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith((".qweight", ".qs"))})
    if not names:
        raise UsageError("no `<module>.qweight` / `<module>.qs` tensors found: this is not a quantized weight file "
                         "written by specbuild; rebuild the engine with `specbuild build --draft-quantize int8|int4 "
                         "--force`.")
    for name in names:
        try:
            old = model.get_submodule(name)
        except AttributeError as e:
            raise UsageError(f"quantized weights name module {name!r}, which the model does not have; the weight "
                             "file and the model config disagree: rebuild with `specbuild build --force`.") from e
        if f"{name}.qweight" in tensors:
            q = Int8Linear(tensors[f"{name}.qweight"], tensors[f"{name}.scales"], tensors.get(f"{name}.bias"))
        else:
            q = BlockLinear(tensors[f"{name}.qs"], tensors[f"{name}.d"], tensors.get(f"{name}.m"),
                            tensors.get(f"{name}.bias"))
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        dev = getattr(getattr(old, "weight", None), "device", q.qs.device if isinstance(q, BlockLinear)
                      else q.qweight.device)
        setattr(parent, child, q if dev.type == "meta" else q.to(dev))
    return model


def weights_file(scheme: str) -> str:
    """``model.<scheme>.safetensors``: engine-module names, quantized linears + fp tensors."""
    return f"model.{scheme}.safetensors"


INT8_WEIGHTS = weights_file("int8")


def save_quantized_model(model: nn.Module, out_dir, *, hf_config: dict, scheme: str) -> dict:
    """Write a quantized engine ``Transformer`` to ``out_dir``: ``config.json`` (the HF config, with a
    ``specbuild_quantization`` entry) and ``model.<scheme>.safetensors`` (every tensor, engine-module names)."""
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
    weights = weights_file(scheme)
    save_file(tensors, str(out_dir / weights), metadata={"format": "pt", "specbuild_quantization": scheme})
    n_q = sum(1 for m in model.modules() if isinstance(m, (Int8Linear, BlockLinear)))
    info = {"scheme": scheme, "weights": weights, "quantized_linears": n_q,
            "granularity": "per-output-channel" if scheme == "int8" else f"blocks of {BLOCK} (Q4_1; lm_head Q8_0)"}
    if scheme == "int4":
        info["exact_fraction"] = getattr(model, "quantization_exact", None)
    (out_dir / "config.json").write_text(json.dumps({**hf_config, "specbuild_quantization": info}, indent=2,
                                                    sort_keys=True) + "\n")
    return {**info, "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
