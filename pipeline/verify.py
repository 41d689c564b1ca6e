"""`specbuild verify`: prove a running deployment is lossless.

Two checks against any deployment that speaks the client contract (embedded or TensorRT-LLM), or against an
OpenAI-compatible server (`trtllm-serve`, vLLM, SGLang, llama.cpp's `llama-server`) beside a reference server:

* **greedy identity** — for every prompt, the output with speculation (K drafts) and without (K = 0, or the
  reference server: the same target without speculation) must be identical. On a difference we report where:
  the first diverging token and character, the common text before it and both continuations.
* **sampling distribution** — speculative sampling is lossless in distribution, not per sample. For
  one prompt we draw `seeds` samples with speculation and `seeds` without, and for each of the first
  `positions` output positions run a two-sample chi-square homogeneity test on the token counts
  (rare tokens pooled so every expected count is >= 5). Drift is declared when any position's
  p-value is below `alpha / positions` (Bonferroni): the family-wise false-alarm rate is <= `alpha`.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from specbuild.core import contract, wire
from specbuild.core.errors import SpecbuildError, UsageError

log = logging.getLogger(__name__)

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarize in one sentence: The meeting covered the budget, hiring plans and the roadmap for next year.",
    "List three colors of the rainbow.",
)


# An OpenAI-compatible server has no per-request K: verify needs the same target served without speculation.
OPENAI_NEEDS_REFERENCE = (
    "--api {api}: an OpenAI-compatible server has no per-request num_draft_tokens (its speculation is fixed when "
    "it starts), so verify cannot ask it for K = 0. Serve the same target a second time without speculation "
    "(llama-server without -md, trtllm-serve without speculative_config, vllm serve without --speculative-config) "
    "and pass its base URL as --reference-url.")
GREEDY_SEED = 0          # the seed of every greedy request to an OpenAI server (both sides the same)
CONTEXT_CHARS = 60       # characters of common text and of each continuation shown around a divergence


class GenerateFn(Protocol):
    """One completion's text. `num_draft_tokens` is K on the speculative side, 0 on the side without
    speculation, or None: the speculative side as deployed (its K fixed by the server), against a reference."""

    def __call__(self, prompt: str, *, num_draft_tokens: int | None, max_tokens: int, temperature: float,
                 top_k: int, top_p: float, seed: int | None) -> str: ...


@dataclass
class GreedyCase:
    prompt: str
    identical: bool
    tokens_spec: int
    tokens_plain: int
    first_divergence: int | None = None     # token index in the output where the two differ (re-tokenized)
    context: str | None = None              # the common prefix's tail and both continuations, in one line
    first_divergence_char: int | None = None   # character index in the output text where the two differ
    common_tail: str | None = None          # the last CONTEXT_CHARS characters both outputs share
    spec_continuation: str | None = None    # what the speculative side wrote from there
    plain_continuation: str | None = None   # what the side without speculation wrote from there


@dataclass
class PositionTest:
    position: int
    statistic: float
    dof: int
    p_value: float
    categories: int


@dataclass
class SamplingResult:
    prompt: str
    seeds: int
    temperature: float
    alpha: float
    threshold: float
    positions: list[PositionTest] = field(default_factory=list)

    @property
    def drift(self) -> bool:
        return any(t.p_value < self.threshold for t in self.positions)


@dataclass
class VerifyReport:
    num_draft_tokens: int | None            # None: the speculative server as deployed, against a reference
    greedy: list[GreedyCase]
    sampling: SamplingResult | None
    api: str = wire.KSERVE
    url: str | None = None                  # the speculative side
    reference_url: str | None = None        # the side without speculation (None: K = 0 on `url`)

    @property
    def ok(self) -> bool:
        return all(c.identical for c in self.greedy) and not (self.sampling and self.sampling.drift)

    @property
    def sides(self) -> str:
        """How the two sides are named in the printout: "K=4 vs 0", or "spec vs reference"."""
        return f"K={self.num_draft_tokens} vs 0" if self.num_draft_tokens is not None else "spec vs reference"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        if self.sampling:
            d["sampling"]["drift"] = self.sampling.drift
        return d


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where the token sequences differ (a length difference counts)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def chi2_sf(x: float, dof: int) -> float:
    """Survival function of the chi-square distribution (regularized upper incomplete gamma)."""
    import torch

    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(x / 2.0, dtype=torch.float64)))


def homogeneity_test(a: Counter, b: Counter, min_expected: float = 5.0) -> tuple[float, int, float, int]:
    """Two-sample chi-square test that counts `a` and `b` come from one distribution.

    Categories whose expected count (in the smaller sample) is below `min_expected` are pooled into one
    "other" bin, which keeps the chi-square approximation valid. Returns (statistic, dof, p, categories).
    """
    na, nb = sum(a.values()), sum(b.values())
    if na == 0 or nb == 0:
        return 0.0, 0, 1.0, 0
    total = a + b
    n = na + nb
    small = min(na, nb)
    keep = [k for k, c in total.items() if c * small / n >= min_expected]
    rows = [(a[k], b[k]) for k in keep]
    other = (na - sum(r[0] for r in rows), nb - sum(r[1] for r in rows))
    if other[0] + other[1] > 0:
        rows.append(other)
    if len(rows) < 2:
        return 0.0, 0, 1.0, len(rows)
    stat = 0.0
    for ca, cb in rows:
        tot = ca + cb
        ea, eb = tot * na / n, tot * nb / n
        stat += (ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb
    dof = len(rows) - 1
    return stat, dof, chi2_sf(stat, dof), len(rows)


Progress = Callable[[str, int, int], None]   # (phase, requests done, requests in the phase)


def _map(fn: Callable, items: list, concurrency: int, progress: Progress | None = None, phase: str = "") -> list:
    """fn over items (order kept), `concurrency` at a time; `progress(phase, done, total)` after each one."""
    total, done = len(items), 0
    if progress:
        progress(phase, 0, total)
    if concurrency <= 1:
        out = []
        for x in items:
            out.append(fn(x))
            done += 1
            if progress:
                progress(phase, done, total)
        return out
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(fn, x) for x in items]
        for _ in as_completed(futures):
            done += 1
            if progress:
                progress(phase, done, total)
        return [f.result() for f in futures]


def verify_greedy(generate: GenerateFn, tokenize: Callable[[str], list[int]], prompts: Sequence[str], *,
                  num_draft_tokens: int, max_tokens: int, concurrency: int = 4,
                  progress: Progress | None = None) -> list[GreedyCase]:
    def run(args):
        prompt, k = args
        return generate(prompt, num_draft_tokens=k, max_tokens=max_tokens, temperature=0.0, top_k=0,
                        top_p=1.0, seed=None)

    jobs = [(p, k) for p in prompts for k in (num_draft_tokens, 0)]
    outs = _map(run, jobs, concurrency, progress, "greedy")
    spec_name = f"with K={num_draft_tokens}" if num_draft_tokens is not None else "speculative"
    plain_name = "without" if num_draft_tokens is not None else "reference"
    return [compare_texts(prompt, outs[2 * i], outs[2 * i + 1], tokenize, spec_name=spec_name, plain_name=plain_name)
            for i, prompt in enumerate(prompts)]


def compare_texts(prompt: str, spec: str, plain: str, tokenize: Callable[[str], list[int]], *,
                  spec_name: str = "with K", plain_name: str = "without") -> GreedyCase:
    """One greedy comparison: identical, or where the texts part — the first differing token of the
    re-tokenized outputs, the first differing character, the common text before it and both continuations
    (CONTEXT_CHARS each)."""
    ts, tp = tokenize(spec), tokenize(plain)
    case = GreedyCase(prompt=prompt, identical=spec == plain, tokens_spec=len(ts), tokens_plain=len(tp))
    if case.identical:
        return case
    pos = first_divergence(ts, tp)
    case.first_divergence = 0 if pos is None else pos   # texts differ but re-tokenize equal: cannot happen
    common = _decode_prefix(spec, plain)
    case.first_divergence_char = len(common)
    case.common_tail = common[-CONTEXT_CHARS:]
    case.spec_continuation = spec[len(common):][:CONTEXT_CHARS]
    case.plain_continuation = plain[len(common):][:CONTEXT_CHARS]
    case.context = (f"...{case.common_tail!r} | {spec_name}: {case.spec_continuation!r} | "
                    f"{plain_name}: {case.plain_continuation!r}")
    return case


def _decode_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return a[:n]


def verify_sampling(generate: GenerateFn, tokenize: Callable[[str], list[int]], prompt: str, *,
                    num_draft_tokens: int, seeds: int, positions: int, temperature: float, top_k: int = 0,
                    top_p: float = 1.0, alpha: float = 1e-3, concurrency: int = 8,
                    progress: Progress | None = None) -> SamplingResult:
    if seeds < 50:
        raise UsageError(f"--seeds {seeds} is too few for a distribution test; use at least 50 (200+ recommended).")
    if temperature <= 0:
        raise UsageError("the sampling check needs --temperature > 0 (temperature 0 is greedy, checked separately).")

    def run(args):
        k, seed = args
        text = generate(prompt, num_draft_tokens=k, max_tokens=positions, temperature=temperature, top_k=top_k,
                        top_p=top_p, seed=seed)
        return tokenize(text)[:positions]

    jobs = [(k, s) for s in range(1, seeds + 1) for k in (num_draft_tokens, 0)]
    outs = _map(run, jobs, concurrency, progress, "sampling")
    spec, plain = outs[0::2], outs[1::2]
    result = SamplingResult(prompt=prompt, seeds=seeds, temperature=temperature, alpha=alpha,
                            threshold=alpha / positions)
    for pos in range(positions):
        a = Counter(t[pos] for t in spec if len(t) > pos)
        b = Counter(t[pos] for t in plain if len(t) > pos)
        stat, dof, p, cats = homogeneity_test(a, b)
        result.positions.append(PositionTest(position=pos, statistic=round(stat, 3), dof=dof, p_value=p,
                                             categories=cats))
    return result


def verify(generate: GenerateFn, tokenize: Callable[[str], list[int]], *, prompts: Sequence[str] = DEFAULT_PROMPTS,
           num_draft_tokens: int | None = 4, max_tokens: int = 32, sampling_seeds: int = 0, positions: int = 4,
           temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, alpha: float = 1e-3,
           concurrency: int = 8, out: Path | None = None, progress: Progress | None = None,
           api: str = wire.KSERVE, url: str | None = None, reference_url: str | None = None) -> VerifyReport:
    """Run the greedy identity check and (when `sampling_seeds` > 0) the distribution test.
    `num_draft_tokens` None: the speculative side as deployed, against a reference server (`generate` routes).
    `progress(phase, done, total)` is called as requests finish ("greedy", then "sampling"); `api`, `url`,
    `reference_url` are recorded in the report."""
    if num_draft_tokens is not None and num_draft_tokens <= 0:
        raise UsageError("--num-draft-tokens must be > 0: verify compares speculation (K > 0) against K = 0.")
    if not prompts:
        raise UsageError("no prompts to verify; pass --prompt or --prompts FILE.")
    if sampling_seeds and sampling_seeds < 50:
        raise UsageError(f"--seeds {sampling_seeds} is too few for a distribution test; use at least 50 "
                         "(200+ recommended), or 0 for the greedy check only.")
    greedy = verify_greedy(generate, tokenize, prompts, num_draft_tokens=num_draft_tokens, max_tokens=max_tokens,
                           concurrency=concurrency, progress=progress)
    sampling = None
    if sampling_seeds:
        sampling = verify_sampling(generate, tokenize, prompts[0], num_draft_tokens=num_draft_tokens,
                                   seeds=sampling_seeds, positions=positions, temperature=temperature, top_k=top_k,
                                   top_p=top_p, alpha=alpha, concurrency=concurrency, progress=progress)
    report = VerifyReport(num_draft_tokens=num_draft_tokens, greedy=greedy, sampling=sampling, api=api, url=url,
                          reference_url=reference_url)
    if out:
        from specbuild.core.manifest import atomic_write_text
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(out), json.dumps(report.to_dict(), indent=2) + "\n")
    return report


# --- the two sides: KServe (one deployment, K per request, or a reference) or OpenAI (always a reference) ---------

def kserve_generate_fn(workdir: Path, endpoint: str, reference_url: str | None, model: str, tokenizer_dir,
                       template: Callable[[str], str]) -> GenerateFn:
    """generate(...) over Triton's KServe API: K > 0 on `endpoint`, K = 0 there too, or on `reference_url` (then
    num_draft_tokens is never sent: both servers run their deployed policy; the reference is taken to be the
    same kind of deployment, with the same client model)."""
    from specbuild.pipeline.client import Client, client_for

    client = client_for(workdir, endpoint, model=model, tokenizer_dir=tokenizer_dir)
    if reference_url is None and client.target == contract.LLMAPI_TARGET:
        raise UsageError("this deployment is TensorRT-LLM's llmapi path: its speculation is fixed by model.yaml's "
                         "speculative_config, so K = 0 cannot be asked per request. Serve the target a second time "
                         "without speculative_config and pass it as --reference-url.")
    reference = None if reference_url is None else \
        Client(url=reference_url, model=client.model, target=client.target, echo=client.echo)

    def generate(prompt, *, num_draft_tokens, max_tokens, temperature, top_k, top_p, seed):
        params = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k or None,
                      top_p=top_p if top_p < 1 else None, seed=seed)
        if reference is None:
            return client.generate(template(prompt), num_draft_tokens=num_draft_tokens, **params).text
        return (reference if num_draft_tokens == 0 else client).generate(template(prompt), **params).text

    return generate


def openai_fields(*, max_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None) -> dict[str, Any]:
    """The contract fields of one OpenAI request of verify (`OpenAIClient` leaves out the None ones). Greedy
    (temperature 0) is asked every way a server takes it: temperature 0, top_k 1 (vLLM, SGLang, trtllm-serve and
    llama-server take top_k; trtllm-serve's default temperature is 1.0, so it is always sent) and a seed, the same
    on both sides. Sampling sends its temperature and seed, and top_k / top_p only when they cut (else the
    server's default applies, the same on both sides)."""
    if temperature <= 0:
        return dict(max_tokens=max_tokens, temperature=0.0, top_k=1, seed=GREEDY_SEED if seed is None else seed)
    return dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k or None,
                top_p=top_p if top_p < 1 else None, seed=seed)


def openai_generate_fn(api: str, url: str, reference_url: str | None, model: str | None,
                       template: Callable[[str], str], timeout: float = 300.0) -> GenerateFn:
    """generate(...) over an OpenAI-compatible API (`api`: openai-completions or openai-chat): the speculative
    side on `url`, the side without speculation on `reference_url` (required: there is no per-request K).
    `model` is the request's model on both (default: each server's first of /v1/models); `template` renders a
    prompt for /v1/completions (openai-chat sends it as a user message: the server applies its template)."""
    from specbuild.pipeline.client import OpenAIClient

    if not wire.is_openai(api):
        raise ValueError(f"not an OpenAI API: {api!r}")
    if not reference_url:
        raise UsageError(OPENAI_NEEDS_REFERENCE.format(api=api))
    spec = OpenAIClient.connect(url, api, model, timeout)
    reference = OpenAIClient.connect(reference_url, api, model, timeout)
    render = (lambda p: p) if api == wire.OPENAI_CHAT else template

    def generate(prompt, *, num_draft_tokens, max_tokens, temperature, top_k, top_p, seed):
        fields = openai_fields(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        return (reference if num_draft_tokens == 0 else spec).generate(render(prompt), **fields).text

    return generate


def load_prompts(path: Path) -> list[str]:
    """A prompts file: JSON list of strings, or JSONL with {"prompt": ...}, or one prompt per line."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"prompts file {path} does not exist.")
    text = path.read_text()
    try:
        data = json.loads(text)
        if isinstance(data, list) and all(isinstance(x, str) for x in data):
            return data
    except ValueError:
        pass
    prompts = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            try:
                prompts.append(json.loads(line)["prompt"])
                continue
            except (ValueError, KeyError) as e:
                raise SpecbuildError(f"{path}: a JSONL line lacks a 'prompt' field ({e}).") from e
        prompts.append(line)
    return prompts
