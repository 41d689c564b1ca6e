"""Engines: `embedded` (the speculative engine, any machine) and `trtllm` (TensorRT-LLM driver, NVIDIA GPUs)."""
