from specbuild.engines.trtllm.llmapi_standin import global_mpi_rank, global_mpi_size  # noqa: F401
