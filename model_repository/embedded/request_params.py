"""Triton-side encoding of the client contract's perf-metric outputs (no Triton imports).

Request parsing and every validation rule live in `specbuild.engines.embedded.frontend`; this module only
turns a request's draft counts into the `acceptance_rate`, `total_accepted_draft_tokens` and
`total_draft_tokens` arrays (the engine process sends them as [drafted, accepted]).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def perf_arrays(drafted: int, accepted: int) -> dict[str, np.ndarray]:
    """The contract's perf-metric outputs from a request's drafted and accepted token counts."""
    drafted, accepted = int(drafted or 0), int(accepted or 0)
    rate = accepted / drafted if drafted else 0.0
    return {"acceptance_rate": np.array([[rate]], dtype=np.float32),
            "total_accepted_draft_tokens": np.array([[accepted]], dtype=np.int32),
            "total_draft_tokens": np.array([[drafted]], dtype=np.int32)}


def perf_metrics(stats: Any) -> dict[str, np.ndarray]:
    """The same from a SpecStats (zeros when speculation was off)."""
    if stats is None:
        return perf_arrays(0, 0)
    return perf_arrays(getattr(stats, "num_draft_tokens", 0), getattr(stats, "num_accepted_tokens", 0))
