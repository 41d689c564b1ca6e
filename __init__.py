"""specbuild: target + draft LLM -> speculative-decoding deployment on Triton, proven lossless, load-tested.

The library API lives here (`specbuild.pipeline.convert`, `specbuild.pipeline.build`, ...); the Click CLI in
`specbuild.cli` is a thin layer over it.
"""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# torch's OpenMP (libgomp) reads its wait policy once, when torch is imported. Its default keeps a worker spinning
# for milliseconds after every parallel ATen op (a sampling argmax, an index_select), on a core the fused step's
# own kernel workers need: a decode step ran 1.2-1.5x slower beside it (bench/README.md "2026-12-04 evening").
# Passive: ATen's workers sleep at once after an op. Set only when torch is not loaded yet and the user has not
# chosen; `Engine` warns once where torch came first with the default (OMP_THREADS_SPIN says so).
OMP_THREADS_SPIN = "torch" in _sys.modules and "OMP_WAIT_POLICY" not in _os.environ and \
    "GOMP_SPINCOUNT" not in _os.environ
_OMP_SET_HERE = "torch" not in _sys.modules and "OMP_WAIT_POLICY" not in _os.environ
if _OMP_SET_HERE:
    _os.environ["OMP_WAIT_POLICY"] = "passive"

