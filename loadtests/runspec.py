"""What one Locust process needs to know: the run spec, written by the runner as JSON and named by the
`SPECBUILD_LOADTEST_SPEC` environment variable or `--specbuild-spec` (the locustfile's `init` listener
reads it).

Kept free of torch/transformers so Locust processes start fast and the gevent loop stays light.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ENV_VAR = "SPECBUILD_LOADTEST_SPEC"
GATE_EXIT_CODE = 3   # Locust's process_exit_code when an SLO gate fails
SERVER_GONE_EXIT_CODE = 4   # ... when the run stopped because the server stopped answering
STOP_FILE = "stop.json"     # written into the run directory by the Locust process that ended the run


@dataclass(frozen=True)
class Gates:
    """SLO gates; None = not checked. Latencies in milliseconds, error rate as a fraction (0.01 = 1%)."""

    max_p95_ttft_ms: float | None = None
    max_p95_tpot_ms: float | None = None
    max_p95_e2e_ms: float | None = None
    max_error_rate: float | None = None

    @property
    def active(self) -> bool:
        return any(v is not None for v in asdict(self).values())

    def violations(self, *, p95_ttft_ms, p95_tpot_ms, p95_e2e_ms, error_rate) -> list[str]:
        """Human-readable gate failures (empty = all gates pass). A metric that was not measured
        (None, e.g. TTFT of a non-streaming run) cannot pass a gate set on it."""
        out = []
        for gate, value, label in ((self.max_p95_ttft_ms, p95_ttft_ms, "p95 TTFT"),
                                   (self.max_p95_tpot_ms, p95_tpot_ms, "p95 TPOT"),
                                   (self.max_p95_e2e_ms, p95_e2e_ms, "p95 e2e")):
            if gate is None:
                continue
            if value is None:
                out.append(f"{label} was not measured (gate {gate:g} ms)")
            elif value > gate:
                out.append(f"{label} {value:.1f} ms > {gate:g} ms")
        if self.max_error_rate is not None and (error_rate or 0.0) > self.max_error_rate:
            out.append(f"error rate {error_rate:.2%} > {self.max_error_rate:.2%}")
        return out


@dataclass(frozen=True)
class RunSpec:
    label: str                       # Locust request name, e.g. "chat"
    protocol: str                    # "http" | "grpc"
    url: str                         # HTTP base URL, e.g. http://127.0.0.1:8000
    grpc_url: str                    # host:port of Triton's gRPC endpoint
    model: str
    stream: bool
    payload: dict[str, Any]          # request fields except text_input (max_tokens, temperature, extras...)
    prompts: list[str]
    tokenizer: str                   # tokenizer.json of the target model, to count output tokens
    samples_dir: str                 # each Locust process appends per-request records here
    wait_time: tuple[float, float] = (0.0, 0.0)
    request_timeout_s: float = 600.0
    seed: int = 0
    grpc_batch_dim: bool = True      # the model has max_batch_size > 0: gRPC tensors get a batch dimension
    gates: Gates = field(default_factory=Gates)
    # When the run ends: once BOTH min_duration_s have passed and min_requests requests completed, or at
    # max_duration_s (the hard ceiling; then the setting is "too slow to measure here"), or after
    # max_connection_errors consecutive connection errors (the server is gone).
    min_duration_s: float = 60.0
    min_requests: int = 1
    max_duration_s: float = 240.0
    max_connection_errors: int = 5
    run_dir: str = ""                # where the ending Locust process writes STOP_FILE (default: samples_dir/..)
    prompt_tokens: list[int] = field(default_factory=list)   # tokens of each prompt (input_sequence_length)
    api: str = "kserve"              # wire.APIS: "kserve" | "openai-completions" | "openai-chat"
    datatypes: dict[str, str] = field(default_factory=dict)   # gRPC datatype of each payload field (wire)
    # Output tokens asked per prompt (from the data: a prompt file's output_length, ShareGPT's reply), or
    # empty: the payload's max_tokens for every prompt.
    prompt_output_tokens: list[int] = field(default_factory=list)
    # Open loop: requests arrive as a Poisson process of this many per second in all (None = closed loop,
    # one request in flight per user). Each of `open_loop_users` Locust users sends its share.
    request_rate: float | None = None
    open_loop_users: int = 1

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(asdict(self)))
        return path

    @classmethod
    def read(cls, path: str | os.PathLike) -> "RunSpec":
        data = json.loads(Path(path).read_text())
        data["gates"] = Gates(**data.get("gates", {}))
        data["wait_time"] = tuple(data["wait_time"])
        return cls(**data)
