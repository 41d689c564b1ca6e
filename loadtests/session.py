"""One endpoint under load, seen by every run against it: the tokenizer, the pre-flight, the prompts and the
request fields (`Session`, opened by `open_session`), shared by `loadtest` and `tune`
(`specbuild.pipeline.loadtest` re-exports these names).

Prompts come from the profile's prompt sets (`promptsets.py`) or the user's file (`datasets.py`), cut so that
prompt + output fits the engine, and rendered with the target's chat template unless the API applies its own
(`openai-chat`). The request fields are the client contract's names; a TensorRT-LLM deployment gets its
release's (`client.adapt_request`), an OpenAI-compatible server OpenAI's (`wire.openai_fields`, per request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from specbuild.core import contract, wire
from specbuild.core.errors import UsageError

OPTIONAL_INPUTS = ("stream", "temperature", "top_k", "top_p", "seed", "return_perf_metrics",
                   "exclude_input_in_output", "min_tokens")   # dropped from requests if the model lacks them


def input_budget(profile, max_seq_len: int | None, margin: int = 8) -> int:
    """Prompt tokens allowed: the profile's max_input_tokens, capped so prompt + max_tokens fits the engine."""
    if max_seq_len is None:
        return profile.max_input_tokens
    if getattr(profile, "chat_template", False):
        margin += 64   # the template's own tokens (roles, default system prompt) come on top
    room = max_seq_len - profile.max_tokens - margin
    if room < 1:
        raise UsageError(f"profile {profile.name!r}: max_tokens {profile.max_tokens} leaves no room for a prompt "
                         f"in the engine's max_seq_len {max_seq_len}; pass a smaller --max-tokens.")
    return min(profile.max_input_tokens, room)


def _with_port(url: str, port: int, scheme: str | None = None) -> str:
    u = urlsplit(url)
    host = u.hostname or "127.0.0.1"
    return f"{scheme}://{host}:{port}" if scheme else f"{host}:{port}"


def default_metrics_url(url: str, api: str) -> str:
    """Triton: the --url host, port 8002; an OpenAI-compatible server: its own port (`<url>/metrics`)."""
    return f"{url.rstrip('/')}/metrics" if api != wire.KSERVE else _with_port(url, 8002, "http") + "/metrics"


@dataclass
class Session:
    """What every run against one endpoint shares: endpoints, tokenizer, the model's inputs, gates, prompts.
    Opened once per `loadtest` / `tune` by `open_session` (which does the pre-flight); a setting that names
    another endpoint gets a copy for it (`for_endpoint`) sharing the prompts."""

    url: str
    grpc_url: str
    metrics_url: str | None
    model: str
    protocol: str
    counter: Any                            # loadtests.tokens.TokenCounter
    info: Any                               # loadtests.target.ModelInfo
    dropped: list[str]                      # optional request fields the model does not declare
    gates: Any                              # loadtests.runspec.Gates
    max_seq_len: int | None = None
    workers: int = 0
    stop_timeout: float = 5.0
    seed: int = 0
    progress_bar: bool = False
    target: str = "embedded"                # client.deployment_target: "embedded" | "trtllm-<family>"
    api: str = wire.KSERVE
    records: list | None = None             # the prompt file's records (loadtests.datasets), None: prompt sets
    lengths: str = "profile"
    _prompts: dict[str, tuple[list[str], list[int], list[int]]] = field(default_factory=dict)

    def _build(self, profile) -> tuple[list[str], list[int], list[int]]:
        from specbuild.loadtests import promptsets

        template = profile.chat_template and self.api != wire.OPENAI_CHAT   # a chat API applies its own
        if self.records is None:
            texts = promptsets.build_prompts(profile.prompt_set, count=200, seed=self.seed, counter=self.counter,
                                             max_input_tokens=input_budget(profile, self.max_seq_len),
                                             chat=template)
            return texts, [self.counter.count(t) for t in texts], []
        texts, outs = [], []
        for r in self.records:
            out = r.output_tokens if self.lengths == "data" and r.output_tokens else profile.max_tokens
            cap = None if self.lengths == "data" else profile.max_input_tokens
            text, out = _fit(self.counter, r.text, out, cap, self.max_seq_len, template)
            texts.append(self.counter.chat(text) if template else text)
            outs.append(out)
        return texts, [self.counter.count(t) for t in texts], (outs if self.lengths == "data" else [])

    def prompts(self, profile) -> tuple[list[str], list[int]]:
        """The profile's prompts (cut to fit, chat-templated unless the API templates them) and their token
        counts; built once."""
        if profile.name not in self._prompts:
            self._prompts[profile.name] = self._build(profile)
        return self._prompts[profile.name][:2]

    def output_tokens(self, profile) -> list[int]:
        """Output tokens per prompt when the lengths come from the data; [] = the profile's max_tokens."""
        self.prompts(profile)
        return self._prompts[profile.name][2]

    def payload(self, profile, fields: dict[str, Any]) -> dict[str, Any]:
        """The request fields of a run: the profile's, then the setting's, less what the model lacks; for a
        TensorRT-LLM deployment, in its release's names (`client.adapt_request`)."""
        body = {**_payload(profile, {}, self.dropped), **fields}
        if self.target == "embedded" or self.api != wire.KSERVE:
            return body
        from specbuild.core.requests import RequestError, adapt_request

        # seed/min_tokens exist under other names on the engine path; the llmapi path's dropped list is in
        # contract names already (served_names)
        full = {**_payload(profile, {}, self.dropped if self.target == contract.LLMAPI_TARGET else []), **fields}
        try:
            adapted, echoed = adapt_request(self.target, self.model, {"text_input": "", **full})
        except RequestError as e:
            raise UsageError(f"profile {profile.name!r}, setting {fields}: {e}") from None
        if echoed:
            raise UsageError(
                f"profile {profile.name!r}, setting {fields}: on {self.target} the speculative path of "
                f"{self.model} answers stream=false with the prompt echoed in text_output (upstream's BLS), so "
                "the load test cannot time tokens or count them; measure that deployment with "
                "num_draft_tokens=0 here, and speculation with `specbuild verify` or GenAI-Perf's non-streaming "
                "mode.")
        adapted.pop("text_input")
        return adapted

    def for_endpoint(self, url: str | None, grpc_url: str | None, metrics_url: str | None) -> "Session":
        """This session at another endpoint (a setting's `url=`): pre-flighted there, the same prompts."""
        import dataclasses

        from specbuild.loadtests import target

        if url is None and grpc_url is None and metrics_url is None:
            return self
        url = (url or self.url).rstrip("/")
        if not urlsplit(url).hostname:
            raise UsageError(f"a setting's url={url!r} is not a URL; e.g. url=http://127.0.0.1:8081.")
        if url == self.url and grpc_url is None and metrics_url is None:
            return self
        info = (target.preflight_openai(url, self.model) if self.api != wire.KSERVE
                else target.preflight(url, self.model))
        metrics = metrics_url if metrics_url is not None else (
            self.metrics_url if url == self.url else default_metrics_url(url, self.api))
        return dataclasses.replace(self, url=url, grpc_url=grpc_url or (self.grpc_url if url == self.url
                                                                          else _with_port(url, 8001)),
                                   metrics_url=metrics or None, info=info, _prompts=self._prompts)


