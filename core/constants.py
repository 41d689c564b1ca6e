"""Names shared by the stages, the engines and the CLI, stated once (no torch or transformers imports here).

Each constant is the one place its values live; modules import it instead of restating it.
"""

from __future__ import annotations

# Checkpoint dtypes every stage accepts (convert casts, build keeps, the embedded engine loads).
DTYPES = ("float32", "float16", "bfloat16")

# Who drafts the K tokens the target verifies: a draft model, or prompt lookup (n-gram) over the request.
PROPOSERS = ("draft", "ngram")

# Draft quantizations `build --draft-quantize` offers (embedded backend); see engines/embedded/quant.py.
DRAFT_QUANTIZATIONS = ("int8", "int4")
# a block-quantized (int4) draft's activations: int8 per block of 32 (integer kernels) or the exact fp32
DRAFT_ACTIVATIONS = ("fp32", "int8")
PREFILL_PRECISIONS = ("fp32", "bf16")    # the embedded target's prompt rows (EngineConfig.prefill_precision)

# Tokenizer files copied beside a checkpoint or an engine: the chat template included, so that clients
# (loadtest, verify) render chat prompts with the model's own template.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")

# The embedded engine's decoder families: HF `model_type` values and the `architectures` names behind them.
EMBEDDED_MODEL_TYPES = ("llama", "mistral", "qwen2", "smollm", "smollm2", "smollm3")
EMBEDDED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")  # SmolLM2 is Llama

# The runtime config an embedded engine directory holds (read and written only by engines/embedded/config.py).
ENGINE_CONFIG_FILE = "engine_config.json"

# Triton's admin API groups that no client of the model needs (tritonserver 2.51 --help:
# "--http-restricted-api=<apis>:<key>=<value>", "--grpc-restricted-protocol=..."): behind the header ADMIN_KEY
# whose value is a per-server token (`serve`) or a Kubernetes Secret (`deploy --kubernetes`). Health, metadata
# and inference stay open.
RESTRICTED_APIS = ("shared-memory", "model-config", "model-repository", "statistics", "trace", "logging")
ADMIN_KEY = "specbuild-admin-token"
ADMIN_TOKEN_ENV = "SPECBUILD_ADMIN_TOKEN"   # a client's token for a server started from another workdir


def restriction_args(value: str) -> list[str]:
    """tritonserver flags that put RESTRICTED_APIS behind `ADMIN_KEY: value` on HTTP and gRPC."""
    apis = ",".join(RESTRICTED_APIS)
    return [f"--http-restricted-api={apis}:{ADMIN_KEY}={value}",
            f"--grpc-restricted-protocol={apis}:{ADMIN_KEY}={value}"]
