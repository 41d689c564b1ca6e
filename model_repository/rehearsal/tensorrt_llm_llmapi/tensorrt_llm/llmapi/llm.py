from specbuild.engines.trtllm.llmapi_standin import LLM, RequestOutput  # noqa: F401
