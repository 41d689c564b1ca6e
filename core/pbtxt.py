"""Values written into a Triton `config.pbtxt` (protobuf text format), escaped once, here, for every renderer.

A string value sits between double quotes; protobuf's text-format tokenizer reads C-style escapes inside
them (`\\\\`, `\\"`, `\\n`, octal `\\NNN`: protobuf `src/google/protobuf/io/tokenizer.cc`, `ParseStringAppend`),
so a path holding a backslash or a quote must be escaped or the config either fails to parse or, worse,
parses as something else (a backslash before a quote ends the string early). A bare (unquoted) value is an
identifier or a number (`TYPE_FP32`, `16`, `true`); anything else there is refused instead of written.
"""

from __future__ import annotations

import re

from specbuild.core.errors import SpecbuildError

_BARE = re.compile(r"^[A-Za-z0-9_.+-]+$")
_SIMPLE = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def escape(text: str) -> str:
    """`text` as the inside of a double-quoted text-format string (without the quotes)."""
    out = []
    for ch in str(text):
        if ch in _SIMPLE:
            out.append(_SIMPLE[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\{ord(ch):03o}")
        else:
            out.append(ch)       # UTF-8 passes through: the tokenizer keeps the bytes
    return "".join(out)


def quoted(text: str) -> str:
    return '"' + escape(text) + '"'


def bare(value) -> str:
    """A value written without quotes: a bool, a number or an identifier; refuses anything that could
    change the structure of the config."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if not _BARE.match(text):
        raise SpecbuildError(f"internal error: {text!r} cannot be written unquoted into a config.pbtxt")
    return text
