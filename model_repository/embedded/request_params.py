"""Triton-side encoding of the client contract's perf-metric outputs (no Triton imports).

Request parsing and every validation rule live in `specbuild.engines.embedded.frontend`; this module only
turns a SpecStats into the `acceptance_rate`, `total_accepted_draft_tokens` and `total_draft_tokens` arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def perf_metrics(stats: Any) -> dict[str, np.ndarray]:
    """The contract's perf-metric outputs from a SpecStats (zeros when speculation was off)."""
    drafted = int(getattr(stats, "num_draft_tokens", 0) or 0) if stats is not None else 0
    accepted = int(getattr(stats, "num_accepted_tokens", 0) or 0) if stats is not None else 0
    rate = accepted / drafted if drafted else 0.0
    return {"acceptance_rate": np.array([[rate]], dtype=np.float32),
            "total_accepted_draft_tokens": np.array([[accepted]], dtype=np.int32),
            "total_draft_tokens": np.array([[drafted]], dtype=np.int32)}
