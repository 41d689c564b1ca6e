"""The local protocol between the engine process and the Triton models that front it (no Triton, no torch).

One Unix stream socket; each message is a frame: a 4-byte big-endian length, then that many bytes of UTF-8 JSON
(never pickle: a frame is data). Requests carry their input tensors as they arrived at Triton, so every
validation rule stays in one place (`frontend.parse_request`, in the engine process):

    {"op": "hello", "role": "requests" | "metrics"}          -> {"op": "ready", "engine": <id>, "pid": <pid>}
    {"op": "submit", "key": K, "tensors": {name: TENSOR}}    -> {"op": "reply", "key": K, ...} (one or more)
    {"op": "cancel", "key": K}                               (the client is gone; the final reply still comes)
    {"op": "metrics", "seq": N, "m": {...}}  (engine -> the metrics connection) -> {"op": "metrics_ack", "seq": N}

TENSOR = {"dtype": numpy dtype name or "bytes", "shape": [...], "data": [...]} (BYTES elements base64).
A reply: text, final, error, kind, carries_text and, when asked for, perf = [drafted, accepted].
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import struct
from typing import Any

import numpy as np

MAX_FRAME = 16 * 1024 * 1024   # bytes; a bigger frame is a protocol error (a request is capped far below it)
# Coarse caps on one request's input tensors, checked before any work (the forwarding model before it encodes,
# the engine before it decodes); the precise limits (max_prompt_bytes, max_stop_words, ...) stay in one place,
# `frontend.parse_request`, and are far below these.
MAX_TENSOR_ELEMENTS = 1024          # elements of one input tensor (stop_words: max_stop_words, 16 by default)
MAX_REQUEST_BYTES = 1024 * 1024     # bytes of one request's inputs (text_input: max_prompt_bytes, 64 KiB)
MAX_SUBMIT_FRAME = 2 * MAX_REQUEST_BYTES    # a submit frame: MAX_REQUEST_BYTES base64-encoded, with its JSON
_LEN = struct.Struct(">I")


class ProtocolError(ConnectionError):
    """A malformed or oversized frame: the connection is closed."""


class TooLarge(ValueError):
    """A request whose inputs are above the coarse caps: refused (invalid) before it is encoded or decoded."""


def check_sizes(counts: dict[str, tuple[int, int]]) -> None:
    """`counts`: input name -> (elements, bytes); TooLarge naming the first input above a cap."""
    total = 0
    for name, (n, nbytes) in counts.items():
        if n > MAX_TENSOR_ELEMENTS:
            raise TooLarge(f"{name} has {n} entries, above the limit of {MAX_TENSOR_ELEMENTS} for one input "
                           "(stop_words: max_stop_words); send fewer.")
        total += nbytes
        if total > MAX_REQUEST_BYTES:
            raise TooLarge(f"the request's inputs are above {MAX_REQUEST_BYTES} bytes ({name} reaches "
                           f"{total}); text_input is limited to max_prompt_bytes, stop words to "
                           "max_stop_word_bytes each.")


def array_sizes(arr: np.ndarray) -> tuple[int, int]:
    """(elements, bytes) of an input tensor as Triton handed it over; bytes summed only under the element cap."""
    n = int(arr.size)
    if n > MAX_TENSOR_ELEMENTS:
        return n, 0
    if arr.dtype == np.object_ or arr.dtype.kind in "SU":
        return n, sum(len(v) if isinstance(v, (bytes, str, np.bytes_, np.str_)) else 8 for v in arr.reshape(-1))
    return n, int(arr.nbytes)


def wire_sizes(t: dict) -> tuple[int, int]:
    """(elements, bytes) of a wire tensor, read from its lengths: nothing is decoded."""
    data = t.get("data") if isinstance(t, dict) else None
    if not isinstance(data, list):
        return 0, 0
    if len(data) > MAX_TENSOR_ELEMENTS:
        return len(data), 0
    if t.get("dtype") == "bytes":
        return len(data), sum(len(v) * 3 // 4 if isinstance(v, str) else 8 for v in data)
    return len(data), 8 * len(data)


class PeerRefused(ConnectionError):
    """The other end of the socket runs as another user: not our engine, or not our server."""


_PEERCRED = struct.Struct("3i")     # struct ucred: pid, uid, gid (Linux)


def check_peer(sock: socket.socket) -> int:
    """The peer's pid, after checking (SO_PEERCRED, the kernel's record of who connected / who listens) that it
    runs as this process's user; PeerRefused if not. Both ends call it: a model must not talk to another user's
    fake engine, and the engine must not serve another user's process."""
    pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    if uid != os.getuid():
        raise PeerRefused(f"the peer on the engine socket (pid {pid}) runs as uid {uid}, not as this user "
                          f"(uid {os.getuid()}); refusing it.")
    return pid


