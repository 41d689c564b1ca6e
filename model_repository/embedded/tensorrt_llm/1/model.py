"""Triton Python-backend model `tensorrt_llm` of the embedded deployment: starts the ONE engine process
(`python -m specbuild.engines.embedded.service`) and starts it again if it dies, publishes the engine's
`specbuild_*` and `vllm:spec_decode_*` counters as Triton custom metrics, and serves requests like the
client-facing models (each model talks to the engine over its own connection; none waits on another).

The code is `specbuild.model_repository.embedded.triton_models`.
"""

import os
import site

for _d in os.environ.get("SPECBUILD_SITE_DIRS", "").split(os.pathsep):
    if _d:
        site.addsitedir(_d)  # honour .pth files (editable installs) of the serving environment

from specbuild.model_repository.embedded.triton_models import EngineModel  # noqa: E402


class TritonPythonModel(EngineModel):
    pass
