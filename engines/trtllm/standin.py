"""The CPU stand-in for the C++ `tensorrt_llm` / `tensorrt_llm_draft` models of a rehearsal.

`specbuild serve --rehearse` runs the repository `deploy --backend trtllm` wrote with upstream's own
Python models (preprocessing, postprocessing, tensorrt_llm_bls) and, in place of the C++ TensorRT-LLM
backend, a Python model (model_repository/rehearsal/tensorrt_llm_standin/model.py) that keeps the exact
config and calls this module. It implements the request semantics of the TensorRT-LLM backend
(inflight_batcher_llm/src/utils.cc, model_instance_state.cc of the same release) with the embedded
engine's parts (model.Transformer, weights.load_model, kvcache.KVCache, acceptor, sampling):

- `input_ids` (+ `input_lengths`, used to cut padding), `request_output_len` (max new tokens),
  `end_id` (generation stops before it; -1 = none), `min_length` (end_id suppressed until then),
  `temperature`/`runtime_top_k`/`runtime_top_p`/`random_seed` (or `seed`), `exclude_input_in_output`
  (request tensor over the model parameter, default false), `stop_words_list`, `streaming`;
- **external draft tokens**: with `draft_input_ids` (+ optional `draft_logits`) the target scores
  [last context token, d1..dK] in ONE forward and returns the accepted drafts plus one token (greedy:
  longest matching prefix, then the target's argmax; sampling: the rejection rule, with the draft's
  distribution from `draft_logits` or one-hot without them), capped by request_output_len, as
  `draft_tokens_external` does;
- `return_generation_logits`: the logits of every generated token, [1, 1, n, vocab] (the draft calls of
  upstream's BLS ask for them with use_draft_logits);
- outputs as the C++ backend shapes them: output_ids [1, 1, L] int32, sequence_length [1, 1].

The KV cache has a few slots; each remembers the tokens it holds. A request reuses the slot with the
longest common prefix and only runs the rest (prefix reuse, like TensorRT-LLM's enable_kv_cache_reuse);
`stats` counts reused and computed tokens so the rehearsal can report whether reuse happens.
Requests are served one at a time under a lock (the stand-in does not batch).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specbuild.engines.embedded.acceptor import greedy_accept, rejection_accept
from specbuild.engines.embedded.kvcache import KVCache
from specbuild.engines.embedded.model import ragged_forward
from specbuild.engines.embedded.sampling import SamplingParams, make_generator, processed_probs, sample
from specbuild.engines.embedded.weights import load_model


class RequestError(ValueError):
    """A request the C++ backend would refuse (the message says why)."""


@dataclass
class Request:
    input_ids: list[int]
    max_new_tokens: int
    end_id: int | None = None
    min_length: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    exclude_input_in_output: bool = False
    streaming: bool = False
    draft_input_ids: list[int] | None = None
    draft_logits: np.ndarray | None = None          # [K, vocab]
    return_generation_logits: bool = False
    stop_words: list[list[int]] = field(default_factory=list)


@dataclass
class Result:
    new_tokens: list[int]
    generation_logits: np.ndarray | None            # [n, vocab] float32
    num_draft: int = 0
    num_accepted: int = 0


@dataclass
class Stats:
    requests: int = 0
    reused_tokens: int = 0          # context tokens whose KV came from the cache (prefix reuse)
    computed_tokens: int = 0        # tokens run through the model
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class StandinEngine:
    """One model (target or draft) with its own KV cache and prefix reuse."""

    def __init__(self, model_dir: str | Path, *, max_seq_len: int = 2048, slots: int = 4, dtype: str = "float32",
                 device: str = "cpu"):
        self.model = load_model(model_dir, dtype=dtype, device=device)
        cfg = self.model.cfg
        self.vocab_size = cfg.vocab_size
        self.max_seq_len = max_seq_len
        self.device = device
        self.cache = KVCache(num_layers=cfg.num_layers, num_slots=slots, kv_heads=cfg.num_kv_heads,
                             max_seq=max_seq_len, head_dim=cfg.head_dim, dtype=self.model.embed.weight.dtype,
                             device=device)
        self.cached: list[list[int]] = [[] for _ in range(slots)]   # tokens whose KV each slot holds
        self.lru: list[int] = list(range(slots))
        self.lock = threading.Lock()
        self.stats = Stats()

    # -- KV cache with prefix reuse ------------------------------------------------------------------
    def _slot_for(self, tokens: list[int]) -> tuple[int, int]:
        best, best_len = self.lru[0], -1
        for slot, have in enumerate(self.cached):
            n = 0
            for a, b in zip(have, tokens):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = slot, n
        if best_len <= 0:
            best, best_len = self.lru[0], 0
        self.lru.remove(best)
        self.lru.append(best)
        return best, best_len

    @torch.inference_mode()
    def _run(self, slot: int, tokens: list[int], start: int) -> torch.Tensor:
        """Feed tokens[start:] at positions start..; -> logits [len(tokens) - start, V]; remember the tokens."""
        rows = tokens[start:]
        logits = ragged_forward(self.model, self.cache, [slot], [start], [rows], "all", self.device)
        self.cached[slot] = list(tokens)
        self.stats.computed_tokens += len(rows)
        return logits

    def _context_logits(self, slot: int, tokens: list[int], reuse: int) -> torch.Tensor:
        """Logits after the last token of `tokens` (the next token's distribution), reusing `reuse` cached."""
        reuse = min(reuse, len(tokens) - 1)   # the last token is always run: its logits are needed
        self.stats.reused_tokens += reuse
        return self._run(slot, tokens, reuse)[-1:]

    # -- the request ----------------------------------------------------------------------------------
    def generate(self, req: Request, on_token=None) -> Result:
        if not req.input_ids:
            raise RequestError("input_ids is empty")
        if req.max_new_tokens < 0:
            raise RequestError(f"request_output_len {req.max_new_tokens} must be >= 0")
        if len(req.input_ids) + req.max_new_tokens + len(req.draft_input_ids or []) > self.max_seq_len:
            raise RequestError(f"prompt ({len(req.input_ids)}) + request_output_len ({req.max_new_tokens}) exceeds "
                               f"the stand-in's max_seq_len {self.max_seq_len}")
        bad = [t for t in req.input_ids + (req.draft_input_ids or []) if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size})")
        with self.lock:
            self.stats.requests += 1
            if req.max_new_tokens == 0:
                return Result([], None)
            params = SamplingParams(max_tokens=max(1, req.max_new_tokens), temperature=req.temperature,
                                    top_k=req.top_k, top_p=req.top_p, seed=req.seed)
            gen = None if params.greedy else make_generator(req.seed, self.device)
            slot, reuse = self._slot_for(req.input_ids)
            if req.draft_input_ids:
                return self._verify(req, params, gen, slot, reuse, on_token)
            return self._decode(req, params, gen, slot, reuse, on_token)

    def _mask(self, logits: torch.Tensor, req: Request, produced: int) -> torch.Tensor:
        if req.end_id is not None and 0 <= req.end_id < logits.shape[-1] and produced < req.min_length:
            logits = logits.clone()
            logits[..., req.end_id] = float("-inf")
        return logits

    def _pick(self, logits: torch.Tensor, params: SamplingParams, gen) -> int:
        probs = processed_probs(logits, params)
        return int(probs.argmax(-1)[0]) if params.greedy else int(sample(probs, gen)[0])

    def _stopped(self, req: Request, tokens: list[int], tok: int) -> bool:
        if req.end_id is not None and tok == req.end_id:
            return True
        return False

    def _hits_stop_word(self, req: Request, seq: list[int]) -> bool:
        return any(w and seq[-len(w):] == w for w in req.stop_words)

    def _decode(self, req: Request, params, gen, slot: int, reuse: int, on_token) -> Result:
        tokens = list(req.input_ids)
        logits = self._context_logits(slot, tokens, reuse)
        out, kept = [], []
        while len(out) < req.max_new_tokens:
            logits = self._mask(logits, req, len(out))
            tok = self._pick(logits, params, gen)
            if self._stopped(req, tokens, tok):
                break
            out.append(tok)
            kept.append(logits[0])
            tokens.append(tok)
            if on_token:
                on_token(tok)
            if len(out) >= req.max_new_tokens or self._hits_stop_word(req, tokens):
                break
            logits = self._run(slot, tokens, len(tokens) - 1)[-1:]
        gl = torch.stack(kept).numpy() if (req.return_generation_logits and kept) else None
        if req.return_generation_logits and gl is None:
            gl = np.zeros((0, self.vocab_size), np.float32)
        return Result(out, gl)

    def _verify(self, req: Request, params, gen, slot: int, reuse: int, on_token) -> Result:
        drafts = list(req.draft_input_ids or [])
        ctx = list(req.input_ids)
        reuse = min(reuse, len(ctx) - 1)
        self.stats.reused_tokens += reuse
        # One target forward over [context tail..., d1..dK]: logits at the last context token and each draft.
        logits = self._run(slot, ctx + drafts, reuse)[-(len(drafts) + 1):]
        logits = torch.stack([self._mask(logits[i:i + 1], req, i)[0] for i in range(len(drafts) + 1)])
        if params.greedy:
            acc = greedy_accept(drafts, logits.argmax(-1).tolist())
        else:
            target_probs = processed_probs(logits, params)
            draft_probs = None
            if req.draft_logits is not None:
                dl = torch.as_tensor(np.asarray(req.draft_logits, np.float32)).reshape(len(drafts), -1)
                draft_probs = processed_probs(dl, params)
            acc = rejection_accept(torch.tensor(drafts, dtype=torch.long), draft_probs, target_probs, gen)
        out = []
        for tok in acc.output_token_ids[:max(1, req.max_new_tokens)]:
            if self._stopped(req, ctx + out, tok):
                break
            out.append(tok)
            if on_token:
                on_token(tok)
            if self._hits_stop_word(req, ctx + out):
                break
        # The slot holds ctx + drafts; only ctx + the accepted drafts is valid for reuse.
        self.cached[slot] = (ctx + drafts)[:len(ctx) + min(acc.num_accepted, len(out))]
        self.stats.draft_tokens += len(drafts)
        self.stats.accepted_tokens += acc.num_accepted
        gl = logits[:len(out)].numpy() if req.return_generation_logits else None
        return Result(out, gl, len(drafts), acc.num_accepted)


def word_list(arr: Any) -> list[list[int]]:
    """Upstream's [2, L] word-list format (flat ids, cumulative end offsets padded with -1) -> token lists."""
    if arr is None:
        return []
    a = np.asarray(arr).reshape(2, -1) if np.asarray(arr).size else np.zeros((2, 0), np.int32)
    ids, offsets = a[0].tolist(), [int(o) for o in a[1].tolist() if int(o) >= 0]
    words, start = [], 0
    for end in offsets:
        words.append([int(t) for t in ids[start:end]])
        start = end
    return [w for w in words if w]
