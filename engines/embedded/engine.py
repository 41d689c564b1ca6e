"""The embedded speculative engine: public API shared by the Triton model, `infer`, build and benchmarks.

    eng = Engine.from_checkpoints("ckpt/target", "ckpt/draft", max_batch_size=4)
    out = eng.generate("The capital of France is", SamplingParams(max_tokens=16), num_draft_tokens=4)
    out.text, out.stats.acceptance_rate

Serving: `start()` runs the scheduler in a background thread; `submit()` streams `StreamDelta`s to a
callback; `abort()` frees the slot at once. `generate()`/`generate_batch()` go through the same
`Scheduler.step()` (driven in the caller's thread when the engine is not started).

Speculation controls (engine_config.json keys, also kwargs of `from_checkpoints` / `from_build_dir`):
- `adaptive_k` (default false): requests that send no K get adaptive K; a request may always ask for it with
  `num_draft_tokens=-1` (`ADAPTIVE_K`). Each step the sequence drafts the K in [0, max_draft_len] that
  maximizes the speedup predicted from its own acceptance and the build's `calibration` (see adaptive.py).
- `spec_max_concurrency` (default None = always on): no sequence drafts in a step where more than this many
  sequences run (TensorRT-LLM's `max_concurrency`); `bench/bench_adaptive.py` measures the crossover.
- `max_queue_size` (default None = 4 x max_batch_size): requests waiting for a slot beyond which `submit`
  refuses at once (EngineUnavailableError, HTTP 503); `queue_timeout_s` (default 60): a request still waiting
  for a slot after this long is finished with an "unavailable" error. Both also engine_config.json keys and
  Triton model parameters (deploy).
- `draft_kv` ("own" or "shared"): "shared" lets a self-draft (a quantized copy of the target: same layers, KV
  heads and head size) attend over the *target's* KV cache instead of its own (QSpec, arXiv:2410.11305, shares
  the cache between a quantized draft and its verifier). The draft then never prefills a prompt nor catches up
  accepted tokens: it feeds only [last, d1..] at positions the next verify overwrites, so the target's cache
  stays the target's and the output is unchanged. `build` writes "shared" when the draft checkpoint's weights
  are the target's; `from_checkpoints` shares when draft_dir is target_dir.
- `linear_kernel` ("auto", "onednn", "aten"): see kernels.py.
- `online_costs` (default true): adaptive K prices K with the step costs the engine measures while serving
  (adaptive.OnlineCosts: plain step, draft step and verify per batch size; one plain step in 16 keeps the
  baseline measured), falling back to the build's calibration until it has seen enough steps.
- `acceptance_rule`: "exact" (default, lossless) or "unsafe-always-accept", a DELIBERATE FAULT that accepts
  every draft, only for showing that `specbuild verify` catches drift. Never serve with it.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specbuild.engines.embedded.acceptor import ACCEPTANCE_RULES, EXACT
from specbuild.engines.embedded.adaptive import ADAPTIVE_K, AcceptanceTracker, cost_models, prior_alphas
from specbuild.engines.embedded.detok import IncrementalDetokenizer
from specbuild.engines.embedded.errors import EngineError, EngineLimitError
from specbuild.engines.embedded.kernels import linear_kernel_of, pack_linears_
from specbuild.engines.embedded.kvcache import KVCache
from specbuild.engines.embedded.model import Transformer
from specbuild.engines.embedded.proposers import DraftModelProposer, NgramProposer
from specbuild.engines.embedded.sampling import SamplingParams, make_generator
from specbuild.engines.embedded.scheduler import Scheduler
from specbuild.engines.embedded.scorer import TargetScorer
from specbuild.engines.embedded.sequence import RequestOutput, Sequence, StreamDelta
from specbuild.engines.embedded.stats import SpecStats
from specbuild.engines.embedded.weights import load_model, torch_dtype
from specbuild.pipeline.errors import SourceError

PROPOSERS = ("draft", "ngram")
ENGINE_CONFIG_FILE = "engine_config.json"
log = logging.getLogger(__name__)
_FROM_CONFIG = object()      # from_build_dir kwarg not given: use engine_config.json
QUEUE_PER_SLOT = 4           # default max_queue_size = QUEUE_PER_SLOT x max_batch_size
DEFAULT_QUEUE_TIMEOUT_S = 300.0  # generous: batch clients queue behind full slots; bounded: no request hangs forever


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 8
    max_seq_len: int = 1024
    max_draft_len: int = 8
    default_num_draft_tokens: int = 4
    default_proposer: str = "draft"
    has_draft: bool = False
    dtype: str = "float32"
    device: str = "cpu"
    eos_token_id: int | None = None
    adaptive_k: bool = False                 # requests without K use adaptive K
    spec_max_concurrency: int | None = None  # no drafting in steps with more running sequences; None = off
    acceptance_rule: str = EXACT             # "exact" | "unsafe-always-accept" (deliberate fault, tests only)
    max_queue_size: int | None = None        # waiting requests before refusing; None = 4 x max_batch_size
    queue_timeout_s: float | None = DEFAULT_QUEUE_TIMEOUT_S   # longest wait for a slot; None = no limit
    draft_kv: str = "own"                    # "shared": the draft attends over the target's KV cache (self-draft)
    online_costs: bool = True                # adaptive K uses step costs measured while serving (adaptive.py)

    @property
    def queue_limit(self) -> int:
        return self.max_queue_size if self.max_queue_size is not None else QUEUE_PER_SLOT * self.max_batch_size

    def __post_init__(self):
        if self.max_batch_size < 1 or self.max_seq_len < 2 or self.max_draft_len < 0:
            raise EngineLimitError(f"engine limits must be max_batch_size >= 1, max_seq_len >= 2, max_draft_len >= 0; "
                                   f"got {self.max_batch_size}, {self.max_seq_len}, {self.max_draft_len}.")
        if not 0 <= self.default_num_draft_tokens <= self.max_draft_len:
            raise EngineLimitError(f"default_num_draft_tokens={self.default_num_draft_tokens} must be in "
                                   f"[0, max_draft_len={self.max_draft_len}].")
        if self.default_proposer not in PROPOSERS:
            raise EngineLimitError(f"default_proposer {self.default_proposer!r} is unknown; use one of {PROPOSERS}.")
        if self.spec_max_concurrency is not None and (isinstance(self.spec_max_concurrency, bool)
                                                      or not isinstance(self.spec_max_concurrency, int)
                                                      or self.spec_max_concurrency < 0):
            raise EngineLimitError(f"spec_max_concurrency={self.spec_max_concurrency!r} must be an integer >= 0 "
                                   f"(0 = never draft) or null (draft at any concurrency).")
        if self.max_queue_size is not None and (isinstance(self.max_queue_size, bool)
                                                or not isinstance(self.max_queue_size, int) or self.max_queue_size < 0):
            raise EngineLimitError(f"max_queue_size={self.max_queue_size!r} must be an integer >= 0 (0 = refuse "
                                   f"whenever no slot is free) or null (4 x max_batch_size).")
        if self.queue_timeout_s is not None and not (isinstance(self.queue_timeout_s, (int, float))
                                                     and self.queue_timeout_s > 0):
            raise EngineLimitError(f"queue_timeout_s={self.queue_timeout_s!r} must be a number of seconds > 0 "
                                   f"or null (no limit).")
        if self.acceptance_rule not in ACCEPTANCE_RULES:
            raise EngineLimitError(f"acceptance_rule {self.acceptance_rule!r} is unknown; use one of "
                                   f"{ACCEPTANCE_RULES} (\"exact\" is the only lossless one).")


class Engine:
    def __init__(self, target: Transformer, tokenizer, config: EngineConfig, draft: Transformer | None = None,
                 calibration: dict | None = None):
        """`calibration`: the build's measured costs (engine_config.json `calibration`) for adaptive K."""
        self.tokenizer, self.config, self.target, self.draft = tokenizer, config, target, draft
        self.calibration = calibration
        if config.acceptance_rule != EXACT:
            log.warning("!!! acceptance_rule=%r: every drafted token is ACCEPTED WITHOUT VERIFICATION. Output is "
                        "NOT the target's; this is a deliberate fault for testing `specbuild verify`. Never serve "
                        "with it: set acceptance_rule to \"exact\" in engine_config.json. !!!", config.acceptance_rule)
        dev = torch.device(config.device)
        self.device = dev

        def cache_for(m: Transformer) -> KVCache:
            c = m.cfg
            return KVCache(num_layers=c.num_layers, num_slots=config.max_batch_size, kv_heads=c.num_kv_heads,
                           max_seq=config.max_seq_len, head_dim=c.head_dim, dtype=m.embed.weight.dtype, device=dev)

        self.scorer = TargetScorer(target, cache_for(target), dev)
        proposer = None
        if draft is not None and config.draft_kv == "shared":
            _check_kv_compatible(target, draft)
            proposer = DraftModelProposer(draft, self.scorer.cache, dev, shares_target_kv=True)
        elif draft is not None:
            proposer = DraftModelProposer(draft, cache_for(draft), dev)
        self.scheduler = Scheduler(scorer=self.scorer, draft=proposer, ngram=NgramProposer(),
                                   max_batch_size=config.max_batch_size, costs=cost_models(calibration),
                                   spec_max_concurrency=config.spec_max_concurrency,
                                   acceptance_rule=config.acceptance_rule, max_waiting=config.queue_limit,
                                   queue_timeout_s=config.queue_timeout_s, online_costs=config.online_costs)
        self.scheduler.alpha_prior = prior_alphas(calibration)
        self._ids = itertools.count()
        self._step_lock = threading.Lock()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False

    # ---- construction -----------------------------------------------------------------------------
    @classmethod
    def from_checkpoints(cls, target_dir, draft_dir=None, *, max_batch_size=8, max_seq_len=1024, max_draft_len=8,
                         dtype="float32", device="cpu", draft_quantize=None, default_num_draft_tokens=4,
                         default_proposer="draft", threads=None, tokenizer_dir=None, adaptive_k=False,
                         spec_max_concurrency=None, acceptance_rule=EXACT, calibration=None, max_queue_size=None,
                         queue_timeout_s=DEFAULT_QUEUE_TIMEOUT_S, linear_kernel="auto",
                         draft_kv=None, online_costs=True) -> "Engine":
        """Load target (and draft) checkpoint dirs. Without a draft, the default proposer is n-gram.
        The tokenizer comes from `tokenizer_dir`, default the target dir. `adaptive_k`, `spec_max_concurrency`,
        `acceptance_rule`: see the module docstring; `calibration`: a `calibrate.Calibration.to_dict()`.
        `linear_kernel`: "auto" runs fp32 CPU linears on oneDNN with weights reordered once (`kernels.py`: 2-4x
        faster at 2+ rows, batch-invariant), "aten" keeps torch's default. `draft_kv`: "own", "shared" (see the
        module docstring), None = "shared" when draft_dir is target_dir, else "own". `online_costs`: adaptive K
        judges K against step costs measured while serving (adaptive.OnlineCosts), the calibration until then."""
        from transformers import AutoTokenizer

        if threads:
            torch.set_num_threads(int(threads))
        torch_dtype(dtype)
        target = load_model(target_dir, dtype=dtype, device=device)
        pack_linears_(target, linear_kernel)
        draft = None
        if draft_dir is not None:
            draft = _load_draft(draft_dir, dtype=dtype, device=device)
            if draft.cfg.vocab_size != target.cfg.vocab_size:
                raise SourceError(f"draft vocab_size {draft.cfg.vocab_size} != target vocab_size "
                                  f"{target.cfg.vocab_size}; the draft must share the target's tokenizer.")
            if draft_quantize:
                draft = _quantize(draft, draft_quantize)
            pack_linears_(draft, linear_kernel)
        elif default_proposer == "draft":
            default_proposer = "ngram"
        if draft_kv is None:
            draft_kv = "shared" if draft_dir is not None and Path(draft_dir).resolve() == Path(target_dir).resolve() \
                else "own"
        if draft_kv not in ("own", "shared"):
            raise SourceError(f"draft_kv must be 'own' or 'shared', got {draft_kv!r}")
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir or target_dir))
        eos = tok.eos_token_id
        if eos is None:
            eos = json.loads((Path(target_dir) / "config.json").read_text()).get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) else eos
        cfg = EngineConfig(max_batch_size=max_batch_size, max_seq_len=max_seq_len, max_draft_len=max_draft_len,
                           default_num_draft_tokens=min(default_num_draft_tokens, max_draft_len),
                           default_proposer=default_proposer, has_draft=draft is not None, dtype=str(dtype),
                           device=str(device), eos_token_id=eos, adaptive_k=bool(adaptive_k),
                           spec_max_concurrency=spec_max_concurrency, acceptance_rule=acceptance_rule,
                           max_queue_size=max_queue_size, queue_timeout_s=queue_timeout_s,
                           draft_kv=draft_kv if draft is not None else "own", online_costs=bool(online_costs))
        measured = (calibration or {}).get("linear_kernel", "aten" if calibration else None)
        if measured and measured != linear_kernel_of(target):
            log.warning("the build's calibration was measured with %s linears but this engine runs %s: its costs, "
                        "default K and crossover are stale; re-measure with `specbuild build --force`.",
                        measured, linear_kernel_of(target))
        return cls(target, tok, cfg, draft, calibration=calibration)

    @classmethod
    def from_build_dir(cls, engine_dir, *, device=None, threads=None, adaptive_k=_FROM_CONFIG,
                       spec_max_concurrency=_FROM_CONFIG, acceptance_rule=_FROM_CONFIG, max_queue_size=_FROM_CONFIG,
                       queue_timeout_s=_FROM_CONFIG, linear_kernel=_FROM_CONFIG, draft_kv=_FROM_CONFIG,
                       online_costs=_FROM_CONFIG) -> "Engine":
        """Load the output of `specbuild build --backend embedded`: `engine_config.json` names the target and
        draft dirs (relative to engine_dir), the runtime limits, the speculation controls (`adaptive_k`,
        `spec_max_concurrency`, `acceptance_rule`), the admission limits (`max_queue_size`, `queue_timeout_s`)
        (a kwarg given here wins) and the calibration."""
        engine_dir = Path(engine_dir)
        path = engine_dir / ENGINE_CONFIG_FILE
        if not path.is_file():
            raise SourceError(f"{engine_dir} has no {ENGINE_CONFIG_FILE}; run `specbuild build --backend embedded` "
                              f"and pass its engine directory.")
        rc = json.loads(path.read_text())
        threads = threads or rc.get("threads")
        draft = rc.get("draft")
        # An int8 draft written by the build stage is loaded as such (not quantized again).
        quantize = None if rc.get("draft_format") == "int8-weight-only" else rc.get("draft_quantize")
        return cls.from_checkpoints(
            engine_dir / rc.get("target", "target"), engine_dir / draft if draft else None,
            max_batch_size=rc.get("max_batch_size", 8), max_seq_len=rc.get("max_seq_len", 1024),
            max_draft_len=rc.get("max_draft_len", 8), dtype=rc.get("dtype", "float32"),
            device=device or rc.get("device", "cpu"), draft_quantize=quantize,
            default_num_draft_tokens=rc.get("default_num_draft_tokens", 4),
            default_proposer=rc.get("default_proposer", "draft"), threads=threads,
            tokenizer_dir=engine_dir / rc["tokenizer"] if rc.get("tokenizer") else None,
            adaptive_k=rc.get("adaptive_k", False) if adaptive_k is _FROM_CONFIG else adaptive_k,
            spec_max_concurrency=(rc.get("spec_max_concurrency") if spec_max_concurrency is _FROM_CONFIG
                                  else spec_max_concurrency),
            acceptance_rule=rc.get("acceptance_rule", EXACT) if acceptance_rule is _FROM_CONFIG else acceptance_rule,
            calibration=rc.get("calibration"),
            max_queue_size=rc.get("max_queue_size") if max_queue_size is _FROM_CONFIG else max_queue_size,
            queue_timeout_s=(rc.get("queue_timeout_s", DEFAULT_QUEUE_TIMEOUT_S) if queue_timeout_s is _FROM_CONFIG
                             else queue_timeout_s),
            linear_kernel=rc.get("linear_kernel", "auto") if linear_kernel is _FROM_CONFIG else linear_kernel,
            draft_kv=rc.get("draft_kv", "own") if draft_kv is _FROM_CONFIG else draft_kv,
            online_costs=rc.get("online_costs", True) if online_costs is _FROM_CONFIG else online_costs)

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
        if num_draft_tokens is None:
            k = ADAPTIVE_K if cfg.adaptive_k else cfg.default_num_draft_tokens
        else:
            k = int(num_draft_tokens)
        if k != ADAPTIVE_K and not 0 <= k <= cfg.max_draft_len:
            raise EngineLimitError(f"num_draft_tokens={k} is outside [0, max_draft_len={cfg.max_draft_len}]; use a "
                                   f"smaller K (0 = speculation off, -1 = adaptive) or rebuild with a larger "
                                   f"max_draft_len.")
        prop = proposer or cfg.default_proposer
        if prop not in PROPOSERS:
            raise EngineLimitError(f"proposer {prop!r} is unknown; use one of {PROPOSERS}.")
        if prop == "draft" and k != 0 and self.draft is None:
            raise EngineLimitError("this engine has no draft model; use proposer='ngram', num_draft_tokens=0, "
                                   "or build the engine with a draft.")
        if params.stop_token_ids is not None:
            stop_ids = set(params.stop_token_ids)
            if params.ignore_eos:
                stop_ids.discard(cfg.eos_token_id)
        else:
            stop_ids = set() if params.ignore_eos or cfg.eos_token_id is None else {cfg.eos_token_id}
        rid = request_id or f"req-{next(self._ids)}"
        gen = None if params.greedy else make_generator(params.seed, self.device)
        tracker = None
        if k == ADAPTIVE_K:       # adaptive: K varies per step in [0, max_draft_len]
            k = cfg.max_draft_len
            with self.scheduler.lock:
                prior = self.scheduler.alpha_prior[prop]
            tracker = AcceptanceTracker(prior) if k > 0 else None
        seq = Sequence(rid, ids, params, k, prop, on_output, frozenset(stop_ids),
                       IncrementalDetokenizer(self.tokenizer, ids, params.stop), SpecStats(), gen,
                       adaptive=tracker)
        # An explicit K > 0 forces speculation: the spec_max_concurrency cut-off (the build's default policy)
        # applies to requests that leave K to the deployment (no K, or -1 = adaptive).
        seq.forced_k = num_draft_tokens is not None and int(num_draft_tokens) > 0
        return seq

    def submit(self, prompt, params: SamplingParams = SamplingParams(), *, num_draft_tokens=None, proposer=None,
               on_output: Callable[[StreamDelta], None], request_id: str | None = None) -> str:
        seq = self._make_sequence(prompt, params, num_draft_tokens, proposer, on_output, request_id)
        self.scheduler.add(seq, bounded=True)       # refused at once when max_queue_size already wait
        with self._wake:
            self._wake.notify()
        return seq.request_id

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

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

    def configure(self, **changes) -> None:
        """Replace EngineConfig fields at serve time (tuned defaults, admission limits from the Triton model
        config); validated like the config itself. Takes effect for the next request."""
        import dataclasses

        cfg = dataclasses.replace(self.config, **changes)
        with self.scheduler.lock:
            self.config = cfg
            self.scheduler.max_waiting = cfg.queue_limit
            self.scheduler.queue_timeout_s = cfg.queue_timeout_s

    def update_calibration(self, calibration: dict | None) -> None:
        """Replace the measured costs adaptive K uses (e.g. re-measured under the machine's current load);
        and its alpha, when it has one, becomes the starting estimate of new adaptive requests. Takes effect at
        the next step."""
        costs = cost_models(calibration)
        with self.scheduler.lock:
            self.calibration = calibration
            self.scheduler.costs = costs
            for prop, a in prior_alphas(calibration).items():
                if (calibration or {}).get("proposer") == prop and calibration.get("alpha") is not None:
                    self.scheduler.alpha_prior[prop] = a

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


def _quantize(model: Transformer, scheme: str) -> Transformer:
    try:
        from specbuild.engines.embedded import quant
    except ImportError as e:
        raise SourceError(f"draft_quantize={scheme!r} needs specbuild.engines.embedded.quant, which is not "
                          f"available ({e}); build without draft quantization.") from e
    fn = getattr(quant, "quantize_model_", None)
    if fn is None:
        raise SourceError("specbuild.engines.embedded.quant has no quantize_model_(model, scheme); "
                          "build without draft quantization.")
    try:
        out = fn(model, scheme)
    except TypeError:
        out = fn(model)
    return out if out is not None else model


def _load_draft(draft_dir, *, dtype, device) -> Transformer:
    """A draft dir is a plain checkpoint, or an int8 draft written by the build stage (quant.save_int8_model)."""
    cfg_path = Path(draft_dir) / "config.json"
    if cfg_path.is_file() and "specbuild_quantization" in json.loads(cfg_path.read_text()):
        from specbuild.engines.embedded.quant import load_int8_model

        return load_int8_model(draft_dir, dtype=dtype, device=device)
    return load_model(draft_dir, dtype=dtype, device=device)
