"""The engine process's socket service in-process (a real Engine + Frontend, a real Unix socket, the real client
class the Triton models use; no Triton): answers match the engine's own, the wire keeps every tensor value the
frontend must judge, and no peer can hold the engine: a peer that stops reading or goes away is cut off alone
and its slots free, while the other connections keep being served; metrics wait for the publisher's ack, but
not for a publisher that stopped acknowledging."""

from __future__ import annotations

import math
import os
import socket
import threading
import time

import numpy as np
import pytest

from specbuild.engines.embedded import Engine, SamplingParams
from specbuild.engines.embedded.frontend import Frontend
from specbuild.engines.embedded.service import EngineService, ServiceOptions
from specbuild.engines.embedded.service_client import EngineConnection, EngineUnavailable
from specbuild.engines.embedded.wire_ipc import encode, recv, tensor_from_wire, tensor_to_wire

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The quick brown fox", "Paris is the capital of"]
WAIT = 120  # seconds; a bound for a slow shared machine, never a speed requirement


def wire(**kw) -> dict:
    out = {}
    for k, v in kw.items():
        arr = np.array([[v.encode()]], dtype=np.object_) if isinstance(v, str) else np.array([[v]])
        out[k] = tensor_to_wire(arr)
    return out


class Client:
    """A connection plus the replies per key (what a Triton model keeps)."""

    def __init__(self, path, role="requests"):
        self.replies: dict[str, list[dict]] = {}
        self.done: dict[str, threading.Event] = {}
        self.lost = threading.Event()
        self.conn = EngineConnection(path, self._frame, lambda reason, generation: self.lost.set(), role=role)

    def _frame(self, msg):
        if msg["op"] == "reply":
            self.replies.setdefault(msg["key"], []).append(msg)
            if msg["final"]:
                self.done.setdefault(msg["key"], threading.Event()).set()

    def submit(self, key, **kw):
        self.done.setdefault(key, threading.Event())
        self.conn.send({"op": "submit", "key": key, "tensors": wire(**kw)})

    def text(self, key):
        assert self.done[key].wait(WAIT), f"no final reply for {key}"
        return "".join(m["text"] for m in self.replies[key])


def wait_until(pred, what):
    deadline = time.monotonic() + WAIT
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture()
def service(tmp_path, tiny_llama, tiny_llama_draft):
    eng = Engine.from_checkpoints(tiny_llama, tiny_llama_draft, max_batch_size=4, max_seq_len=4096, max_draft_len=4)
    holder = {}
    fe = Frontend(eng, metrics_sink=lambda m: holder["svc"].publish(m))
    svc = holder["svc"] = EngineService(fe, tmp_path / "engine.sock",
                                        ServiceOptions(stall_timeout_s=0.5, metrics_ack_s=0.5,
                                                       send_buffer_bytes=4096))
    fe.start()
    svc.bind()
    stop = threading.Event()
    t = threading.Thread(target=svc.serve, args=(stop,), daemon=True)
    t.start()
    yield svc, eng
    stop.set()
    t.join(10)
    fe.close(timeout=5)


def reference(eng, prompt, n):
    return eng.generate(prompt, SamplingParams(max_tokens=n, min_tokens=n), num_draft_tokens=0).text


def test_tensors_keep_every_value_on_the_wire():
    for arr in (np.array([[float("nan")]], dtype=np.float32), np.array([[2 ** 64 - 1]], dtype=np.uint64),
                np.array([[-1]], dtype=np.int64), np.array([[True]]), np.array([[b"\xff\xfe", b"a"]], dtype=object),
                np.array([[1e300]], dtype=np.float64)):
        back = tensor_from_wire(tensor_to_wire(arr))
        assert back.dtype == arr.dtype and back.shape == arr.shape
        if arr.dtype.kind == "f":
            assert (math.isnan(back.item()) and math.isnan(arr.item())) or back.item() == arr.item()
        else:
            assert back.tolist() == arr.tolist()


def test_answers_match_the_engine_and_refusals_name_the_limit(service):
    svc, eng = service
    ref = reference(eng, PROMPTS[0], 12)
    c = Client(svc.path)
    c.submit("a", text_input=PROMPTS[0], max_tokens=12, min_tokens=12)
    c.submit("s", text_input=PROMPTS[0], max_tokens=12, min_tokens=12, stream=True, return_perf_metrics=True)
    c.submit("bad", text_input=PROMPTS[0], max_tokens=4, temperature=float("nan"))
    assert c.text("a") == PROMPTS[0] + ref                 # non-streaming: one reply, prompt included
    assert len(c.replies["a"]) == 1 and c.replies["a"][0]["carries_text"]
    assert c.text("s") == ref and c.replies["s"][-1]["perf"] is not None
    assert c.done["bad"].wait(WAIT)
    bad = c.replies["bad"][-1]
    assert bad["kind"] == "invalid" and "temperature=nan must be a finite" in bad["error"]


