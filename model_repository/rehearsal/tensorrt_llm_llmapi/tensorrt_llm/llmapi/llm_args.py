from specbuild.engines.trtllm.llmapi_standin import (DecodingBaseConfig, DraftTargetDecodingConfig,  # noqa: F401
                                                     KvCacheConfig)