def _default(o: Any):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON-serializable: {type(o).__name__}")


def encode(msg: dict) -> bytes:
    body = json.dumps(msg, separators=(",", ":"), default=_default).encode("utf-8")
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"message of {len(body)} bytes is above the frame limit of {MAX_FRAME}")
    return _LEN.pack(len(body)) + body


def _recv_exact(sock: socket.socket, n: int, *, started: bool) -> bytes:
    """n bytes; a socket timeout before the frame's first byte propagates (an idle peer), after it is waited out
    (a timeout set to bound sends must not cut a frame in two)."""
    chunks, left = [], n
    while left:
        try:
            chunk = sock.recv(min(left, 1 << 20))
        except socket.timeout:
            if not started and left == n:
                raise
            continue
        if not chunk:
            raise EOFError("the peer closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
        started = True
    return b"".join(chunks)


class FrameTooLarge(TooLarge):
    """A frame above the reader's limit, skipped without decoding; `key`: the submit it carried, if its first
    bytes name one (the forwarding models write "op" and "key" first)."""

    def __init__(self, message: str, key: str | None):
        super().__init__(message)
        self.key = key


_SUBMIT_HEAD = re.compile(rb'^\{"op":"submit","key":"([0-9A-Za-z_.:/-]{1,64})"')


def recv(sock: socket.socket, limit: int = MAX_FRAME) -> dict:
    """One frame. Above `limit` (<= MAX_FRAME) the frame's bytes are read and dropped undecoded, and
    FrameTooLarge says which submit it was (the stream stays in step; above MAX_FRAME: ProtocolError)."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, started=False))
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes is above the limit of {MAX_FRAME}")
    if n > limit:
        head = _recv_exact(sock, min(n, 128), started=True)
        left = n - len(head)
        while left:
            left -= len(_recv_exact(sock, min(left, 1 << 20), started=True))
        m = _SUBMIT_HEAD.match(head)
        raise FrameTooLarge(f"the request is {n} bytes on the wire, above the limit of {limit}; its inputs are "
                            f"above {MAX_REQUEST_BYTES} bytes.", m.group(1).decode() if m else None)
    try:
        msg = json.loads(_recv_exact(sock, n, started=True))
    except ValueError as e:
        raise ProtocolError(f"a frame that is not JSON: {e}") from None
    if not isinstance(msg, dict) or "op" not in msg:
        raise ProtocolError("a frame without an op")
    return msg


# ---- tensors ---------------------------------------------------------------------------------------
def tensor_to_wire(arr: np.ndarray) -> dict:
    arr = np.asarray(arr)
    if arr.dtype == np.object_ or arr.dtype.kind in "SU":
        data = [base64.b64encode(v if isinstance(v, (bytes, np.bytes_)) else str(v).encode("utf-8")).decode()
                for v in arr.reshape(-1)]
        return {"dtype": "bytes", "shape": list(arr.shape), "data": data}
    return {"dtype": arr.dtype.name, "shape": list(arr.shape), "data": arr.reshape(-1).tolist()}


def tensor_from_wire(t: dict) -> np.ndarray:
    try:
        shape = tuple(int(d) for d in t["shape"])
        if t["dtype"] == "bytes":
            flat = np.empty(len(t["data"]), dtype=np.object_)
            flat[:] = [base64.b64decode(v) for v in t["data"]]
        else:
            flat = np.array(t["data"], dtype=np.dtype(t["dtype"]))
        return flat.reshape(shape)
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"a malformed tensor: {e}") from None


# ---- replies ---------------------------------------------------------------------------------------
def reply_to_wire(key: str, reply) -> dict:
    """A frontend `Reply` as a frame; perf as [drafted, accepted] when the request asked for it."""
    perf = None
    if reply.stats is not None:
        perf = [int(getattr(reply.stats, "num_draft_tokens", 0) or 0),
                int(getattr(reply.stats, "num_accepted_tokens", 0) or 0)]
    return {"op": "reply", "key": key, "text": reply.text, "final": bool(reply.final), "error": reply.error,
            "kind": reply.kind, "carries_text": bool(reply.carries_text), "perf": perf}
