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
import socket
import struct
from typing import Any

import numpy as np

MAX_FRAME = 16 * 1024 * 1024   # bytes; a bigger frame is a protocol error (a request is capped far below it)
_LEN = struct.Struct(">I")


class ProtocolError(ConnectionError):
    """A malformed or oversized frame: the connection is closed."""


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


def recv(sock: socket.socket) -> dict:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, started=False))
    if n > MAX_FRAME:
        raise ProtocolError(f"frame of {n} bytes is above the limit of {MAX_FRAME}")
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
