"""Soak and fault benchmark of the embedded deployment through a real tritonserver (`make soak`).

Mixed load for --duration seconds (default 600): chat users (streaming, short answers, think time) and
batch users (non-streaming, longer answers, no think time), ~1 % hostile requests (tiny / huge / NaN / inf
temperature and top_p, oversized prompts and stop words, wrong types) and ~2 % random client disconnects
(a stream dropped after its first piece, a /generate given up after a short timeout). Halfway, the server
is killed (SIGKILL of tritonserver and its stubs) and restarted; requests during that window are counted
as `during_restart`, not as failures.

Report (bench/results/soak.json, and a summary on stdout): requests served, errors by kind, good requests
that failed (goal 0) or returned a different text than before the load (goal 0), p50/p99 latency of good
requests, RSS and thread count of the engine's stub process at the start and end of each server life
(goal: flat), and free batch slots / live requests at the end (goal: all free, none live).

    .venv/bin/python bench/soak.py --duration 90                       # tiny models in a temp workdir
    .venv/bin/python bench/soak.py --workdir specbuild-work --duration 600   # a deployed workspace

Loopback only; every loop is bounded by the deadline and every request by a timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The quick brown fox", "Paris is the capital of", "def fibonacci(n):", "Triton Inference Server",
           "Once upon a time", "import numpy as np\n"]
HOSTILE = [{"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": 1e-40},
           {"temperature": 3e38}, {"top_p": float("nan")}, {"top_p": 1e-30, "temperature": 1.0},
           {"max_tokens": 2 ** 31 - 1}, {"text_input": "z" * 100000}, {"stop_words": ["w" * 5000]},
           {"stop_words": ["a"] * 100}, {"temperature": "warm"}, {"text_input": 42}, {"max_tokens": -1}]
MODELS = ("ensemble", "tensorrt_llm_bls")


def tiny_workdir(root: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from servers import deploy_tiny  # noqa: E402 - the test suite's tiny models, no download
    from tinymodels import make_checkpoint, make_tokenizer  # noqa: E402

    tok = make_tokenizer(root / "tok")
    target = make_checkpoint(root / "target", tok, layers=4, seed=1)
    draft = make_checkpoint(root / "draft", tok, layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, seed=2)
    return deploy_tiny(root / "work", target, draft, max_batch_size=8)


def engine_stub(server_pid: int) -> int | None:
    """The Python-backend stub process that holds the engine (model tensorrt_llm)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == server_pid and any(b"tensorrt_llm/1/model.py" in c for c in cmd):
            return int(pid)
    return None


def proc_stats(pid: int | None) -> dict:
    if pid is None:
        return {}
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":" in line)
    except OSError:
        return {}
    return {"pid": pid, "rss_mb": round(int(fields["VmRSS"].split()[0]) / 1024, 1),
            "threads": int(fields["Threads"])}


def metrics(url: str) -> dict:
    from specbuild.pipeline.client import parse_metrics

    try:
        return {k: v for k, v in parse_metrics(httpx.get(url, timeout=10).text).items() if k.startswith("specbuild")}
    except httpx.HTTPError:
        return {}


