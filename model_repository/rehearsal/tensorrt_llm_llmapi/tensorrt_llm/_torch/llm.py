from specbuild.engines.trtllm.llmapi_standin import LLM  # noqa: F401  (0.20-era import path)
