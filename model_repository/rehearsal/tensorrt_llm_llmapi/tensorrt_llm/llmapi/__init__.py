from specbuild.engines.trtllm.llmapi_standin import (LLM, DraftTargetDecodingConfig, KvCacheConfig,  # noqa: F401
                                                     MpiCommSession, SamplingParams)
