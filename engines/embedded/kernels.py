"""CPU linear kernels for fp32 linears: the fused extension's tiled kernel (`TiledLinear`, csrc/fused.cpp) and
oneDNN with the weight reordered once at load (`PackedLinear`); `step.pack_linears_` puts a model on whichever
measured faster on the machine it runs on (`step.auto_linear_kernel`).

Tiled: the weight in panels of 16 outputs interleaved by input, outer-product tiles, one fma chain per output
(`TiledLinear`). The first tiled kernel (one dot product per output, on the checkpoint's own weight) measured, on
the 2-core AMD EPYC (AVX2, no AVX-512; torch 2.13.0+cpu, oneDNN 3.12, 2 threads), 30 distinct weights streamed,
time ÷ oneDNN's: 1 row 0.59-0.81×, 2-4 rows 0.50-0.87×, 9 rows 0.69-0.93×, 72 rows 0.70-0.98×; the panels replaced
it at 0.58-0.93× its time (AMD EPYC Zen 4, AVX-512; bench/README.md, "2026-12-04 afternoon").

Why: PyTorch's default fp32 linear on CPU (MKL sgemm) is fast for one row (it becomes a GEMV) but packs the
whole weight on every call with 2+ rows, so a verify of K+1 positions, a batch of 8 decode rows or the lm_head
cost 2-4x a single-row step. oneDNN with a pre-reordered weight ("packed") streams it once at any row count.
oneDNN against aten, measured on the 2-core AVX2 VM (torch 2.13.0+cpu, MKL 2024.2, oneDNN 3.12, 2 threads, µs per
call, median):

| weight [out, in] | 1 row: aten / packed | 2 rows | 8 rows | 256 rows |
|---|---|---|---|---|
| qkv 1536x576 | 84 / 82 | 154 / 89 | 243 / 141 | 2932 / 3073 |
| gate_up 3072x576 | 163 / 146 | 331 / 140 | 490 / 286 | 6160 / 6446 |
| lm_head 49152x576 | 8789 / 4090 | 17825 / 4526 | 18339 / 7443 | 162231 / 121305 |

Its rows are also **batch-invariant**: a row's output is bitwise the same whether it is computed alone or with
1, 4 or 8 other rows (aten's differs by ~5e-5 between 1 row and 2), so a request's logits do not depend on which
other requests share its batch (asserted on the whole model in tests/test_kernels.py) — the property vLLM and
TensorRT-LLM users look for under the name "batch invariance". Not claimed: a verify of [last, d1..dK] equals K+1
single steps bitwise; attention over a masked, longer key range still differs at ~7e-5 (measured), so greedy
speculation is lossless up to float ties, as before.

`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise` are the ops PyTorch's own inductor emits for
frozen CPU linears (torch/_inductor/fx_passes/mkldnn_fusion.py). They are private, so `pack_linears_` probes them
once (shape, values against `F.linear`) and leaves the model on aten when they are missing or disagree.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

LINEAR_KERNELS = ("auto", "tiled", "onednn", "aten")
_PROBE: bool | None = None


ROW_BUCKETS = (24, 32, 48, 64, 96, 128, 192, 256)
CHUNK_ROWS = 256


def row_bucket(m: int) -> int:
    """oneDNN keeps one primitive per input shape it has seen (two caches of 1024, ~0.5 MB each): ragged batches
    would grow the process for hours (the soak saw 7 MB/min). A oneDNN linear therefore only sees 1..16 rows as
    they are, then these buckets (zero rows padded; a row's result does not depend on the others), and more rows in
    chunks of 256. The fused step (csrc/fused.cpp `row_bucket`) uses the same buckets."""
    return m if m <= 16 else next((b for b in ROW_BUCKETS if m <= b), CHUNK_ROWS)


def onednn_linear(x2: torch.Tensor, packed, bias) -> torch.Tensor:
    """[M, in] -> [M, out] on a packed weight, with the row count bucketed (see `row_bucket`)."""
    m = x2.shape[0]
    if m > CHUNK_ROWS:
        return torch.cat([onednn_linear(x2[r:r + CHUNK_ROWS], packed, bias) for r in range(0, m, CHUNK_ROWS)])
    b = row_bucket(m)
    if b != m:
        x2 = torch.cat((x2, x2.new_zeros(b - m, x2.shape[1])))
    y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), packed, bias, "none", [], "")
    return y[:m] if b != m else y


class PackedLinear(nn.Module):
    """`nn.Linear` (fp32, CPU) whose weight lives only in oneDNN's reordered layout; `forward(x)` = x W^T + b."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        self.out_features, self.in_features = w.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())   # opaque tensor, not a buffer
        self.packed_nbytes = w.numel() * w.element_size()
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = onednn_linear(x.reshape(-1, self.in_features), self.packed, self.bias)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel=onednn-packed"


class TiledLinear(nn.Module):
    """`nn.Linear` (fp32, CPU) on the fused extension's tiled kernel (csrc/fused.cpp `tiled_gemm`). The weight lives
    only in the kernel's panel layout (`panels`: [ceil(out / 16), in, 16], 16 outputs' weights interleaved by
    input, packed once at load), as oneDNN keeps its reordered copy; a tied lm_head's panels are a second copy of
    the embedding, which stays for the lookup. Every output is one fma chain over the input in order, so rows are
    batch-invariant at any row count (a prefill chunk too), and AVX2 and AVX-512 builds compute the same bits.

    Why: a weight is read from memory once per call at any row count, and a verify of K + 1 positions (or several
    sequences' rows) reuses it from cache in outer-product tiles of up to 6 rows x 64 outputs (on AVX-512, up to 12
    rows are one tile, 7-8 x 48 or 9-12 x 32, that streams each weight once: 8 sequences decode 243 -> 275 tok/s on
    an Intel Xeon, and a verify of 9-12 rows costs 6-9 % less than as 6 + 3-6 rows). On a 2-core AMD EPYC Zen 4 (AVX-512) the panels took 0.77-0.93x the time of the dot-product kernel they replaced at 1 row and
    0.58-0.72x at 2-36 rows (bench/README.md, "2026-12-04 afternoon"); `step.auto_linear_kernel` still measures
    this kernel against oneDNN on the machine it runs on. `ext` is the loaded extension (step.pack_linears_ passes
    it)."""

    def __init__(self, linear: nn.Linear, ext):
        super().__init__()
        w = linear.weight.detach()
        self.out_features, self.in_features = w.shape
        self.register_buffer("panels", ext.pack_panels(w.float().contiguous()), persistent=False)
        self.bias = linear.bias
        self._ext = ext
        self._none = torch.empty(0)
        self._screen = None         # (Q8_0 blocks, scales, row norms) for greedy_ids, or False: not screened

    @property
    def weight(self) -> torch.Tensor:
        """The [out, in] weight, unpacked from the panels (a new tensor: the layer computes on the panels)."""
        p = self.panels
        return p.transpose(1, 2).reshape(-1, self.in_features)[:self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        b = self._none if self.bias is None else self.bias.detach()
        y = self._ext.tiled_linear(x.reshape(-1, self.in_features).float(), self.panels, b, self.out_features)
        return y.reshape(*lead, self.out_features)

    # A greedy row's token without reading the whole fp32 weight (csrc/fused.cpp `bounded_argmax`): a Q8_0 copy of it
    # ranks the outputs within a proven error bound and only those that can still be the largest are computed here,
    # so the token is bitwise the argmax of `forward`'s output. For the target's lm_head (49152 x 576: 113 MB of
    # panels, a Q8_0 copy of 30 MB): a greedy step's rows, a verify's K + 1 and a first token (scorer.py,
    # scheduler.py); a row with more than SCREEN_CAP candidates, a NaN or an infinity reads the whole weight.
    SCREEN_CAP = 512
    screen_min_out = 4096       # smaller layers: a full read is as cheap as the screen
    screen_chunk_rows = 8192    # prepare_screen's rows at a time (a 152k-token head's fp64 copies: 0.1 GB, not 1.9)

    def screens(self) -> bool:
        """Does `greedy_ids` screen on a Q8_0 copy (a bias-free layer of screen_min_out outputs or more, whose
        weight fits fp16 block scales; `prepare_screen` made it or can)?"""
        return (self.bias is None and self.out_features >= self.screen_min_out and self.in_features % 32 == 0
                and hasattr(self._ext, "bounded_argmax") and self._screen is not False)

    def prepare_screen(self) -> None:
        """Make the Q8_0 copy and its row norms `greedy_ids` reads (~30 MB for a 49152 x 576 head; about a second),
        at load rather than in the first request's step. A weight whose block scales fp16 cannot hold is left
        unscreened (`screens()` turns False)."""
        if self._screen is not None or not self.screens():
            return
        from specbuild.core.errors import UsageError
        from specbuild.engines.embedded.blocks import interleave_blocks, quantize_blocks

        w = self.weight                                               # unpacked once from the panels
        qs, d, norms = [], [], []
        step = self.screen_chunk_rows                                 # fp64 temporaries of this many rows at once
        for a in range(0, self.out_features, step):
            q, dd, _, _ = quantize_blocks(w[a:a + step], "q8_0")
            wd = w[a:a + step].double()
            w8 = (q.double() * dd.half().double()[..., None]).reshape(wd.shape)   # as the kernel reads them
            norms.append(torch.stack((wd.norm(dim=1), w8.norm(dim=1), (wd - w8).norm(dim=1))))
            qs.append(q)
            d.append(dd)
        try:
            iq, idd, _ = interleave_blocks(torch.cat(qs), torch.cat(d), None)
        except UsageError:
            self._screen = False
            return
        up = 1 + 1e-6                                                 # norms rounded up, never down
        self._screen = (iq, idd, (torch.cat(norms, 1) * up).float().contiguous())

    def _screen_blocks(self) -> tuple | None:
        """The screen `greedy_ids` reads (made on first need), or None where this layer does not screen."""
        self.prepare_screen()
        return self._screen if self.screens() else None

    def greedy_read_bytes(self) -> int:
        """Bytes a greedy row reads of this layer: its Q8_0 copy and norms where it screens, else its panels."""
        screen = self._screen_blocks()
        if screen is not None:
            return sum(t.numel() * t.element_size() for t in screen)
        return self.panels.numel() * self.panels.element_size()

    def greedy_ids(self, x: torch.Tensor, counts: torch.Tensor | None = None) -> list[int]:
        """Each row's argmax of this layer's output for x [M, in]: bitwise `sampling.greedy_ids(self(x))`, read
        through the Q8_0 screen where `screens()`. counts: an [M] int64 tensor to receive each row's number of
        candidates (-1: decided on the full weight for a NaN or infinity; > SCREEN_CAP: the full weight too)."""
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        screen = self._screen_blocks()
        if screen is not None:
            iq, idd, norms = screen
            return self._ext.bounded_argmax(x2, iq, idd, norms, self.panels, self.out_features, self.SCREEN_CAP,
                                            counts if counts is not None else torch.empty(0, dtype=torch.long))
        from specbuild.engines.embedded.sampling import greedy_ids

        return greedy_ids(self(x2))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel=tiled (16-output panels)"


def onednn_available() -> bool:
    """True when the packed oneDNN linear exists here and matches `F.linear` (probed once per process)."""
    global _PROBE
    if _PROBE is None:
        try:
            gen = torch.Generator().manual_seed(0)
            lin = nn.Linear(64, 48, bias=True)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(48, 64, generator=gen))
                lin.bias.copy_(torch.randn(48, generator=gen))
            x = torch.randn(3, 5, 64, generator=gen)
            got = PackedLinear(lin)(x)
            _PROBE = bool(torch.backends.mkldnn.is_available() and got.shape == (3, 5, 48)
                          and torch.allclose(got, lin(x), rtol=1e-4, atol=1e-4))
        except (RuntimeError, AttributeError, NotImplementedError) as e:   # op missing in this torch build
            log.info("oneDNN packed linear unavailable (%s); using aten linears", e)
            _PROBE = False
    return _PROBE


__all__ = ["LINEAR_KERNELS", "PackedLinear", "TiledLinear", "onednn_available", "onednn_linear", "row_bucket"]