class Soak:
    def __init__(self, args, info_ref):
        self.args, self.info = args, info_ref
        self.rng = random.Random(args.seed)
        self.lock = threading.Lock()
        self.kinds: Counter = Counter()
        self.latency: list[float] = []
        self.failed_good: list[str] = []
        self.wrong_text: list[str] = []
        self.down = threading.Event()       # set while the server is being killed / restarted
        self.reference: dict[tuple[str, int], str] = {}

    @property
    def base(self) -> str:
        return self.info[0].http_url

    def count(self, kind: str, latency: float | None = None) -> None:
        with self.lock:
            self.kinds[kind] += 1
            if latency is not None:
                self.latency.append(latency)

    def compute_reference(self) -> None:
        for p in PROMPTS:
            for n in (self.args.chat_tokens, self.args.batch_tokens):
                body = {"text_input": p, "max_tokens": n, "min_tokens": n, "num_draft_tokens": 0}
                r = httpx.post(f"{self.base}/v2/models/tensorrt_llm_bls/generate", json=body, timeout=300)
                r.raise_for_status()
                self.reference[(p, n)] = r.json()["text_output"]

    def one(self, rng: random.Random, chat: bool) -> None:
        model = rng.choice(MODELS)
        prompt = rng.choice(PROMPTS)
        n = self.args.chat_tokens if chat else self.args.batch_tokens
        body = {"text_input": prompt, "max_tokens": n, "min_tokens": n}
        if model == "tensorrt_llm_bls":
            body["num_draft_tokens"] = rng.choice([0, 2, 4])
        roll = rng.random()
        hostile = roll < self.args.hostile
        disconnect = not hostile and roll < self.args.hostile + self.args.disconnect
        if hostile:
            body.update(rng.choice(HOSTILE))
        was_down = self.down.is_set()
        t0 = time.monotonic()
        try:
            if chat and not hostile:
                text = self._stream(model, body, disconnect)
                text = None if text is None else prompt + text   # a stream carries no prompt
            else:
                text = self._generate(model, body, disconnect)
        except _Refused as e:
            self.count(f"refused_{e.status}" if hostile else "good_refused")
            if not hostile:
                self._fail(f"{body} -> {e.status} {e.message[:200]}", was_down)
            return
        except (httpx.TimeoutException, httpx.TransportError) as e:
            if disconnect:
                self.count("disconnected")
            else:
                self._fail(f"{body} -> {type(e).__name__}: {e}", was_down)
            return
        if disconnect and text is None:
            self.count("disconnected")
            return
        if hostile:
            self.count("hostile_served")
            return
        self.count("good_served", time.monotonic() - t0)
        if text != self.reference.get((prompt, n)):
            with self.lock:
                self.wrong_text.append(f"{model} {prompt!r}: {text!r}")

    def _fail(self, what: str, was_down: bool) -> None:
        if was_down or self.down.is_set():
            self.count("during_restart")
        else:
            self.count("good_failed")
            with self.lock:
                self.failed_good.append(what)

    def _generate(self, model: str, body: dict, disconnect: bool) -> str | None:
        timeout = 0.3 if disconnect else self.args.request_timeout
        r = httpx.post(f"{self.base}/v2/models/{model}/generate", content=json.dumps(body),
                       headers={"content-type": "application/json"}, timeout=timeout)
        if r.status_code != 200:
            raise _Refused(r.status_code, r.text)
        return r.json()["text_output"]

    def _stream(self, model: str, body: dict, disconnect: bool) -> str | None:
        pieces = []
        with httpx.stream("POST", f"{self.base}/v2/models/{model}/generate_stream", json={**body, "stream": True},
                          timeout=self.args.request_timeout) as r:
            if r.status_code != 200:
                raise _Refused(r.status_code, r.read().decode(errors="replace"))
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise _Refused(400, event["error"])
                pieces.append(event.get("text_output", ""))
                if disconnect:
                    return None                          # drop the connection after the first piece
        return "".join(pieces)

    def user(self, uid: int, chat: bool, deadline: float) -> None:
        rng = random.Random(self.args.seed * 1000 + uid)
        while time.monotonic() < deadline:
            if self.down.is_set():
                time.sleep(0.2)
                continue
            self.one(rng, chat)
            if chat:
                time.sleep(rng.uniform(0, self.args.think_time))


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def kill_server(info) -> None:
    """SIGKILL the server's process group (tritonserver and its stubs): a crash, not a clean stop."""
    try:
        os.killpg(info.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, help="a deployed workspace (default: tiny models in a temp dir)")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    ap.add_argument("--chat-users", type=int, default=6)
    ap.add_argument("--batch-users", type=int, default=3)
    ap.add_argument("--chat-tokens", type=int, default=16)
    ap.add_argument("--batch-tokens", type=int, default=48)
    ap.add_argument("--think-time", type=float, default=0.5, help="max seconds between a chat user's requests")
    ap.add_argument("--hostile", type=float, default=0.01, help="fraction of hostile requests")
    ap.add_argument("--disconnect", type=float, default=0.02, help="fraction of client disconnects")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--no-restart", action="store_true", help="do not kill and restart the server halfway")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "soak.json")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT / "tests"))
    from servers import serve_options  # noqa: E402 - free ports

    from specbuild.pipeline import serve

    tmp = None
    workdir = args.workdir
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="soak-")
        print("building the tiny models ...", flush=True)
        workdir = tiny_workdir(Path(tmp.name))
    opts = serve_options()
    info = [serve.start(workdir, opts)]
    soak = Soak(args, info)
    lives = []
    try:
        soak.compute_reference()
        stub = engine_stub(info[0].pid)
        life = {"start": proc_stats(stub)}
        t_start = time.monotonic()
        deadline = t_start + args.duration
        users = [threading.Thread(target=soak.user, args=(i, i < args.chat_users, deadline), daemon=True)
                 for i in range(args.chat_users + args.batch_users)]
        for u in users:
            u.start()
        restart_s = None
        if not args.no_restart:
            time.sleep(max(0.0, args.duration / 2 - (time.monotonic() - t_start)))
            life["end"] = proc_stats(stub)
            lives.append(life)
            print(f"{time.monotonic() - t_start:.0f}s: killing the server", flush=True)
            soak.down.set()
            t_kill = time.monotonic()
            kill_server(info[0])
            time.sleep(1.0)                             # requests in flight see the connection drop
            serve.stop(workdir, timeout=20)             # reap and clear the recorded state
            info[0] = serve.start(workdir, opts)
            restart_s = round(time.monotonic() - t_kill, 1)
            soak.down.clear()
            print(f"restarted in {restart_s}s", flush=True)
            stub = engine_stub(info[0].pid)
            life = {"start": proc_stats(stub)}
        for u in users:
            u.join(max(1.0, deadline - time.monotonic() + args.request_timeout))
        time.sleep(1.0)                                 # the last final replies and the metrics push
        life["end"] = proc_stats(stub)
        lives.append(life)
        m = metrics(info[0].metrics_url)
        lat = sorted(soak.latency)
        report = {
            "duration_s": args.duration, "workdir": str(workdir) if args.workdir else "tiny models (temp)",
            "users": {"chat": args.chat_users, "batch": args.batch_users},
            "requests_served": sum(v for k, v in soak.kinds.items() if k in ("good_served", "hostile_served")),
            "requests_total": sum(soak.kinds.values()),
            "by_kind": dict(sorted(soak.kinds.items())),
            "good_failed": soak.kinds.get("good_failed", 0) + soak.kinds.get("good_refused", 0),
            "good_wrong_text": len(soak.wrong_text),
            "failed_examples": soak.failed_good[:10], "wrong_text_examples": soak.wrong_text[:5],
            "latency_s": {"p50": round(statistics.median(lat), 3) if lat else None,
                          "p99": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None},
            "restart_s": restart_s, "stub_process": lives,
            "end": {"slots_free": m.get("specbuild_slots_free"), "live_requests": m.get("specbuild_live_requests"),
                    "running": m.get("specbuild_running_requests"), "waiting": m.get("specbuild_waiting_requests"),
                    "aborted_total": m.get("specbuild_requests_aborted_total"),
                    "refused_invalid_total": m.get("specbuild_requests_refused_invalid_total"),
                    "failed_total": m.get("specbuild_requests_failed_total")},
        }
    finally:
        serve.stop(workdir, timeout=30)
        if tmp is not None:
            tmp.cleanup()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("requests_served", "by_kind", "good_failed", "good_wrong_text",
                                             "latency_s", "restart_s", "stub_process", "end")}, indent=1))
    print(f"wrote {args.out}")
    return 0 if report["good_failed"] == 0 and report["good_wrong_text"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