def test_a_peer_that_stops_reading_is_cut_off_alone(service):
    svc, eng = service
    ref = reference(eng, PROMPTS[1], 16)
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.connect(str(svc.path))
    stuck.sendall(encode({"op": "hello", "role": "requests"}))
    assert recv(stuck)["op"] == "ready"
    for i in range(3):                         # long streams whose pieces it never reads
        stuck.sendall(encode({"op": "submit", "key": f"x{i}", "tensors": wire(
            text_input=PROMPTS[0], max_tokens=4000, min_tokens=4000, stream=True)}))
    good = Client(svc.path)
    good.submit("g", text_input=PROMPTS[1], max_tokens=16, min_tokens=16)
    assert good.text("g") == PROMPTS[1] + ref           # served while the stuck peer holds 3 of 4 slots
    # the writer blocks on the full socket; after stall_timeout_s the connection is closed and its requests end
    wait_until(lambda: svc.frontend.live() == 0, "the stuck peer's requests to be cancelled")
    assert svc.frontend.counters["requests_cancelled_total"] >= 1
    wait_until(lambda: eng.metrics()["slots_free"] == 4, "every slot free")
    good.submit("g2", text_input=PROMPTS[1], max_tokens=16, min_tokens=16)
    assert good.text("g2") == PROMPTS[1] + ref
    stuck.close()


def test_a_peer_that_goes_away_frees_its_slots(service):
    svc, eng = service
    gone = Client(svc.path)
    for i in range(3):
        gone.submit(f"x{i}", text_input=PROMPTS[0], max_tokens=4000, min_tokens=4000, stream=True)
    wait_until(lambda: svc.frontend.live() == 3, "the requests to start")
    gone.conn.close()
    wait_until(lambda: svc.frontend.live() == 0, "the gone peer's requests to be cancelled")
    assert svc.frontend.counters["requests_cancelled_total"] == 3
    wait_until(lambda: eng.metrics()["slots_free"] == 4, "every slot free")


def test_metrics_wait_for_the_ack_but_not_for_a_publisher_that_stopped(service):
    svc, eng = service
    seen = []

    class Publisher(Client):
        acking = True

        def _frame(self, msg):
            if msg["op"] == "metrics":
                seen.append(msg["m"])
                if self.acking:
                    self.conn.send({"op": "metrics_ack", "seq": msg["seq"]})

    pub = Publisher(svc.path, role="metrics")
    pub.conn.open()
    c = Client(svc.path)
    c.submit("a", text_input=PROMPTS[0], max_tokens=8, min_tokens=8)
    c.text("a")
    # pushed and acknowledged before the final reply: the client that has its answer finds it counted
    assert any(m["requests_total"] >= 1 and m["live"] == 0 for m in seen)
    pub.acking = False
    for key in ("b", "c", "d"):
        c.submit(key, text_input=PROMPTS[0], max_tokens=8, min_tokens=8)
        c.text(key)                            # served although the publisher no longer answers
    assert svc._ack_lagging


def test_a_publisher_that_connects_late_gets_the_totals_so_far_at_once(service):
    """A restarted engine answered the first requests before the `tensorrt_llm` model's metrics connection came
    back; those pushes went to nobody, and nothing else was pushed until the next request, so the restart and
    those requests stayed uncounted (CI, stop 33). A metrics connection that says hello gets the totals now."""
    svc, eng = service
    c = Client(svc.path)
    c.submit("a", text_input=PROMPTS[0], max_tokens=8, min_tokens=8)
    c.text("a")                                # answered with no publisher connected
    seen = []

    class Publisher(Client):
        def _frame(self, msg):
            if msg["op"] == "metrics":
                seen.append(msg["m"])
                self.conn.send({"op": "metrics_ack", "seq": msg["seq"]})

    pub = Publisher(svc.path, role="metrics")
    pub.conn.open()
    wait_until(lambda: any(m["requests_total"] >= 1 for m in seen), "the totals so far, with no new request")


