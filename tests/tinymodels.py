"""Tiny real checkpoints made on the spot: a byte-level BPE tokenizer trained on local text and
randomly initialised Llama / Qwen2 models saved as Hugging Face safetensors directories.

Shared by every test module (convert, engine, deploy, load tests). Deterministic for a given seed.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Summarize the text: the meeting covered budgets, hiring plans and the product roadmap for next year.",
    "Triton Inference Server serves models over HTTP and gRPC with dynamic batching.",
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy.",
    "import os\nimport sys\n\nfor line in sys.stdin:\n    print(line.strip().upper())\n",
] * 20

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(out_dir: Path, vocab_size: int = 384, corpus: list[str] | None = None,
                   chat_template: str = CHAT_TEMPLATE) -> Path:
    """Train a byte-level BPE tokenizer and save it as a transformers fast tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus or CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = chat_template
    fast.save_pretrained(out_dir)
    return out_dir


def make_checkpoint(out_dir: Path, tokenizer_dir: Path, *, arch: str = "llama", hidden: int = 64,
                    layers: int = 2, heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
                    vocab_size: int | None = None, tie: bool = True, seed: int = 0,
                    dtype: str = "float32") -> Path:
    """A randomly initialised Llama-family model with the given tokenizer, saved as safetensors."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tokenizer_dir = Path(tokenizer_dir)
    tok_vocab = len(json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"])
    vocab = vocab_size or tok_vocab
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=512,
                  tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=2, rms_norm_eps=1e-6,
                  rope_theta=10000.0)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(arch)
    # Sharper logits than the default init so greedy continuations are not all ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    model = model.to(getattr(torch, dtype))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.is_file():
            shutil.copy(f, out_dir / f.name)
    return out_dir
