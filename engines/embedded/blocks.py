"""GGUF's block layouts, Q4_1 and Q8_0, as plain tensor math: `quantize_blocks` (recovering exact blocks where a
weight is their dequantization) and `dequantize_blocks`. The bottom of the numerics: the fused kernels' self-check
and the quantized linears (`quant.py`) both stand on it."""

from __future__ import annotations

import torch

from specbuild.core.errors import UsageError

BLOCK = 32                               # weights per block (Q4_1, Q8_0)


def dequantize_blocks(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, scheme: str) -> torch.Tensor:
    """Blocks -> fp32 weight [out, in], computed as gguf-py does: (d * q) + m, each op rounded to fp32."""
    if scheme == "q4_1":
        q = torch.cat((qs & 15, qs >> 4), dim=-1).float()            # byte j: element j, then element j + 16
        w = q * d[..., None] + m[..., None]
    else:
        w = qs.float() * d[..., None]
    return w.reshape(w.shape[0], -1)


def quantize_blocks(weight: torch.Tensor, scheme: str):
    """fp weight [out, in] (in % 32 == 0) -> (qs, d, m or None, fraction of weights held exactly).

    First the blocks that reproduce `weight` bit for bit with fp16 d (and m), as a dequantized GGUF weight has:
    m = the block's minimum, d = fp16((max - min) / 15) (Q4_1), d = fp16(max|w| / 127) (Q8_0), q by rounding,
    then +-1 where that misses; a block that still differs is quantized from its min/max with fp32 d and m."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        raise UsageError(f"block quantization needs a 2-D weight with in_features % {BLOCK} == 0, got "
                         f"{tuple(weight.shape)}.")
    w = weight.detach().float().reshape(weight.shape[0], -1, BLOCK)
    if scheme == "q4_1":
        lo, hi = w.amin(-1), w.amax(-1)
        d, m = ((hi - lo) / 15).half().float(), lo.half().float()
        qmin, qmax = 0, 15
    elif scheme == "q8_0":
        amax = w.abs().amax(-1)
        d, m = (amax / 127).half().float(), None
        qmin, qmax = -127, 127
    else:
        raise UsageError(f"unknown block scheme {scheme!r}")

    def recon(q, d, m):
        return q * d[..., None] + (m[..., None] if m is not None else 0.0)

    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round((w - (m[..., None] if m is not None else 0.0)) / safe[..., None]).clamp(qmin, qmax)
    for step in (1.0, -1.0):               # a rounding that landed one step off the stored q
        miss = recon(q, d, m) != w
        alt = (q + step).clamp(qmin, qmax)
        q = torch.where(miss & (recon(alt, d, m) == w), alt, q)
    exact = (recon(q, d, m) == w).all(-1)                            # [out, blocks]
    if not bool(exact.all()):                                         # not blocks of a GGUF: plain min/max blocks
        if scheme == "q4_1":
            d2 = (w.amax(-1) - w.amin(-1)) / 15
            m2 = w.amin(-1)
        else:
            d2, m2 = w.abs().amax(-1) / 127, None
        safe2 = torch.where(d2 == 0, torch.ones_like(d2), d2)
        q2 = torch.round((w - (m2[..., None] if m2 is not None else 0.0)) / safe2[..., None]).clamp(qmin, qmax)
        q = torch.where(exact[..., None], q, q2)
        d = torch.where(exact, d, d2)
        m = torch.where(exact, m, m2) if m is not None else None
    fraction = float((recon(q, d, m) == w).float().mean())
    if scheme == "q4_1":
        qi = q.to(torch.uint8)
        qs = (qi[..., :16] | (qi[..., 16:] << 4)).contiguous()       # [out, blocks, 16]
    else:
        qs = q.to(torch.int8).contiguous()                            # [out, blocks, 32]
    return qs, d.contiguous(), None if m is None else m.contiguous(), fraction


GROUP = 16                               # output rows the int8-activation kernels interleave


def interleave_blocks(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None):
    """Blocks [out, nb, 16|32] -> the layout of the fused extension's int8-activation kernels (csrc/fused.cpp
    `block_gemm_q8`): rows in groups of 16 (zero rows past `out`), and per group and block 4 (Q4_1) or 8 (Q8_0)
    vectors of 64 bytes, vector s holding each row's bytes 4s..4s+3 of the block; d (and m) as fp16 [groups, nb,
    16] (`_half`). -> (qs [groups, nb, 4|8, 16, 4], d [groups, nb, 16], m or None), contiguous."""
    n, nb, width = qs.shape
    groups = -(-n // GROUP)
    pad = groups * GROUP - n

    def rows(t):
        return torch.cat((t, t.new_zeros((pad, *t.shape[1:])))) if pad else t

    q = rows(qs).reshape(groups, GROUP, nb, width // 4, 4).permute(0, 2, 3, 1, 4).contiguous()
    side = [None if t is None else rows(_half(t)).reshape(groups, GROUP, nb).transpose(1, 2).contiguous()
            for t in (d, m)]
    return q, side[0], side[1]


def _half(t: torch.Tensor) -> torch.Tensor:
    """Block scales as GGUF stores them, fp16: exact where the blocks were recovered from a GGUF (their d and m
    are fp16 values), rounded otherwise (as llama.cpp rounds them; the int8-activation draft is an approximation
    of the target either way, and verify keeps the output exact)."""
    h = t.half()
    if not bool(torch.isfinite(h).all()):
        raise UsageError(f"a block scale or minimum ({float(t.abs().max()):.3g}) is outside fp16's range, which the "
                         "int8-activation kernels store them in: build the draft with --draft-activations fp32")
    return h
