"""TensorRT-LLM backend: convert, build and deploy a draft-target speculative deployment for NVIDIA GPUs.

TensorRT-LLM is not installable on CPU-only machines, so every stage has a `plan(ctx)` (what `--dry-run`
prints: exact argv and file contents) and a `run(ctx)` gated on `import tensorrt_llm`.

Modules: `versions` (generation + container per version), `settings` (options -> frozen Settings),
`runner` (subprocess runner), `checks` (pre-flight refusals), `convert`/`convert_rank`, `build`,
`repository` (Triton repository rendering), `deploy`, `launch` (server argv).
"""

from specbuild.engines.trtllm.versions import (DEFAULT_VERSION, ENGINE, ENGINE_CONTAINERS, LLMAPI,  # noqa: F401
                                               supported_matrix)

# Hugging Face architecture -> TensorRT-LLM model class (tensorrt_llm.models.<class>).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "LLaMAForCausalLM",
    "MistralForCausalLM": "LLaMAForCausalLM",
    "Qwen2ForCausalLM": "QWenForCausalLM",
}
