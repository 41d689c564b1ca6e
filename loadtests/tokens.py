"""The target's tokenizer, used to count output tokens (re-tokenizing the joined text) and cut prompts.

Only the `tokenizers` library is used (no torch, no transformers), so Locust processes stay light.
"""

from __future__ import annotations

from pathlib import Path

from specbuild.pipeline.errors import UsageError


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
        self.chat_template, self._specials = _chat_template(file.parent)

    def ids(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids if text else []

    def chat(self, text: str) -> str:
        """`text` as one user turn in the target's chat template (what an instruct model expects);
        the text itself when the tokenizer has no template. Rendered client-side, like a chat frontend."""
        if not self.chat_template:
            return text
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=[{"role": "user", "content": text}], add_generation_prompt=True, **self._specials)

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids) if text else 0

    def truncate(self, text: str, max_tokens: int) -> str:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return text if len(ids) <= max_tokens else self._tok.decode(ids[:max_tokens])


def _chat_template(directory: Path) -> tuple[str | None, dict]:
    """The chat template and special tokens from `tokenizer_config.json` / `chat_template.jinja`."""
    import json

    template, specials = None, {}
    cfg = directory / "tokenizer_config.json"
    if cfg.is_file():
        try:
            data = json.loads(cfg.read_text())
        except ValueError:
            data = {}
        template = data.get("chat_template")
        for key in ("bos_token", "eos_token"):
            tok = data.get(key)
            specials[key] = tok.get("content", "") if isinstance(tok, dict) else (tok or "")
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text()
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template or None, specials
