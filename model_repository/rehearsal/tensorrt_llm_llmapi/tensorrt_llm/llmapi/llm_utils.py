from specbuild.engines.trtllm.llmapi_standin import update_llm_args_with_extra_dict  # noqa: F401
