"""The target's tokenizer, used to count output tokens (re-tokenizing the joined text) and cut prompts.

Only the `tokenizers` library is used (no torch, no transformers), so Locust processes stay light.
"""

from __future__ import annotations

from pathlib import Path

from specbuild.errors import UsageError


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

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids) if text else 0

    def truncate(self, text: str, max_tokens: int) -> str:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return text if len(ids) <= max_tokens else self._tok.decode(ids[:max_tokens])