def _fit(counter, text: str, out: int, cap: int | None, max_seq_len: int | None,
         template: bool) -> tuple[str, int]:
    """A record's prompt cut to `cap` tokens and so that prompt + output fits the engine; the output shortened
    (to half the engine) only when even a short prompt would not fit."""
    if cap:
        text = counter.truncate(text, cap)
    if max_seq_len is None:
        return text, out
    margin = 8 + (64 if template else 0)
    out = min(out, max(1, max_seq_len // 2)) if max_seq_len - out - margin < 16 else out
    return counter.truncate(text, max(1, max_seq_len - out - margin)), out


def open_session(*, url: str, model: str | None, tokenizer_dir: Path, deployed: str = "embedded",
                 max_seq_len: int | None = None, inputs: list[str] = (),
                 protocol: str = "http", grpc_url: str | None = None, metrics_url: str | None = None,
                 gates=None, workers: int = 0, stop_timeout: float = 5.0, seed: int = 0,
                 progress_bar: bool = False, api: str = wire.KSERVE, records: list | None = None,
                 lengths: str = "profile", admin_headers: dict[str, str] | None = None) -> Session:
    """Check the server is up, `model` exists and declares `inputs` (KServe), or that an OpenAI-compatible server
    serves `model` (default: its first). What is deployed (`deployed`: `pipeline.deployment`'s target, the
    tokenizer, the engine's `max_seq_len`) is handed in: the load side only measures."""
    from specbuild.loadtests import target
    from specbuild.loadtests.runspec import Gates
    from specbuild.loadtests.tokens import TokenCounter

    counter = TokenCounter(Path(tokenizer_dir))
    grpc_url = grpc_url or _with_port(url, 8001)
    if api == wire.KSERVE and deployed == contract.LLMAPI_TARGET:
        model = contract.LLMAPI_MODEL          # the llmapi path has one client model
    metrics_url = default_metrics_url(url, api) if metrics_url is None else metrics_url
    if api != wire.KSERVE:
        info = target.preflight_openai(url, model)
        dropped: list[str] = []
    else:
        info = target.preflight(url, model, headers=admin_headers)
        target.check_inputs(info, served_names(deployed, ["text_input", "max_tokens", *inputs]))
        if protocol == "grpc":
            target.check_grpc(grpc_url, model)
        dropped = sorted(n for n in OPTIONAL_INPUTS if served_names(deployed, [n])[0] not in info.inputs)
    return Session(url=url, grpc_url=grpc_url, metrics_url=metrics_url, model=info.name, protocol=protocol,
                   counter=counter, info=info, dropped=dropped,
                   gates=gates or Gates(), workers=workers,
                   max_seq_len=max_seq_len if api == wire.KSERVE else None,
                   stop_timeout=stop_timeout, seed=seed, progress_bar=progress_bar,
                   target=deployed, api=api, records=records, lengths=lengths)


def served_names(deployed: str, names: list[str]) -> list[str]:
    """Contract input names as the deployment declares them (the llmapi model's sampling_param_*; the engine
    path's renames are checked per request by `client.adapt_request`)."""
    if deployed != contract.LLMAPI_TARGET:
        return list(names)
    return [contract.LLMAPI_NAMES.get(n, n) for n in names]


def smoke(session: Session, profile, fields: dict[str, Any]) -> None:
    """One short real request with the run's exact fields: a refused value fails before any load."""
    from specbuild.loadtests import target

    target.smoke_request(session.url, session.model, session.payload(profile, fields), profile.stream,
                         api=session.api)



def _payload(profile, extra: dict[str, Any], dropped: list[str]) -> dict[str, Any]:
    payload = {"max_tokens": profile.max_tokens, "stream": profile.stream, "temperature": profile.temperature,
               "return_perf_metrics": profile.return_perf_metrics,
               "exclude_input_in_output": profile.exclude_input_in_output}
    for key in ("top_k", "top_p", "seed"):
        if getattr(profile, key) is not None:
            payload[key] = getattr(profile, key)
    if profile.fixed_output:
        payload["min_tokens"] = profile.max_tokens
    payload.update(extra)
    return {k: v for k, v in payload.items() if k not in dropped}
