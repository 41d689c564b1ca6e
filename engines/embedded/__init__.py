"""The embedded speculative-decoding engine (pure PyTorch; CPU or CUDA).

Public API: `Engine`, `EngineConfig`, `Policy`, `SamplingParams`, `StreamDelta`, `RequestOutput`, `SpecStats`,
`EngineLimitError`. Roles: config.py (engine_config.json, the policy; no torch), model.py (decoder), weights.py
(loader), kvcache.py, sampling.py, proposers.py (draft model, n-gram), scorer.py (target verify), acceptor.py
(greedy / rejection sampling), adaptive.py (the cost model, adaptive K), admission.py, kplan.py, delivery.py,
scheduler.py (continuous batching: the speculative round), engine.py (API), frontend.py (serving lifecycle).

The names are imported lazily, so `specbuild.engines.embedded.config` (and the stages that only read a config)
do not load torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "engine", "EngineConfig": "config", "Policy": "config", "ENGINE_CONFIG_FILE": "config",
    "ADAPTIVE": "config", "ADAPTIVE_K": "config", "ConfigError": "config",
    "EngineLimitError": "errors", "EngineError": "errors", "EngineUnavailableError": "errors",
    "SamplingParams": "sampling", "StreamDelta": "sequence", "RequestOutput": "sequence", "SpecStats": "stats",
    "PLACEHOLDER": "acceptor", "Accepted": "acceptor", "greedy_accept": "acceptor", "rejection_accept": "acceptor",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
