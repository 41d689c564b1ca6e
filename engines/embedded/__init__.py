"""The embedded speculative-decoding engine (pure PyTorch; CPU or CUDA).

Public API: `Engine`, `EngineConfig`, `SamplingParams`, `StreamDelta`, `RequestOutput`, `SpecStats`,
`EngineLimitError`. Roles: model.py (decoder), weights.py (loader), kvcache.py, sampling.py,
proposers.py (draft model, n-gram), scorer.py (target verify), acceptor.py (greedy / rejection sampling),
stats.py, detok.py, scheduler.py (continuous batching), engine.py (API).
"""

from specbuild.engines.embedded.acceptor import PLACEHOLDER, Accepted, greedy_accept, rejection_accept
from specbuild.engines.embedded.engine import ENGINE_CONFIG_FILE, Engine, EngineConfig
from specbuild.engines.embedded.errors import EngineError, EngineLimitError
from specbuild.engines.embedded.sampling import SamplingParams
from specbuild.engines.embedded.sequence import RequestOutput, StreamDelta
from specbuild.engines.embedded.stats import SpecStats

__all__ = ["Engine", "EngineConfig", "SamplingParams", "StreamDelta", "RequestOutput", "SpecStats",
           "EngineLimitError", "EngineError", "ENGINE_CONFIG_FILE", "PLACEHOLDER", "Accepted", "greedy_accept",
           "rejection_accept"]
