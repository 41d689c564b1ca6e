"""The embedded speculative engine: public API shared by the Triton model, `infer`, build and benchmarks.

    eng = Engine.from_checkpoints("ckpt/target", "ckpt/draft", max_batch_size=4)
    out = eng.generate("The capital of France is", SamplingParams(max_tokens=16), num_draft_tokens=4)
    out.text, out.stats.acceptance_rate
    eng = Engine.from_build_dir("work/engines")          # what `specbuild build` wrote (engine_config.json)
    eng.set_policy(Policy(k=4, proposer="ngram"))        # the default speculation, from the next step on

Serving: `start()` runs the scheduler in a background thread; `submit()` streams `StreamDelta`s to a
callback; `abort()` releases the slot at once. `generate()`/`generate_batch()` and `step()` (calibration,
benchmarks) go through the same `Scheduler.step()` (driven in the caller's thread when the engine is not started).

Configuration: `EngineConfig` (config.py: every key of engine_config.json, validated) and its `Policy` (what a
request that sends no K gets, and what a request's own K means: the table in config.py). The engine's serving
state changes only through `set_policy` (speculation), `set_admission` (queue and deadline limits) and
`update_calibration` (the costs adaptive K prices K with).

Notes on the config fields the engine acts on:
- `draft_kv` ("own" or "shared"): "shared" lets a self-draft (a quantized copy of the target: same layers, KV
  heads and head size) attend over the *target's* KV cache instead of its own (QSpec, arXiv:2410.11305, shares
  the cache between a quantized draft and its verifier). The draft then never prefills a prompt nor catches up
  accepted tokens: it feeds only [last, d1..] at positions the next verify overwrites, so the target's cache
  stays the target's and the output is unchanged. `build` writes "shared" when the draft checkpoint's weights
  are the target's; `from_checkpoints` shares when draft_dir is target_dir.
- `linear_kernel` ("auto", "tiled", "onednn", "aten"): see kernels.py and step.py.
- `prefill_precision` ("fp32", "bf16"): "bf16" computes the target's prompt rows as bf16 products with fp32 sums
  on AVX-512 BF16 (step.prepare_bf16_prefill_; a prefill runs ~1.5x faster on an AMD EPYC Zen 4, bench/README.md)
  and every other row in fp32. Speculation stays lossless (a prompt's cache is the same bits with it on or off);
  the output is no longer the fp32 model's exactly, as any lower-precision prefill. The engine refuses it
  without the fused step or without AVX-512 BF16.
- `draft_activations` ("fp32", "int8"): a block-quantized draft (int4) on the extension's integer kernels rounds
  its activations to 8 bits per block of 32 (llama.cpp's Q8_1 scheme): its step costs about a third less and it
  is no longer the target's exact arithmetic, so acceptance falls a little (measured in bench/README.md). The
  output is the target's either way: verify decides every token. `build` writes "int8" for an int4 draft.
- `online_costs` (default true): adaptive K prices K with the step costs the engine measures while serving
  (adaptive.OnlineCosts), falling back to the build's calibration until it has seen enough steps.
- `acceptance_rule`: "exact" (default, lossless) or "unsafe-always-accept", a DELIBERATE FAULT that accepts
  every draft, only for showing that `specbuild verify` catches drift. Never serve with it.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
from pathlib import Path
from typing import Callable

import torch

import specbuild
from specbuild.engines.embedded.config import ADAPTIVE_K, EXACT, ConfigError, EngineConfig, Policy, default_policy
from specbuild.engines.embedded.detok import IncrementalDetokenizer
from specbuild.engines.embedded.errors import EngineError, EngineLimitError
from specbuild.engines.embedded.step import linear_kernel_of, pack_linears_
from specbuild.engines.embedded.kvcache import KVCache
from specbuild.engines.embedded.model import Transformer
from specbuild.engines.embedded.proposers import DraftModelProposer, NgramProposer
from specbuild.engines.embedded.sampling import SamplingParams, make_generator
from specbuild.engines.embedded.scheduler import Scheduler
from specbuild.engines.embedded.scorer import TargetScorer
from specbuild.engines.embedded.sequence import RequestOutput, Sequence, StreamDelta
from specbuild.engines.embedded.stats import SpecStats
from specbuild.engines.embedded.weights import load_model, load_quantized_model, torch_dtype
from specbuild.core.constants import PROPOSERS
from specbuild.core.errors import SourceError

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, target: Transformer, tokenizer, config: EngineConfig, draft: Transformer | None = None,
                 *, eos_token_id: int | None = None):
        self.tokenizer, self.config, self.target, self.draft = tokenizer, config, target, draft
        self.eos_token_id = eos_token_id
        if config.acceptance_rule != EXACT:
            log.warning("!!! acceptance_rule=%r: every drafted token is ACCEPTED WITHOUT VERIFICATION. Output is "
                        "NOT the target's; this is a deliberate fault for testing `specbuild verify`. Never serve "
                        "with it: set acceptance_rule to \"exact\" in engine_config.json. !!!", config.acceptance_rule)
        if (draft is None) != (config.draft is None):
            raise ConfigError("EngineConfig.draft must be set exactly when a draft model is given.")
        dev = self.device = torch.device(config.device)

        def cache_for(m: Transformer) -> KVCache:
            c = m.cfg
            return KVCache(num_layers=c.num_layers, num_slots=config.max_batch_size, kv_heads=c.num_kv_heads,
                           max_seq=config.max_seq_len, head_dim=c.head_dim, dtype=m.embed.weight.dtype, device=dev,
                           decode_step=config.decode_step)

        from specbuild.engines.embedded.hugepages import place_weights_

        for m in (target, draft):            # the streamed weights on 2 MB pages, before any runner takes them
            if m is not None and place_weights_(m):
                log.info("%s's streamed weights on transparent huge pages", "target" if m is target else "draft")
        if config.prefill_precision == "bf16" and getattr(target, "_bf16_prefill", None) is None:
            from specbuild.engines.embedded.step import prepare_bf16_prefill_

            prepare_bf16_prefill_(target)           # before its runner is made (decode_step_of, below)
        self.scorer = TargetScorer(target, cache_for(target), dev)
        proposer = None
        if draft is not None and config.draft_kv == "shared":
            _check_kv_compatible(target, draft)
            proposer = DraftModelProposer(draft, self.scorer.cache, dev, shares_target_kv=True)
        elif draft is not None:
            from specbuild.engines.embedded.quant import BlockLinear

            for m in draft.modules():      # an own-cache draft prefills prompts: on an fp32 copy, not block kernels
                if isinstance(m, BlockLinear):
                    m.prefill_copy = True
            proposer = DraftModelProposer(draft, cache_for(draft), dev)
        from specbuild.engines.embedded.fused import status
        from specbuild.engines.embedded.step import decode_step_of

        self.decode_step = decode_step_of(target, self.scorer.cache)       # "fused" | "eager", what forwards run
        log.info("decode step: %s", self.decode_step if self.decode_step == "fused" else status())
        if config.prefill_precision == "bf16" and self.decode_step != "fused":
            raise ConfigError(f"prefill_precision 'bf16' runs on the fused step, and this engine's is "
                              f"{self.decode_step} ({status()}); use prefill_precision 'fp32' or decode_step "
                              "'auto' / 'fused'.")
        if self.decode_step == "fused" and specbuild.OMP_THREADS_SPIN:
            log.warning("torch was imported before specbuild with OpenMP's default wait policy: its workers spin "
                        "after every op on the cores the fused step's kernels use (a step ran 1.2-1.5x slower). Set "
                        "OMP_WAIT_POLICY=passive, or import specbuild before torch.")
        measured = (config.calibration or {}).get("decode_step")
        if measured and measured != self.decode_step:
            log.warning("the build's calibration was measured on the %s decode step but this engine runs %s: its "
                        "costs, default K and crossover are stale; re-measure with `specbuild build --force`.",
                        measured, self.decode_step)
        self.scheduler = Scheduler(scorer=self.scorer, draft=proposer, ngram=NgramProposer(),
                                   max_batch_size=config.max_batch_size, policy=config.policy,
                                   calibration=config.calibration, acceptance_rule=config.acceptance_rule,
                                   max_waiting=config.queue_limit, queue_timeout_s=config.queue_timeout_s,
                                   request_timeout_s=config.request_timeout_s, online_costs=config.online_costs)
        self._ids = itertools.count()
        self._step_lock = threading.Lock()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False

    @property
    def calibration(self) -> dict | None:
        return self.config.calibration

    # ---- construction -----------------------------------------------------------------------------
    @classmethod
    def from_checkpoints(cls, target_dir, draft_dir=None, *, tokenizer_dir=None, threads=None, draft_quantize=None,
                         draft_kv=None, policy: Policy | None = None, **fields) -> "Engine":
        """Load target (and draft) checkpoint dirs. `fields`: EngineConfig fields (max_batch_size, max_seq_len,
        max_draft_len, dtype, device, linear_kernel, online_costs, acceptance_rule, max_queue_size,
        queue_timeout_s, request_timeout_s, calibration). `policy`: default Policy(k=min(4, max_draft_len)) with
        the draft, or n-gram without one (`config.default_policy`). `draft_quantize="int8"` quantizes an fp draft on load. `draft_kv`:
        "own", "shared" (see the module docstring), None = "shared" when draft_dir is target_dir, else "own".
        The tokenizer comes from `tokenizer_dir`, default the target dir."""
        if draft_kv is None:
            draft_kv = "shared" if draft_dir is not None and Path(draft_dir).resolve() == Path(target_dir).resolve() \
                else "own"
        if policy is None:
            policy = default_policy(fields.get("max_draft_len", EngineConfig.max_draft_len), draft_dir is not None)
        cfg = EngineConfig(target=str(target_dir), draft=None if draft_dir is None else str(draft_dir),
                           tokenizer=None if tokenizer_dir is None else str(tokenizer_dir),
                           draft_quantize=draft_quantize, threads=threads,
                           draft_kv=draft_kv if draft_dir is not None else "own", policy=policy, **fields)
        return cls.load(cfg, base=None)

    @classmethod
    def from_build_dir(cls, engine_dir, *, device=None, threads=None, **overrides) -> "Engine":
        """Load the output of `specbuild build --backend embedded`: `engine_config.json` (EngineConfig) names the
        target and draft dirs (relative to engine_dir), the limits, the policy and the calibration. `overrides`
        replace EngineConfig fields (e.g. `policy=Policy(k=0)`, `acceptance_rule="exact"`)."""
        cfg = EngineConfig.load(engine_dir)
        changes = {k: v for k, v in (("device", device), ("threads", threads)) if v}
        return cls.load(cfg.replace(**changes, **overrides), base=Path(engine_dir))

    @classmethod
    def load(cls, cfg: EngineConfig, *, base: Path | None) -> "Engine":
        """Build an engine from a config; its paths are relative to `base` (None: as given)."""
        def path(rel):
            return Path(rel) if base is None else base / rel

        if cfg.threads:
            torch.set_num_threads(int(cfg.threads))
        torch_dtype(cfg.dtype)
        target = load_model(path(cfg.target), dtype=cfg.dtype, device=cfg.device)
        if cfg.prefill_precision == "bf16":         # from the fp32 weights, before they move into a kernel's layout
            from specbuild.engines.embedded.step import prepare_bf16_prefill_

            prepare_bf16_prefill_(target)
        pack_linears_(target, cfg.linear_kernel)
        draft = None
        if cfg.draft is not None:
            draft = _load_draft(path(cfg.draft), dtype=cfg.dtype, device=cfg.device,
                                quantize=cfg.draft_quantize if cfg.draft_format in (None, "hf-safetensors") else None)
            if draft.cfg.vocab_size != target.cfg.vocab_size:
                raise SourceError(f"draft vocab_size {draft.cfg.vocab_size} != target vocab_size "
                                  f"{target.cfg.vocab_size}; the draft must share the target's tokenizer.")
            pack_linears_(draft, cfg.linear_kernel)
            if cfg.draft_activations == "int8":
                from specbuild.engines.embedded.quant import set_block_activations_

                set_block_activations_(draft, "int8")
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path(cfg.tokenizer or cfg.target)))
        eos = tok.eos_token_id
        if eos is None:
            eos = json.loads((path(cfg.target) / "config.json").read_text()).get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) else eos
        measured = (cfg.calibration or {}).get("linear_kernel", "aten" if cfg.calibration else None)
        if measured and measured != linear_kernel_of(target):
            log.warning("the build's calibration was measured with %s linears but this engine runs %s: its costs, "
                        "default K and crossover are stale; re-measure with `specbuild build --force`.",
                        measured, linear_kernel_of(target))
        measured_act = (cfg.calibration or {}).get("draft_activations", "fp32" if cfg.calibration else None)
        if draft is not None and measured_act and measured_act != cfg.draft_activations:
            log.warning("the build's calibration was measured with %s draft activations but this engine runs %s: "
                        "its costs, acceptance, default K and crossover are stale; re-measure with "
                        "`specbuild build --force`.", measured_act, cfg.draft_activations)
        return cls(target, tok, cfg, draft, eos_token_id=eos)

    # ---- requests ---------------------------------------------------------------------------------
    def _make_sequence(self, prompt, params: SamplingParams, num_draft_tokens, proposer, on_output,
                       request_id=None) -> Sequence:
        cfg = self.config
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise EngineLimitError("the prompt is empty (0 tokens); send at least one token of text.")
        vocab = self.target.cfg.vocab_size
        bad = [t for t in ids if t < 0 or t >= vocab]
        if bad:
            raise EngineLimitError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}.")
        if len(ids) + params.max_tokens > cfg.max_seq_len:
            raise EngineLimitError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                                   f"{len(ids) + params.max_tokens} exceeds max_seq_len={cfg.max_seq_len}; shorten the "
                                   f"prompt, lower max_tokens, or rebuild the engine with a larger max_seq_len.")
        if num_draft_tokens is not None and int(num_draft_tokens) != ADAPTIVE_K \
                and not 0 <= int(num_draft_tokens) <= cfg.max_draft_len:
            raise EngineLimitError(f"num_draft_tokens={num_draft_tokens} is outside [0, max_draft_len="
                                   f"{cfg.max_draft_len}]; use a smaller K (0 = speculation off, -1 = adaptive) or "
                                   f"rebuild with a larger max_draft_len.")
        with self.scheduler.lock:
            policy = self.scheduler.policy
        k, adaptive, forced = policy.resolve(None if num_draft_tokens is None else int(num_draft_tokens),
                                             cfg.max_draft_len)
        prop = proposer or policy.proposer
        if prop not in PROPOSERS:
            raise EngineLimitError(f"proposer {prop!r} is unknown; use one of {PROPOSERS}.")
        if prop == "draft" and k != 0 and self.draft is None:
            raise EngineLimitError("this engine has no draft model; use proposer='ngram', num_draft_tokens=0, "
                                   "or build the engine with a draft.")
        if params.stop_token_ids is not None:
            bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
            if bad:       # a logits index later (min_tokens suppresses them): out of range it fails the step
                raise EngineLimitError(f"end_id / stop token ids must be in [0, {vocab}) (the vocabulary); got "
                                       f"{bad[:5]}. Leave end_id out to stop at the tokenizer's EOS.")
            stop_ids = set(params.stop_token_ids)
            if params.ignore_eos:
                stop_ids.discard(self.eos_token_id)
        else:
            stop_ids = set() if params.ignore_eos or self.eos_token_id is None else {self.eos_token_id}
        tracker = None
        if adaptive and k > 0:       # adaptive: K varies per step in [0, max_draft_len]
            with self.scheduler.lock:
                tracker = self.scheduler.kplan.tracker(prop)
        seq = Sequence(request_id or f"req-{next(self._ids)}", ids, params, k, prop, on_output, frozenset(stop_ids),
                       IncrementalDetokenizer(self.tokenizer, ids, params.stop), SpecStats(),
                       None if params.greedy else make_generator(params.seed, self.device), adaptive=tracker)
        seq.forced_k = forced
        return seq

    def submit(self, prompt, params: SamplingParams = SamplingParams(), *, num_draft_tokens=None, proposer=None,
               on_output: Callable[[StreamDelta], None], request_id: str | None = None) -> str:
        seq = self._make_sequence(prompt, params, num_draft_tokens, proposer, on_output, request_id)
        self.scheduler.add(seq, bounded=True)       # refused at once when max_queue_size already wait
        with self._wake:
            self._wake.notify()
        return seq.request_id

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def step(self) -> None:
        """One scheduling step in the caller's thread (calibration, benchmarks, tests); not while `start()`ed."""
        if self._thread is not None:
            raise EngineError("step() drives an engine that is not serving; this one runs its own thread.")
        with self._step_lock:
            self.scheduler.step()

    def generate(self, prompt, params: SamplingParams = SamplingParams(), *, num_draft_tokens=None,
                 proposer=None) -> RequestOutput:
        return self.generate_batch([(prompt, params, num_draft_tokens)], proposer=proposer)[0]

    def generate_batch(self, requests, proposer=None) -> list[RequestOutput]:
        """requests: [(prompt, SamplingParams, num_draft_tokens | None)] -> outputs in the same order."""
        done = threading.Event()
        finals: dict[str, bool] = {}
        lock = threading.Lock()
        seqs = [self._make_sequence(p, sp, k, proposer, None) for p, sp, k in requests]

        def on_output(d: StreamDelta) -> None:
            if d.finished:
                with lock:
                    finals[d.request_id] = True
                    if len(finals) == len(seqs):
                        done.set()

        for s in seqs:
            s.on_output = on_output
            self.scheduler.add(s)
        if self._thread is not None:
            with self._wake:
                self._wake.notify()
            done.wait()
        else:
            with self._step_lock:
                while not done.is_set():
                    self.scheduler.step()
        failed = [s for s in seqs if s.finish_reason == "error"]
        if failed:
            raise EngineError(f"request {failed[0].request_id} failed: {failed[0].error}; see the log for the "
                              f"traceback (a CUDA out-of-memory error needs a smaller max_batch_size or max_seq_len).")
        return [s.output() for s in seqs]

    # ---- serving thread ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="specbuild-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        with self._step_lock:
            while True:
                with self._wake:
                    while not self._stop and not self.scheduler.has_work():
                        self._wake.wait(timeout=0.5)
                    if self._stop:
                        return
                self.scheduler.step()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the serving thread (it ends after the step in progress; waits at most `timeout` s for it);
        requests still live are finished with reason "abort"."""
        if self._thread is not None:
            with self._wake:
                self._stop = True
                self._wake.notify_all()
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the engine thread did not stop within %s s (a step is still running)", timeout)
            self._thread = None
        with self.scheduler.lock:
            live = [s.request_id for s in list(self.scheduler.waiting) + list(self.scheduler.running)]
        for rid in live:
            self.scheduler.abort(rid)

    def metrics(self) -> dict:
        return self.scheduler.metrics()

    # ---- serving state: the only ways it changes --------------------------------------------------
    def set_policy(self, policy: Policy) -> None:
        """Replace the default speculation (checked against this engine's limits); requests submitted from now
        on, and the cut-off from the next step on, follow it."""
        policy.check(max_draft_len=self.config.max_draft_len, has_draft=self.draft is not None)
        with self.scheduler.lock:
            self.config = self.config.replace(policy=policy)
            self.scheduler.set_policy(policy)
        log.info("speculation policy: %s (%s)", policy.describe(), policy.source)

    def set_admission(self, *, max_queue_size=..., queue_timeout_s=..., request_timeout_s=...) -> None:
        """Replace admission limits (a field left out keeps its value; None = no limit / the default queue)."""
        changes = {k: v for k, v in (("max_queue_size", max_queue_size), ("queue_timeout_s", queue_timeout_s),
                                     ("request_timeout_s", request_timeout_s)) if v is not ...}
        with self.scheduler.lock:
            self.config = cfg = self.config.replace(**changes)
            self.scheduler.admission.set_limits(max_waiting=cfg.queue_limit, queue_timeout_s=cfg.queue_timeout_s,
                                                request_timeout_s=cfg.request_timeout_s)

    def update_calibration(self, calibration: dict | None) -> None:
        """Replace the measured costs adaptive K uses (e.g. re-measured under the machine's current load); and
        its alpha, when it has one, becomes the starting estimate of new adaptive requests. From the next step."""
        with self.scheduler.lock:
            self.config = self.config.replace(calibration=calibration)
            self.scheduler.kplan.set_calibration(calibration)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def _check_kv_compatible(target: Transformer, draft: Transformer) -> None:
    t, d = target.cfg, draft.cfg
    pairs = [("num_hidden_layers", t.num_layers, d.num_layers), ("num_key_value_heads", t.num_kv_heads, d.num_kv_heads),
             ("head_dim", t.head_dim, d.head_dim), ("dtype", target.embed.weight.dtype, draft.embed.weight.dtype)]
    bad = [f"{name} {a} vs {b}" for name, a, b in pairs if a != b]
    if bad:
        raise SourceError(f"draft_kv='shared' needs a draft with the target's KV layout, but {', '.join(bad)} "
                          "(target vs draft); only a self-draft (a quantized copy of the target) can share it: "
                          "set draft_kv to 'own' in engine_config.json.")


def _load_draft(draft_dir, *, dtype, device, quantize: str | None) -> Transformer:
    """A draft dir is a plain checkpoint (quantized on load with `quantize`), or a quantized draft written by the
    build stage (quant.save_quantized_model)."""
    from specbuild.engines.embedded import quant

    cfg_path = Path(draft_dir) / "config.json"
    if cfg_path.is_file() and "specbuild_quantization" in json.loads(cfg_path.read_text()):
        return load_quantized_model(draft_dir, dtype=dtype, device=device)
    model = load_model(draft_dir, dtype=dtype, device=device)
    return quant.quantize_model_(model, quantize) if quantize else model
