"""Rehearsal stand-in for `tensorrt_llm` (the LLM-API surface upstream's Triton llmapi model.py imports), backed by
specbuild's embedded engine: specbuild.engines.trtllm.llmapi_standin. `specbuild serve --rehearse` puts this
package next to upstream's model.py in the rehearsal's copy of the repository; it is never installed."""
import os
import site

for _d in os.environ.get("SPECBUILD_SITE_DIRS", "").split(os.pathsep):
    if _d:
        site.addsitedir(_d)  # honour .pth files (editable installs) of the serving environment

from specbuild.engines.trtllm.llmapi_standin import LLM, SamplingParams, version as _version  # noqa: E402,F401

__version__ = _version()