def test_no_engine_is_a_clear_unavailable(tmp_path):
    conn = EngineConnection(str(tmp_path / "none.sock"), lambda m: None, lambda r, g: None, connect_timeout=0.2)
    with pytest.raises(EngineUnavailable, match="not running"):
        conn.send({"op": "cancel", "key": "1"})


def test_a_malformed_request_is_refused_alone(service):
    svc, eng = service
    c = Client(svc.path)
    c.done["bad"] = threading.Event()
    c.conn.send({"op": "submit", "key": "bad", "tensors": {"text_input": {"dtype": "no-such-type", "shape": [1],
                                                                         "data": [1]}}})
    assert c.done["bad"].wait(WAIT)
    assert c.replies["bad"][-1]["kind"] == "invalid" and "malformed tensor" in c.replies["bad"][-1]["error"]
    c.submit("ok", text_input=PROMPTS[0], max_tokens=8, min_tokens=8)     # the same connection serves on
    assert c.text("ok") == PROMPTS[0] + reference(eng, PROMPTS[0], 8)
    assert not c.lost.is_set()


# ---- limits before work, a reader that survives, the peer's uid, the socket's directory --------------
def test_a_huge_stop_words_is_refused_before_it_is_decoded(service, monkeypatch):
    """Issue 28 probe 5: a 2,000,000-entry stop_words used to be decoded in full (16 MiB frames) by the
    connection's reader before parse_request refused it on count. Now the frame is skipped undecoded (too big)
    or refused on its lengths (too many entries) before any tensor is decoded, each refusal for its request
    alone, and a good request on the same connection is served."""
    import specbuild.engines.embedded.service as service_mod

    svc, eng = service
    decoded = []
    orig = service_mod.tensor_from_wire
    monkeypatch.setattr(service_mod, "tensor_from_wire", lambda t: decoded.append(len(t["data"])) or orig(t))
    c = Client(svc.path)
    base = wire(text_input=PROMPTS[0], max_tokens=4)
    huge = {"dtype": "bytes", "shape": [1, 2_000_000], "data": ["YQ=="] * 2_000_000}    # ~14 MB frame
    many = {"dtype": "bytes", "shape": [1, 5000], "data": ["YQ=="] * 5000}               # a small frame
    for key, sw in (("huge", huge), ("many", many)):
        c.done[key] = threading.Event()
        c.conn.send({"op": "submit", "key": key, "tensors": {**base, "stop_words": sw}})
    c.submit("ok", text_input=PROMPTS[0], max_tokens=8, min_tokens=8)
    for key in ("huge", "many"):
        assert c.done[key].wait(WAIT)
        r = c.replies[key][-1]
        assert r["kind"] == "invalid" and r["final"], r
    assert "above the limit" in c.replies["huge"][-1]["error"]
    assert "stop_words has 5000 entries" in c.replies["many"][-1]["error"]
    assert c.text("ok") == PROMPTS[0] + reference(eng, PROMPTS[0], 8)
    assert max(decoded) == 1                     # only the good request's one-element tensors were decoded
    assert svc.frontend.counters["requests_refused_invalid_total"] >= 2 and not c.lost.is_set()


def test_a_refusal_never_waits_on_the_metrics_round_trip(tiny_llama):
    """A refusal used to publish the metrics synchronously (waiting for the metrics model's ack, holding the
    lock every final reply needs). With a metrics sink that never returns, refusals are still answered."""
    from specbuild.engines.embedded.frontend import Frontend

    eng = Engine.from_checkpoints(tiny_llama, max_batch_size=2, max_seq_len=64)
    stuck = threading.Event()
    fe = Frontend(eng, metrics_sink=lambda m: stuck.wait())
    fe.start()
    got = []
    try:
        def refuse():
            for i in range(5):
                fe.handle({"text_input": np.array([[b"hi"]], dtype=np.object_),
                           "max_tokens": np.array([[0]])}.get, got.append, key=f"r{i}")

        t = threading.Thread(target=refuse, daemon=True)
        t.start()
        t.join(WAIT)
        assert not t.is_alive(), "a refusal waited on the metrics sink"
        assert len(got) == 5 and all(r.kind == "invalid" and "max_tokens=0" in r.error for r in got)
        assert fe.counters["requests_refused_invalid_total"] == 5
    finally:
        stuck.set()
        fe.close(timeout=5)


