"""A compact Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, SmolLM) for the embedded engine.

Fused QKV and gate/up projections; GQA through SDPA with an explicit boolean mask so ragged batches
(different lengths, different numbers of new tokens per row) run in one forward; RoPE (default, linear,
llama3); RMSNorm; SwiGLU. Every projection is an `nn.Linear`-compatible submodule (`forward(x)`,
`.weight`), so a quantized draft (`quant.quantize_model_`) swaps them in place and stays the same class.

Shapes: B = rows in the batch, T = new tokens per row (padded), S = attended cache length.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specbuild.core.errors import SourceError
from specbuild.core.constants import EMBEDDED_MODEL_TYPES as SUPPORTED_MODEL_TYPES



@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()          # sorted (key, value) pairs of the HF rope dict, () = default
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 2048

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise SourceError(f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads="
                              f"{self.num_kv_heads}; the checkpoint's config.json is inconsistent.")

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        mtype = cfg.get("model_type", "")
        if mtype not in SUPPORTED_MODEL_TYPES:
            raise SourceError(f"model_type {mtype!r} is not supported by the embedded engine "
                              f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); use --backend trtllm for other "
                              f"families.")
        if cfg.get("hidden_act", "silu") != "silu":
            raise SourceError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (only silu / SwiGLU).")
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rtype = rope.get("rope_type", rope.get("type", "default"))
        if rtype not in ("default", "linear", "llama3"):
            raise SourceError(f"rope type {rtype!r} is not supported by the embedded engine (default, linear, llama3).")
        scaling = () if rtype == "default" else tuple(sorted((k, v) for k, v in rope.items()
                                                             if isinstance(v, (int, float, str))))
        return cls(
            model_type=mtype, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"], rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)) or mtype == "qwen2",
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        )


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] for the RoPE variant in `cfg.rope_scaling`."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = dict(cfg.rope_scaling)
    rtype = sc.get("rope_type", sc.get("type", "default"))
    if rtype == "linear":
        inv = inv / float(sc["factor"])
    elif rtype == "llama3":
        factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(is_mid, mid, scaled)
    return inv.float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if x.dtype == torch.float32:          # one op, bitwise the same as the composite below for fp32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.hd = cfg.num_heads, cfg.num_kv_heads, hd
        self.q_size, self.kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)   # fused q|k|v
        self.o = nn.Linear(self.q_size, h, bias=False)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_up = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)          # fused gate|up
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.inter = cfg.intermediate_size

    def forward(self, x, cos, sin, kc, vc, meta: "BatchMeta"):
        B, T, _ = x.shape
        qkv = self.qkv(self.input_norm(x))                                  # [B, T, q+2kv]
        qk, v = qkv.split((self.q_size + self.kv_size, self.kv_size), dim=-1)
        # RoPE on q and k heads at once: rotate_half(x) * sin == roll(x, hd/2) * [-sin | sin] (sin_signed)
        qk = qk.reshape(B, T, self.n_heads + self.n_kv, self.hd)
        qk = qk * cos + torch.roll(qk, self.hd // 2, dims=-1) * sin         # cos/sin: [B, T, 1, hd]
        q, k = qk.split((self.n_heads, self.n_kv), dim=2)
        # Write by position: kc[slot, :, pos] = k[b, t]; a rejected draft is simply overwritten later.
        kc[meta.write_slots, :, meta.write_pos] = k.to(kc.dtype)
        vc[meta.write_slots, :, meta.write_pos] = v.view(B, T, self.n_kv, self.hd).to(vc.dtype)
        keys, vals = meta.read(kc), meta.read(vc)                           # [B, kv, S, hd]
        att = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals, attn_mask=meta.mask,
                                             enable_gqa=self.n_kv != self.n_heads)    # [B, H, T, hd]
        x = x + self.o(att.transpose(1, 2).reshape(B, T, self.q_size))
        gu = self.gate_up(self.post_norm(x))
        g, u = gu.split((self.inter, self.inter), dim=-1)
        return x + self.down(F.silu(g) * u)


class BatchMeta:
    """Per-forward indexing built once and shared by every layer.

    tokens are at `positions` [B, T] of cache rows `slots` [B]; padded entries (ragged rows) write to a
    scratch slot so they never clobber real cache entries. Query (b, t) attends to cache positions
    0..positions[b, t] of its own slot.
    """

    def __init__(self, slots: list[int], positions: torch.Tensor, valid: torch.Tensor, scratch_slot: int,
                 device, attn_len: int):
        B, T = positions.shape
        self.B, self.T = B, T
        pos_q = positions if B == 1 else torch.where(valid, positions, torch.zeros_like(positions))
        self.attn_len = attn_len                                             # S = max real position + 1
        slot_t = torch.tensor(slots, dtype=torch.long, device=device)
        self.write_slots = torch.where(valid, slot_t[:, None], torch.full_like(positions, scratch_slot))
        self.write_pos = torch.where(valid, positions, torch.zeros_like(positions))
        contiguous = slots == list(range(slots[0], slots[0] + B))
        self._slice = (slots[0], slots[0] + B) if contiguous else None
        self._slot_t = slot_t
        if B == 1 and T == 1:
            self.mask = None                                                 # attend to the whole 0..pos range
        else:
            ar = torch.arange(self.attn_len, device=device)
            self.mask = (ar[None, None, :] <= pos_q[:, :, None]).unsqueeze(1)   # [B, 1, T, S]
        self.positions = pos_q

    def read(self, cache):
        if self._slice is not None:
            return cache[self._slice[0]:self._slice[1], :, :self.attn_len]
        return cache[:, :, :self.attn_len].index_select(0, self._slot_t)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._rope_cache = None

    def rope_tables(self, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sign-folded sin) [>= need, hd] in the model's dtype (the table `_rope` indexes)."""
        self._rope(torch.zeros(1, 1, dtype=torch.long, device=self.inv_freq.device), need)
        return self._rope_cache

    def _rope(self, positions: torch.Tensor, need: int):
        """cos/sin [B, T, 1, hd] for `positions` (all < need), from a table grown on demand."""
        if self._rope_cache is None or self._rope_cache[0].shape[0] < need:
            n = max(need, 2 * (self._rope_cache[0].shape[0] if self._rope_cache else 256))
            t = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
            freqs = torch.outer(t, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            dt = self.embed.weight.dtype
            sin = emb.sin()
            half = sin.shape[-1] // 2
            sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)      # for roll(x, hd/2) == [x2, x1]
            self._rope_cache = (emb.cos().to(dt), sin.to(dt))
        cos, sin = self._rope_cache
        return cos[positions].unsqueeze(2), sin[positions].unsqueeze(2)      # sin is sign-folded, see _rope

    def forward(self, tokens: torch.Tensor, meta: BatchMeta, cache, logits_index: torch.Tensor | None = None,
                hidden: bool = False):
        """tokens [B, T] -> logits [N, V] (float32) at the flattened rows `logits_index` (default: every row);
        `hidden`: the final-normed hidden states [N, D] there instead (what the lm_head would take)."""
        x = self.embed(tokens)
        cos, sin = self._rope(meta.positions, meta.attn_len)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], meta)
        x = x.reshape(-1, x.shape[-1])
        if logits_index is not None:
            x = x.index_select(0, logits_index)
        return self.norm(x) if hidden else self.lm_head(self.norm(x)).float()

    def num_bytes(self) -> int:
        seen, total = set(), 0
        for t in list(self.parameters()) + list(self.buffers()):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total + sum(getattr(m, "packed_nbytes", 0) for m in self.modules())   # kernels.PackedLinear

    def step_bytes(self) -> int:
        """Bytes one decode step streams (a roofline's numerator): every weight but the embedding table, of which a
        step reads one row per token, unless the lm_head computes on that very tensor (tied and not repacked)."""
        emb = self.embed.weight
        lm_w = getattr(self.lm_head, "weight", None)
        shared = isinstance(lm_w, torch.Tensor) and lm_w.data_ptr() == emb.data_ptr()
        return self.num_bytes() - (0 if shared else emb.numel() * emb.element_size())

    def greedy_step_bytes(self) -> int:
        """Bytes one greedy decode step streams: `step_bytes`, with the lm_head's share as a greedy row reads it
        (a screening head reads its Q8_0 copy, not its fp32 weight: kernels.TiledLinear.greedy_read_bytes)."""
        head = self.lm_head
        if not hasattr(head, "greedy_read_bytes"):
            return self.step_bytes()
        own = sum(t.numel() * t.element_size() for t in head.buffers()) + sum(
            p.numel() * p.element_size() for p in head.parameters())
        return self.step_bytes() - own + head.greedy_read_bytes()


