"""The target's tokenizer, used to count output tokens (re-tokenizing the joined text) and cut prompts.

Counting and cutting use only the `tokenizers` library, so Locust processes stay light. Chat prompts
are rendered by the tokenizer's own `apply_chat_template` (transformers, loaded on the first `chat()`
call, in the process that builds the prompts, never in a Locust process).
"""

from __future__ import annotations

import threading
from pathlib import Path

from specbuild.core.errors import UsageError


class TokenCounter:
    """Counts tokens of text with the target's `tokenizer.json` (no special tokens added)."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise UsageError(f"no tokenizer.json at {path}; pass --tokenizer with the target model's "
                             "directory (the one holding tokenizer.json) or a --workdir with a deployment.")
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a plain Exception on a bad file
            raise UsageError(f"{file} is not a tokenizer.json the `tokenizers` library can read ({e}).") from e
        self.path = file
        self._hf = None   # the transformers tokenizer, loaded by the first chat()
        self._hf_lock = threading.Lock()   # chat() is called from worker threads (verify): import once

    def ids(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids if text else []

    def chat(self, text: str) -> str:
        """`text` as one user turn, rendered by the tokenizer's own `apply_chat_template` with the
        generation prompt (what an instruct model expects); the text itself when the tokenizer has no
        chat template. Rendered client-side, like a chat frontend."""
        tok = self._transformers_tokenizer()
        if not getattr(tok, "chat_template", None):
            return text
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)

    @property
    def chat_template(self) -> str | None:
        return getattr(self._transformers_tokenizer(), "chat_template", None) or None

    def _transformers_tokenizer(self):
        with self._hf_lock:   # transformers' lazy imports are not safe to race from several threads
            if self._hf is None:
                from transformers import AutoTokenizer, PreTrainedTokenizerFast

                try:   # the directory as a Hub model: tokenizer_config.json, chat_template.jinja, specials
                    self._hf = AutoTokenizer.from_pretrained(str(self.path.parent))
                except (OSError, ValueError, KeyError):   # a bare tokenizer.json: no template to apply
                    self._hf = PreTrainedTokenizerFast(tokenizer_file=str(self.path))
            return self._hf

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids) if text else 0

    def truncate(self, text: str, max_tokens: int) -> str:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return text if len(ids) <= max_tokens else self._tok.decode(ids[:max_tokens])