def test_a_frame_that_raises_fails_its_request_alone_and_the_reader_lives_on(service, monkeypatch):
    """Issue 28 probe 7: the reader caught three exception types; anything else killed it and left its
    connection's requests (and their slots) held. Now that request alone fails and the connection serves on."""
    svc, eng = service
    orig = svc.frontend.handle

    def handle(get, send, key=None):
        if key.endswith("/boom"):
            raise KeyError("a bug in the engine")
        return orig(get, send, key=key)

    monkeypatch.setattr(svc.frontend, "handle", handle)
    c = Client(svc.path)
    c.submit("boom", text_input=PROMPTS[0], max_tokens=4)
    assert c.done["boom"].wait(WAIT)
    r = c.replies["boom"][-1]
    assert r["kind"] == "internal" and "a bug in the engine" in r["error"]
    c.submit("ok", text_input=PROMPTS[0], max_tokens=8, min_tokens=8)
    assert c.text("ok") == PROMPTS[0] + reference(eng, PROMPTS[0], 8)
    assert not c.lost.is_set()


def test_a_lost_connection_names_its_generation(service):
    """`on_lost` says which connection broke, and `sent_on` which connection a request went on: the model
    fails only the requests of the lost one (a request already sent on the next connection is not failed:
    issue 28's spurious 503s)."""
    svc, eng = service
    lost, gens = [], []
    conn = EngineConnection(str(svc.path), lambda m: None, lambda reason, g: lost.append(g))
    conn.send({"op": "cancel", "key": "x"}, sent_on=gens.append)
    with svc._lock:
        peers = list(svc._conns.values())
    for p in peers:
        p.close("test")
    wait_until(lambda: lost, "the connection to be reported lost")
    conn.send({"op": "cancel", "key": "y"}, sent_on=gens.append)
    assert lost == [1] and gens == [1, 2]
    conn.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a peer as another uid")
def test_a_peer_of_another_uid_is_refused_at_both_ends(tmp_path):
    """SO_PEERCRED: the engine refuses a connection from another user's process, and a model refuses an
    engine socket served by another user (which could read every prompt and write every answer)."""
    from specbuild.engines.embedded.wire_ipc import PeerRefused, check_peer

    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="peercred-", dir="/tmp")     # reachable by the other user (tmp_path is not)
    os.chmod(d, 0o777)
    path = os.path.join(d, "s.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen(1)
    srv.settimeout(WAIT)
    pid = os.fork()
    if pid == 0:                                  # the other user's process
        try:
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            try:
                check_peer(s)                     # its view: the listener is root's, not nobody's
                os._exit(1)
            except PeerRefused:
                os._exit(0)
        except BaseException:
            os._exit(2)
    try:
        conn, _ = srv.accept()
        with pytest.raises(PeerRefused, match="uid 65534"):
            check_peer(conn)
        conn.close()
    finally:
        _, status = os.waitpid(pid, 0)
        srv.close()
        shutil.rmtree(d, ignore_errors=True)
    assert os.WEXITSTATUS(status) == 0            # the other end refused us too


def test_the_socket_directory_is_checked_without_following_links(tmp_path, monkeypatch):
    from specbuild.engines.embedded import service_client

    monkeypatch.setattr(service_client.tempfile, "gettempdir", lambda: str(tmp_path))
    base = tmp_path / f"specbuild-{os.getuid()}"
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir(mode=0o700)
    base.symlink_to(elsewhere)                    # a planted link to a directory of the right mode
    with pytest.raises(PermissionError, match="is a symlink"):
        service_client.socket_path(tmp_path / "repo", 123)
    base.unlink()
    base.mkdir(mode=0o700)
    if os.getuid() == 0:                          # pre-created by another user
        os.chown(base, 12345, 12345)
        with pytest.raises(PermissionError, match="owned by uid 12345"):
            service_client.socket_path(tmp_path / "repo", 123)
        os.chown(base, 0, 0)
    os.chmod(base, 0o755)
    with pytest.raises(PermissionError, match="mode 0755"):
        service_client.socket_path(tmp_path / "repo", 123)
    os.chmod(base, 0o700)
    path = service_client.socket_path(tmp_path / "repo", 123)
    assert path.startswith(str(base)) and path.endswith("-123.sock")


def test_a_socket_path_too_long_for_af_unix_is_a_clear_error(tmp_path, monkeypatch):
    from specbuild.engines.embedded import service_client

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(service_client.tempfile, "gettempdir", lambda: str(deep))
    with pytest.raises(ValueError, match="above the 107 .*set TMPDIR to a shorter directory"):
        service_client.socket_path(tmp_path / "repo", 123)