@torch.inference_mode()
def ragged_forward(model: Transformer, cache, slots: list[int], starts: list[int], rows: list[list[int]],
                   logits: str = "last", device="cpu", between: Callable[[], None] | None = None,
                   prefill: bool = False):
    """Run rows of new tokens (row i at positions starts[i]..) in one forward: the fused step when the cache
    has a runner for this model (fused.py: ragged, no padding), else one padded eager forward.

    logits: "last" -> [B, V] at each row's last token; "all" -> [sum(len(row)), V] row-major; "none" -> None;
    "hidden" -> [B, D]: the final-normed hidden state at each row's last token (the lm_head's input: a greedy
    draft picks its token from it with `lm_head.greedy_ids`); "hidden_all" -> [sum(len(row)), D]: at every row
    (a greedy verify's, scorer.py).
    between: on the fused step, and for a model whose step streams PIECES_MIN_BYTES or more, the layers run in
    PIECES pieces and `between()` is called after each (the last one before the lm_head): the scheduler
    prefills a request that arrived during a verify or a draft step there, so its first token does not wait for
    the whole forward. It may run other forwards over other slots of the same cache; the rows here compute the
    same bits either way.
    prefill: the rows are prompts' (`CachedRunner.feed`): on the fused step, a model prepared with
    `step.prepare_bf16_prefill_` computes them on its bf16 copies (EngineConfig.prefill_precision); every other
    forward, and the eager one, in the model's own precision.
    """
    from specbuild.engines.embedded.step import runner_for

    runner = runner_for(model, cache, getattr(cache, "decode_step", "auto"))
    if runner is not None:
        return _fused_forward(model, runner, slots, starts, rows, logits, device, between, prefill)
    B, T = len(rows), max(len(r) for r in rows)
    lens = [len(r) for r in rows]
    if B == 1:
        tokens = torch.tensor([rows[0]], dtype=torch.long, device=device)
        positions = torch.arange(starts[0], starts[0] + T, device=device)[None]
        valid = torch.ones((1, T), dtype=torch.bool, device=device)
    else:
        tokens = torch.tensor([r + [0] * (T - len(r)) for r in rows], dtype=torch.long, device=device)
        positions = (torch.tensor(starts, device=device)[:, None] + torch.arange(T, device=device)[None])
        valid = torch.arange(T, device=device)[None] < torch.tensor(lens, device=device)[:, None]
    meta = BatchMeta(slots, positions, valid, cache.scratch_slot, device,
                     max(s + n for s, n in zip(starts, lens)))
    if logits == "none":
        idx = torch.empty(0, dtype=torch.long, device=device)
    elif logits in ("last", "hidden"):
        idx = torch.tensor([b * T + n - 1 for b, n in enumerate(lens)], device=device)
    elif all(n == T for n in lens):
        idx = None
    else:
        idx = torch.tensor([b * T + t for b, n in enumerate(lens) for t in range(n)], device=device)
    out = model(tokens, meta, cache, idx, hidden=logits in ("hidden", "hidden_all"))
    return None if logits == "none" else out


