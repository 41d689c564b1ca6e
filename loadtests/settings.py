"""What a load test compares: `--compare NAME=V1,V2` (one request field, several values) or named
`--setting NAME:FIELD=V[,FIELD=V]` sets of request fields. The first is the baseline of the gain table."""

from __future__ import annotations

import re
from typing import Any

from specbuild.core.errors import UsageError


def parse_compare(text: str | None) -> tuple[str | None, list[Any]]:
    """`"num_draft_tokens=0,4"` -> ("num_draft_tokens", [0, 4]); None -> (None, [None])."""
    if not text:
        return None, [None]
    m = re.fullmatch(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.+)", text)
    if not m:
        raise UsageError(f"--compare {text!r} must look like NAME=V1,V2 (e.g. num_draft_tokens=0,4).")
    values = []
    for raw in m.group(2).split(","):
        raw = raw.strip()
        if raw.lower() in ("true", "false"):
            values.append(raw.lower() == "true")
            continue
        try:
            values.append(int(raw))
        except ValueError:
            try:
                values.append(float(raw))
            except ValueError:
                raise UsageError(f"--compare value {raw!r} is not a number or true/false.") from None
    if len(values) < 2 or len(set(values)) != len(values):
        raise UsageError(f"--compare {text!r} needs at least two distinct values (the first is the baseline).")
    return m.group(1), values


def _scalar(raw: str) -> Any:
    raw = raw.strip()
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


def parse_settings(items: tuple[str, ...] | list[str]) -> list[tuple[str, dict[str, Any]]]:
    """`["off:num_draft_tokens=0", "ngram:num_draft_tokens=4,proposer=ngram"]` -> named request-field sets.

    The first setting is the baseline of the gain table (one setting: just that configuration, measured).
    Names must be distinct; each needs >= 1 field, or the word `default`: no field sent, the deployment's own
    policy (e.g. `policy:default` — the engine's default K, adaptive K and speculation cut-off).
    """
    out: list[tuple[str, dict[str, Any]]] = []
    for item in items:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*:\s*(.+)", item)
        if not m:
            raise UsageError(f"--setting {item!r} must look like NAME:FIELD=VALUE[,FIELD=VALUE...] "
                             "(e.g. ngram:num_draft_tokens=4,proposer=ngram).")
        fields: dict[str, Any] = {}
        if m.group(2).strip().lower() == "default":
            out.append((m.group(1), fields))
            continue
        for pair in m.group(2).split(","):
            key, sep, value = pair.partition("=")
            if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()) or not value.strip():
                raise UsageError(f"--setting {item!r}: {pair!r} is not FIELD=VALUE.")
            fields[key.strip()] = _scalar(value)
        out.append((m.group(1), fields))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise UsageError(f"--setting names repeat ({names}); give each setting its own name.")
    return out   # one setting alone is one measured configuration (no gain table)
