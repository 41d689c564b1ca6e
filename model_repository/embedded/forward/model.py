"""Triton Python-backend model of the embedded deployment's client-facing models (`ensemble`,
`tensorrt_llm_bls`): forwards each request to the engine process over this model's own connection and sends
the engine's replies to its own clients; a cancelled request is cancelled in the engine.

Why not a Triton ensemble: in Triton 2.51 a client's cancellation (gRPC cancel, HTTP disconnect) does not
reach the composing models of an ensemble, so a gone client would keep its engine slot until max_tokens.
Why not a BLS call into `tensorrt_llm`: a response sent from one stub to another waits on the receiving stub,
so one dead or stalled stub hung every model. The code is `specbuild.model_repository.embedded.triton_models`.
"""

import os
import site

for _d in os.environ.get("SPECBUILD_SITE_DIRS", "").split(os.pathsep):
    if _d:
        site.addsitedir(_d)  # honour .pth files (editable installs) of the serving environment

from specbuild.model_repository.embedded.triton_models import ForwardingModel  # noqa: E402


class TritonPythonModel(ForwardingModel):
    pass
