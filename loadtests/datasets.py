"""Users' own traffic: prompts from a file, with the output length each record asks for.

Two formats (`--prompts FILE`, `--prompts-format auto|jsonl|sharegpt`):

- **jsonl**, the GenAI-Perf / AIPerf input-file shape (AIPerf's `single_turn` custom dataset): one JSON
  object per line with the prompt in `text` (or `texts`: a list of strings or `{"contents": [...]}` objects,
  joined with newlines; `text_input` and `prompt` are accepted too) and optionally the output tokens to
  ask for in `output_length` (AIPerf's name; `max_tokens` is accepted too):

      {"text": "What is the capital of France?", "output_length": 64}

- **sharegpt**: a JSON array (or JSON lines) of `{"conversations": [{"from": "human", "value": ...},
  {"from": "gpt", "value": ...}, ...]}`; the prompt is the first human turn and the output length is the
  token count of the reply that follows it (as `vllm bench serve` and AIPerf read ShareGPT). Entries
  with fewer than two turns are skipped.

`auto` reads a record with `conversations` as ShareGPT, else as jsonl. At most `MAX_RECORDS` records are
kept (a seeded sample of a larger file), in file order.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specbuild.core.errors import UsageError

FORMATS = ("auto", "jsonl", "sharegpt")
MAX_RECORDS = 1000


@dataclass(frozen=True)
class PromptRecord:
    text: str
    output_tokens: int | None = None   # what the record asks for (None: the profile's max_tokens)
    reply: str | None = None            # ShareGPT: the reply whose length is the output length


def _objects(path: Path) -> list[tuple[int, Any]]:
    """(line or index, parsed object) of a JSON array file or a JSON-lines file."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read the prompt file {path}: {e}") from e
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise UsageError(f"{path} starts like a JSON array but is not valid JSON: {e}") from e
        return list(enumerate(data, 1))
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except ValueError as e:
            raise UsageError(f"{path}:{n} is not a JSON object ({e}); a prompt file has one JSON object per "
                             "line, e.g. {\"text\": \"...\", \"output_length\": 64}.") from e
    return out


def _jsonl_record(path: Path, n: int, obj: Any) -> PromptRecord:
    where = f"{path}:{n}"
    if not isinstance(obj, dict):
        raise UsageError(f"{where}: expected a JSON object, got {type(obj).__name__}.")
    text = obj.get("text", obj.get("text_input", obj.get("prompt")))
    if text is None and "texts" in obj:
        parts = []
        for t in obj["texts"] or []:
            parts += [str(c) for c in t.get("contents", [])] if isinstance(t, dict) else [str(t)]
        text = "\n".join(parts)
    if not isinstance(text, str) or not text.strip():
        raise UsageError(f"{where}: no prompt text (expected a non-empty \"text\", \"texts\", \"text_input\" "
                         f"or \"prompt\"; keys: {sorted(obj)}).")
    out = obj.get("output_length", obj.get("max_tokens"))
    if out is not None and (not isinstance(out, int) or isinstance(out, bool) or out < 1):
        raise UsageError(f"{where}: output_length {out!r} must be an integer >= 1.")
    return PromptRecord(text=text, output_tokens=out)


def _sharegpt_record(path: Path, n: int, obj: Any) -> PromptRecord | None:
    turns = obj.get("conversations") if isinstance(obj, dict) else None
    if not isinstance(turns, list):
        raise UsageError(f"{path}:{n}: a ShareGPT entry needs a \"conversations\" list.")
    for i, turn in enumerate(turns[:-1]):
        if isinstance(turn, dict) and turn.get("from") in ("human", "user") and isinstance(turns[i + 1], dict):
            prompt, reply = str(turn.get("value") or ""), str(turns[i + 1].get("value") or "")
            if prompt.strip() and reply.strip():
                return PromptRecord(text=prompt, reply=reply)
    return None   # fewer than two usable turns: skipped, as vLLM's and AIPerf's ShareGPT readers do


def load_prompt_file(path: str | Path, fmt: str = "auto", *, counter=None, seed: int = 0) -> list[PromptRecord]:
    """Read a prompt file; ShareGPT output lengths are counted with `counter` (the target's tokenizer)."""
    path = Path(path)
    if fmt not in FORMATS:
        raise UsageError(f"--prompts-format {fmt!r}: choose one of {FORMATS}.")
    if not path.is_file():
        raise UsageError(f"prompt file {path} does not exist.")
    objects = _objects(path)
    if not objects:
        raise UsageError(f"prompt file {path} holds no record.")
    if fmt == "auto":
        first = objects[0][1]
        fmt = "sharegpt" if isinstance(first, dict) and "conversations" in first else "jsonl"
    records = [r for n, o in objects if (r := (_sharegpt_record(path, n, o) if fmt == "sharegpt"
                                                else _jsonl_record(path, n, o))) is not None]
    if not records:
        raise UsageError(f"prompt file {path} ({fmt}) has no usable record (a prompt and, for ShareGPT, a reply).")
    if len(records) > MAX_RECORDS:
        keep = sorted(random.Random(seed).sample(range(len(records)), MAX_RECORDS))
        records = [records[i] for i in keep]
    if counter is not None:
        records = [PromptRecord(r.text, max(1, counter.count(r.reply)), r.reply) if r.reply is not None else r
                   for r in records]
    return records
