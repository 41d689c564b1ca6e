"""specbuild: target + draft LLM -> speculative-decoding deployment on Triton, proven lossless, load-tested.

The library API lives here (`specbuild.pipeline.convert`, `specbuild.pipeline.build`, ...); the Click CLI in
`specbuild.cli` is a thin layer over it.
"""

__version__ = "0.1.0"