PIECES = 3      # a forward with a `between` hook runs its layers in this many pieces (ragged_forward) ...
PIECES_MIN_BYTES = 64 << 20     # ... when a step of the model streams this many bytes: a third of it reads >= 21 MB,
# far longer than the GIL hand-over a piece adds (up to the 0.5 ms switch interval while other threads run Python);
# a smaller model's step runs whole (the soak's tiny models: a step of a few hundred microseconds)


def _in_pieces(model: Transformer) -> bool:
    size = getattr(model, "_step_bytes_memo", None)
    if size is None:
        size = model._step_bytes_memo = model.step_bytes()
    return size >= PIECES_MIN_BYTES


def _fused_forward(model: Transformer, runner, slots, starts, rows, logits: str, device, between=None,
                   prefill: bool = False):
    flat = [t for r in rows for t in r]
    slot = torch.tensor([s for s, r in zip(slots, rows) for _ in r], dtype=torch.long)
    pos = torch.tensor([p0 + i for p0, r in zip(starts, rows) for i in range(len(r))], dtype=torch.long)
    h = model.embed(torch.tensor(flat, dtype=torch.long, device=device))
    if between is None or not _in_pieces(model):
        h = runner.forward(h, slot, pos, prefill=prefill)
    else:
        n = runner.num_layers()
        cuts = sorted({round(n * j / PIECES) for j in range(PIECES + 1)})
        for a, b in zip(cuts, cuts[1:]):
            h = runner.forward(h, slot, pos, a, b, prefill=prefill)
            between()
    if logits == "none":
        return None
    if logits in ("last", "hidden"):
        ends = list(itertools.accumulate(len(r) for r in rows))
        h = h.index_select(0, torch.tensor([e - 1 for e in ends], device=device))
    return model.norm(h) if logits in ("hidden", "hidden_all") else model.lm_head(model.norm(h)).float()


class CachedRunner:
    """A model with its own KV cache: the shared base of the target scorer and the draft proposer."""

    length_attr = ""   # the Sequence field counting this model's cached positions

    def __init__(self, model: Transformer, cache, device):
        self.model, self.cache, self.device = model, cache, device

    @torch.inference_mode()
    def feed(self, seqs, ends: list[int], want_logits: bool = False, hidden: bool = False):
        """Cache tokens[len:end] of each sequence (one ragged forward; a chunk of a prompt, or a whole one) and
        advance its length counter to `end`. want_logits: -> [B, V] logits after each row's last fed token
        (for a completed prompt: the first generated token's distribution), else None; with `hidden`, the
        lm_head's input [B, D] there instead."""
        rows = [s.tokens[getattr(s, self.length_attr):e] for s, e in zip(seqs, ends)]
        if not seqs or not all(rows):
            raise ValueError("feed needs at least one new token per sequence")
        logits = ragged_forward(self.model, self.cache, [s.slot for s in seqs],
                                [getattr(s, self.length_attr) for s in seqs], rows,
                                ("hidden" if hidden else "last") if want_logits else "none", self.device,
                                prefill=True)
        for s, e in zip(seqs, ends):
            setattr(s, self.length_attr, e)
        return logits
