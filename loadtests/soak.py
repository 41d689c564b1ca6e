"""Soak and fault benchmark of the embedded deployment through a real tritonserver (`make soak`, a gate).

bench/soak.py runs it (it starts the server); the hostile catalogue is `specbuild.loadtests.hostile`.

Mixed load for --duration seconds (default 600): chat users (streaming, short answers, think time) and
batch users (non-streaming, longer answers, no think time), ~1 % hostile requests (the named cases of
HOSTILE: NaN / inf / wrong-typed values, oversized prompts and stop words, malformed bodies...) and ~2 %
client disconnects (a stream dropped after its first piece; a non-streaming `/generate` given up after
--abandon-timeout s: its request goes on in the server, Triton 2.51 never reports that disconnect). Faults:
at --pause-at x duration the server (tritonserver, its stubs and the engine process) is paused with SIGSTOP for
--pause-s s and resumed with SIGCONT; at --flood-at x duration --flood-n requests of `max_tokens: 0` (each a 400)
arrive from 16 clients at once; halfway the server is killed (SIGKILL) and restarted; at --term-at x duration
the engine process alone gets SIGTERM, and the `tensorrt_llm` model must start it again. Requests that overlap
the pause, the restart or the engine's restart are counted as `during_pause` / `during_restart`, not as
failures.

Before the load every hostile case is sent once to each model and endpoint, one at a time (`hostile_one_by_one`),
so the report names the status each case gets; under load each hostile request is counted by case and
status (`hostile_by_case`). A 500 whose message is one of tritonserver's own JSON-parsing errors (raised in
its HTTP frontend before any model code runs; docs/serving.md "HTTP 500s that tritonserver answers itself")
is `upstream_500`; any other 5xx, a stream that fails after its 200, or a dropped connection is ours.

Every --sample-interval s: RSS and threads of the engine process (and of tritonserver), the
engine's slots / live requests (Triton metrics) and the requests the soak has in flight; `live - in
flight` is a lower bound on the requests still held by clients that gave up. After the load the soak
waits (bounded by --drain-timeout) until no request is live and every slot is free.

Memory verdict per server life (bench/README.md "Soak"): after the warm-up (--warmup s, at most 40 % of the
life), over the second half of the samples, the Theil-Sen slope of RSS must be <= --rss-slope-max MB/min,
and the highest RSS after the warm-up at most --rss-spike-max MB above the post-warm-up median; the thread
count of the second half must not exceed the first half's.

Slowed by a hostile request (`slowed_by_hostile`): the p99 latency of the good requests that overlapped no
hostile request (and no fault) is the bound, per profile; a good request that overlapped a hostile one and took
longer than --slowed-factor (3) x that bound is slowed, counted with the cases it overlapped. Those beyond the
bound itself are reported too (`beyond_p99`; ~1 % by chance, more wherever the machine is merely busier), and the
median / p90 / highest latency over the bound. A ratio within one run: no machine's speed is built in.

Gate (exit 1, reasons printed): any wrong text, any good request failed, any 5xx from our code (or a stream
error / dropped connection) to a hostile request, memory not flat, slots not all free or requests still
live after the drain, no good request completed after the pause, the engine not started again after its
SIGTERM, a flood request answered other than 400, or more than --slowed-max-fraction of the good requests that
overlapped a hostile one slowed by it.

Report: bench/results/soak.json (everything, samples included) and soak.png (RSS / threads / slots over time).

    .venv/bin/python bench/soak.py --duration 120                      # tiny models in a temp workdir
    .venv/bin/python bench/soak.py --workdir specbuild-work --duration 600   # a deployed workspace

Loopback only; every loop is bounded by the deadline and every request by a timeout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

from specbuild.core import http, wire
from specbuild.loadtests.hostile import ENDPOINTS, HOSTILE, MODELS, classify, hostile_body, ours_bad

PROMPTS = ["The quick brown fox", "Paris is the capital of", "def fibonacci(n):", "Triton Inference Server",
           "Once upon a time", "import numpy as np\n"]


def slots_total(workdir: Path) -> int | None:
    try:
        return int(json.loads((Path(workdir) / "engines" / "engine_config.json").read_text())["max_batch_size"])
    except (OSError, ValueError, KeyError):
        return None


def fit_tokens(workdir: Path, n: int) -> int:
    """`n`, lowered so that a short prompt + n tokens fits the deployment's max_seq_len."""
    try:
        seq = json.loads((Path(workdir) / "engines" / "engine_config.json").read_text())["max_seq_len"]
        return max(1, min(n, int(seq) - 64))
    except (OSError, ValueError, KeyError):
        return n


def request_timeout(workdir: Path, default_s: float | None = None) -> str:
    """The deployment's bound on a request's life (`request_timeout_s`) and where it comes from; `default_s`:
    the engine's default, where neither file sets it."""
    cfg = Path(workdir) / "model_repository" / "tensorrt_llm" / "config.pbtxt"
    try:
        m = re.search(r'key:\s*"request_timeout_s"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', cfg.read_text())
    except OSError:
        m = None
    if m and m.group(1).strip():
        return f"{m.group(1).strip()} s (config.pbtxt)"
    try:
        v = json.loads((Path(workdir) / "engines" / "engine_config.json").read_text()).get("request_timeout_s")
    except (OSError, ValueError):
        return "unknown"
    if v is not None:
        return f"{v} s (engine_config.json)"
    return f"{default_s:g} s (engine default)" if default_s is not None else "unknown"


def _child(parent: int, marker: bytes) -> int | None:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == parent and any(marker in c for c in cmd):
            return int(pid)
    return None


def engine_process(server_pid: int, wait_s: float = 30.0) -> int | None:
    """The process that holds the engine: the engine process (`specbuild.engines.embedded.service`, a child of
    model tensorrt_llm's stub; a new one after the stub restarted it), else the stub itself (older deployments)."""
    deadline = time.monotonic() + wait_s
    while True:
        stub = _child(server_pid, b"tensorrt_llm/1/model.py")
        engine = _child(stub, b"specbuild.engines.embedded.service") if stub else None
        if engine or time.monotonic() > deadline:
            return engine or stub
        time.sleep(0.5)


def proc_stats(pid: int | None) -> dict:
    if pid is None:
        return {}
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":" in line)
    except OSError:
        return {}
    mb = {k: round(int(fields[k].split()[0]) / 1024, 1) for k in ("VmRSS", "RssAnon", "RssFile", "RssShmem")
          if k in fields}
    # RssShmem: Triton's shared-memory pool between tritonserver and the stub (it grows with the responses in
    # flight and is never given back); RssAnon: the stub's own heap.
    return {"pid": pid, "rss_mb": mb.get("VmRSS"), "anon_mb": mb.get("RssAnon"), "shmem_mb": mb.get("RssShmem"),
            "file_mb": mb.get("RssFile"), "threads": int(fields["Threads"])}


METRIC_KEYS = {"slots_free": "specbuild_slots_free", "live": "specbuild_live_requests",
               "running": "specbuild_running_requests", "waiting": "specbuild_waiting_requests",
               "aborted_total": "specbuild_requests_aborted_total",
               "refused_invalid_total": "specbuild_requests_refused_invalid_total",
               "refused_unavailable_total": "specbuild_requests_refused_unavailable_total",
               "failed_total": "specbuild_requests_failed_total", "requests_total": "specbuild_requests_total",
               "timed_out_total": "specbuild_requests_timed_out_total"}


def metrics(url: str, timeout: float = 5.0) -> dict:
    """The engine's gauges and counters (names: METRICS in model_repository/embedded/triton_models.py)."""
    # /metrics (its own port) is not among the admin APIs `serve` restricts (core.constants.RESTRICTED_APIS): no
    # token needed. The admin calls without the token are probed in tests/test_security.py.
    from specbuild.core.metrics import parse_prometheus

    try:
        m = parse_prometheus(http.get(url, timeout=timeout).text)
    except (httpx.HTTPError, ValueError):
        return {}
    return {k: m[name] for k, name in METRIC_KEYS.items() if name in m}


def theil_sen(xs: list[float], ys: list[float]) -> float:
    """Median of the pairwise slopes: a straight-line fit that a few outliers cannot drag."""
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))
              if xs[j] > xs[i]]
    return statistics.median(slopes) if slopes else 0.0


def memory_verdict(samples: list[dict], warmup_s: float, slope_max: float, spike_max: float,
                   min_life_s: float = 0.0, min_samples: int = 5) -> dict:
    """Flatness of one server life's RSS / threads after its warm-up (see the module docstring). A life shorter
    than `min_life_s` is reported but not judged (`judged` False): it cannot have reached its plateau."""
    have = [s for s in samples if s.get("rss_mb") is not None]
    life_s = (have[-1]["t_life"] - have[0]["t_life"]) if have else 0.0
    warm = min(warmup_s, 0.4 * life_s)
    post = [s for s in have if s["t_life"] >= warm]
    out = {"life_s": round(life_s, 1), "warmup_s": round(warm, 1), "samples": len(have),
           "samples_after_warmup": len(post), "judged": life_s >= min_life_s}
    if len(post) < 2 * min_samples:
        return {**out, "flat": False, "verdict": f"too short: {len(post)} samples after the warm-up, "
                                                  f"need {2 * min_samples}"}
    first, second = post[: len(post) // 2], post[len(post) // 2:]
    rss = [s["rss_mb"] for s in post]
    slope = theil_sen([s["t_life"] / 60 for s in second], [s["rss_mb"] for s in second])
    median = statistics.median(rss)
    thr_first, thr_second = max(s["threads"] for s in first), max(s["threads"] for s in second)
    problems = []
    if slope > slope_max:
        problems.append(f"RSS slope {slope:.2f} MB/min over the second half > {slope_max:g}")
    if max(rss) - median > spike_max:
        problems.append(f"RSS max {max(rss):.0f} MB is {max(rss) - median:.0f} MB above the median "
                        f"{median:.0f} MB (> {spike_max:g})")
    if thr_second > thr_first:
        problems.append(f"threads grew: {thr_first} in the first half, {thr_second} in the second")
    verdict = "; ".join(problems) or "flat"
    if not out["judged"]:
        verdict = f"not judged (a life of {life_s:.0f} s < {min_life_s:g} s): {verdict}"
    return {**out, "flat": not problems, "verdict": verdict,
            "rss_mb": {"start": have[0]["rss_mb"], "after_warmup": post[0]["rss_mb"], "last": post[-1]["rss_mb"],
                       "max_after_warmup": max(rss), "median_after_warmup": median},
            "rss_slope_mb_per_min_second_half": round(slope, 3),
            "threads": {"start": have[0]["threads"], "max_first_half": thr_first, "max_second_half": thr_second,
                        "last": post[-1]["threads"]}}

class Soak:
    def __init__(self, args, info_ref, workdir: Path):
        self.args, self.info, self.workdir = args, info_ref, workdir
        self.lock = threading.Lock()
        self.kinds: Counter = Counter()
        self.latency: list[float] = []
        self.failed_good: list[str] = []
        self.wrong_text: list[str] = []
        self.hostile: dict[str, Counter] = defaultdict(Counter)     # case -> status label -> n
        self.hostile_examples: dict[str, str] = {}                  # "case label" -> message
        self.down = threading.Event()       # set while the server is being killed / restarted
        self.reference: dict[tuple[str, int], str] = {}
        self.inflight = 0
        self.t_start = time.monotonic()
        self.pause: dict | None = None      # {"start", "end"} in soak seconds once a pause began
        self.windows: list[dict] = []       # other faults' {"start", "end"} (a SIGTERM'd engine's restart)
        self.good_spans: list[tuple] = []   # (t0, t1, chat) of each good request served
        self.hostile_spans: list[tuple] = []    # (t0, t1, case) of each hostile request under load
        self.after_term = {"good_completed": 0, "first_good_s": None}
        self.after_pause = {"good_completed": 0, "first_good_s": None}
        self.samples: list[dict] = []
        self.abandoned_log: list[tuple] = []     # (t, model, prompt, max_tokens) of each /generate given up
        self.life = 0
        self.life_t0 = time.monotonic()
        self.stub: int | None = None
        self.server_logs: list[str] = []
        self.phase = "load"

    @property
    def base(self) -> str:
        return self.info[0].http_url

    def now(self) -> float:
        return time.monotonic() - self.t_start

    def count(self, kind: str, latency: float | None = None) -> None:
        with self.lock:
            self.kinds[kind] += 1
            if latency is not None:
                self.latency.append(latency)

    # ---- before the load --------------------------------------------------------------------------------
    def compute_reference(self) -> None:
        for p in PROMPTS:
            for n in (self.args.chat_tokens, self.args.batch_tokens):
                body = {"text_input": p, "max_tokens": n, "min_tokens": n, "num_draft_tokens": 0}
                r = http.post(f"{self.base}/v2/models/tensorrt_llm_bls/generate", json=body, timeout=300)
                r.raise_for_status()
                self.reference[(p, n)] = r.json()["text_output"]

    def hostile_one_by_one(self) -> dict:
        """Every hostile case once per model and endpoint, one at a time: case -> {model/endpoint: label}."""
        table: dict[str, dict[str, str]] = {}
        for case in HOSTILE:
            row = table.setdefault(case, {})
            for model in MODELS:
                for ep in ENDPOINTS:
                    label, message = self._send_hostile(case, model, ep, PROMPTS[0], self.args.chat_tokens)
                    row[f"{model}/{ep}"] = label
                    self.hostile_examples.setdefault(f"{case} {label}", message[:200])
        return table

    # ---- one request --------------------------------------------------------------------------------
    def one(self, rng: random.Random, chat: bool) -> None:
        model = rng.choice(MODELS)
        prompt = rng.choice(PROMPTS)
        n = self.args.chat_tokens if chat else self.args.batch_tokens
        roll = rng.random()
        if roll < self.args.hostile:
            self.hostile_under_load(rng, model, prompt, n, chat)
            return
        disconnect = roll < self.args.hostile + self.args.disconnect
        body = {"text_input": prompt, "max_tokens": n, "min_tokens": n}
        if disconnect and not chat:     # a client that gives up on a long answer (its slot stays busy)
            k = rng.randint(self.args.abandon_tokens // 2, self.args.abandon_tokens)   # tells them apart
            body = {"text_input": prompt, "max_tokens": k, "min_tokens": k}
        if model == "tensorrt_llm_bls":
            body["num_draft_tokens"] = rng.choice([0, 2, 4])
        t0 = self.now()
        with self.lock:
            self.inflight += 1
        try:
            if chat:
                text = self._stream(model, body, disconnect)
                text = None if text is None else prompt + text   # a stream carries no prompt
            else:
                text = self._generate(model, body, disconnect)
        except _Refused as e:
            self.count("good_refused")
            self._fail(f"{model} {body} -> {e.status} {e.message[:200]}", t0)
            return
        except (httpx.TimeoutException, httpx.TransportError) as e:
            if disconnect:
                self.count("abandoned_generate" if not chat else "disconnected_stream")
                if not chat:
                    with self.lock:
                        self.abandoned_log.append((round(t0, 2), model, prompt, body["max_tokens"]))
            else:
                self._fail(f"{model} {body} -> {type(e).__name__}: {e}", t0)
            return
        finally:
            with self.lock:
                self.inflight -= 1
        if disconnect and text is None:
            self.count("disconnected_stream")
            return
        if disconnect:      # a /generate meant to be given up that came back within the client's timeout
            self.count("abandoned_completed")
            return
        t1 = self.now()
        self.count("good_served", t1 - t0)
        with self.lock:
            self.good_spans.append((t0, t1, chat))
        for w in self.windows:
            if t1 > w["start"] and w.get("kind") == "term":
                with self.lock:
                    self.after_term["good_completed"] += 1
                    if self.after_term["first_good_s"] is None:
                        self.after_term["first_good_s"] = round(t1 - w["start"], 2)
        if self.pause is not None and t1 > self.pause["end"]:
            with self.lock:
                self.after_pause["good_completed"] += 1
                if self.after_pause["first_good_s"] is None:
                    self.after_pause["first_good_s"] = round(t1 - self.pause["end"], 2)
        if text != self.reference.get((prompt, n)):
            with self.lock:
                self.wrong_text.append(f"t={t0:.1f}-{t1:.1f}s life {self.life} {model} "
                                       f"{'stream' if chat else 'generate'} {body}: {text!r}")

    def hostile_under_load(self, rng: random.Random, model: str, prompt: str, n: int, chat: bool) -> None:
        case = rng.choice(list(HOSTILE))
        t0 = self.now()
        label, message = self._send_hostile(case, model, "generate_stream" if chat else "generate", prompt, n)
        if label == "transport_error" and (self.down.is_set() or self._in_fault_window(t0)):
            self.count("during_restart" if self.down.is_set() else "during_pause")
            return
        self._count_hostile(case, label, message, t0)

    def _count_hostile(self, case: str, label: str, message: str, t0: float, t1: float | None = None) -> None:
        with self.lock:
            self.hostile_spans.append((t0, self.now() if t1 is None else t1, case))
            self.hostile[case][label] += 1
            self.hostile_examples.setdefault(f"{case} {label}", message[:200])
        self.count("hostile_" + ("bad_ours" if ours_bad(label) else label))

    def _send_hostile(self, case: str, model: str, ep: str, prompt: str, n: int) -> tuple[str, str]:
        return send_hostile(self.base, case, model, ep, prompt, n, self.args.request_timeout)

    def _in_fault_window(self, t0: float) -> bool:
        """A request that began before a fault ended (+ --pause-grace) and is answered after it began."""
        now = self.now()
        return any(w is not None and t0 <= w["end"] + self.args.pause_grace and now >= w["start"]
                   for w in [self.pause, *self.windows])

    def _fail(self, what: str, t0: float) -> None:
        if self.down.is_set():
            self.count("during_restart")
        elif self._in_fault_window(t0):
            self.count("during_pause")
        else:
            self.count("good_failed")
            with self.lock:
                self.failed_good.append(what)

    def _generate(self, model: str, body: dict, disconnect: bool) -> str | None:
        timeout = self.args.abandon_timeout if disconnect else self.args.request_timeout
        r = http.post(f"{self.base}/v2/models/{model}/generate", content=json.dumps(body),
                      headers={"content-type": "application/json"}, timeout=timeout)
        if r.status_code != 200:
            raise _Refused(r.status_code, r.text)
        return r.json()["text_output"]

    def _stream(self, model: str, body: dict, disconnect: bool) -> str | None:
        pieces = []
        with http.stream("POST", f"{self.base}/v2/models/{model}/generate_stream",
                         content=json.dumps({**body, "stream": True}),
                         headers={"content-type": "application/json"}, timeout=self.args.request_timeout) as r:
            if r.status_code != 200:
                raise _Refused(r.status_code, r.read().decode(errors="replace"))
            for line in r.iter_lines():
                event = wire.parse_line(wire.KSERVE, line)
                if event is None:
                    continue
                if event.error:
                    raise _Refused(200, event.error)
                pieces.append(event.text)
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

    def abandoned_probe(self, total: int | None) -> dict:
        """After the load, on an idle server: `total` non-streaming /generate requests whose clients give up
        after --abandon-timeout s, each asking for --probe-tokens tokens. Measures the slots they hold
        (live requests / free slots, nothing else runs), whether a good request sent meanwhile is served, and
        how long until every slot is free again (bounded by --drain-timeout)."""
        n = total or 8
        tokens = fit_tokens(self.workdir, self.args.probe_tokens)
        body = json.dumps({"text_input": PROMPTS[0], "max_tokens": tokens, "min_tokens": tokens}).encode()
        url = f"{self.base}/v2/models/tensorrt_llm_bls/generate"

        def give_up():
            try:
                http.post(url, content=body, headers={"content-type": "application/json"},
                          timeout=self.args.abandon_timeout)
            except (httpx.TimeoutException, httpx.TransportError):
                pass

        threads = [threading.Thread(target=give_up, daemon=True) for _ in range(n)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        held, free_min, trace = 0, None, []
        good: dict = {}

        def good_request():
            t = time.monotonic()
            try:
                text = self._generate("tensorrt_llm_bls", {"text_input": PROMPTS[1], "max_tokens": 8,
                                                           "min_tokens": 8, "num_draft_tokens": 0}, False)
                good.update(ok=True, latency_s=round(time.monotonic() - t, 2),
                            same_text=text == self.reference.get((PROMPTS[1], 8), text))
            except Exception as e:  # noqa: BLE001
                good.update(ok=False, error=f"{type(e).__name__}: {e}"[:200])

        g = threading.Thread(target=good_request, daemon=True)
        freed_s = gone_s = None
        while time.monotonic() - t0 < self.args.drain_timeout:
            if gone_s is None and not any(t.is_alive() for t in threads):
                gone_s = round(time.monotonic() - t0, 1)    # every client has given up: now a good request
                g.start()
            m = metrics(self.info[0].metrics_url, timeout=2.0)
            live, free = m.get("live"), m.get("slots_free")
            trace.append({"t": round(time.monotonic() - t0, 1), "live": live, "slots_free": free})
            if live is not None:
                held = max(held, int(live))
                free_min = free if free_min is None else min(free_min, free)
                if gone_s is not None and live == 0 and (total is None or free == total) and not g.is_alive():
                    freed_s = round(time.monotonic() - t0, 1)
                    break
            time.sleep(0.25)
        if g.is_alive() or gone_s is not None:
            g.join(5)
        return {"requests": n, "max_tokens": tokens, "client_timeout_s": self.args.abandon_timeout,
                "clients_gone_after_s": gone_s, "live_max": held, "slots_free_min": free_min,
                "all_free_after_s": freed_s,
                "good_request_meanwhile": good, "trace": trace[:: max(1, len(trace) // 60)]}

    def flood(self, n: int, concurrency: int = 16) -> dict:
        """`n` requests of `max_tokens: 0` (each refused: 400) from `concurrency` clients at once, beside the
        load: cheap invalid requests must not slow the good ones (`slowed_by_hostile`) nor fail any. The flood
        runs in a process of its own: sixteen sending threads in the soak's process would hold the GIL its
        good users' clients need, and slow the very latencies it is judged by."""
        t0 = self.now()
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_flood_process, daemon=True,
                           args=(self.base, n, concurrency, self.args.seed + 7, self.args.request_timeout,
                                 self.t_start, PROMPTS[0], queue))
        proc.start()
        try:
            spans = queue.get(timeout=self.args.request_timeout * max(1, n // concurrency + 1) + 60)
        except Exception as e:  # noqa: BLE001 - a flood that never reports is a gate failure, not a crash
            spans = [(t0, self.now(), "transport_error", f"the flood process reported nothing: {e}")]
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        for start, end, label, message in spans:
            self._count_hostile("max_tokens_zero (flood)", label, message, start, end)
        return {"kind": "flood", "at_s": round(t0, 1), "requests": n, "concurrency": concurrency,
                "took_s": round(self.now() - t0, 1), "by_status": dict(self.hostile["max_tokens_zero (flood)"])}

    def term_engine(self) -> dict:
        """SIGTERM the engine process (not the server): the supervisor must start it again (an exit that the
        server did not ask for, whatever its code); requests until a good one completes are in a fault window."""
        pid = self.stub
        at = self.now()
        window = {"kind": "term", "start": at, "end": at + 3600}      # open until a new engine answers
        self.windows.append(window)
        if pid is None:
            return {"kind": "term", "at_s": round(at, 1), "error": "no engine process found"}
        os.kill(pid, signal.SIGTERM)
        new = None
        deadline = time.monotonic() + self.args.drain_timeout
        while time.monotonic() < deadline:
            new = engine_process(self.info[0].pid, wait_s=0.0)
            if new is not None and new != pid and _answers_generate(self.base, self.args.request_timeout):
                break
            new = None
            time.sleep(0.5)
        window["end"] = self.now()
        if new:
            self.new_life()         # a new engine process: its memory is judged as a life of its own
        return {"kind": "term", "at_s": round(at, 1), "engine_pid": pid, "new_engine_pid": new,
                "back_after_s": round(window["end"] - at, 1) if new else None}

    def warmup_burst(self, total: int | None) -> None:
        """Every slot busy at once with long answers, at the start of a server life: the engine's memory reaches
        the high-water mark of a full batch during the warm-up, not later (bench/README.md "Soak")."""
        if self.args.warmup_burst <= 0:
            return
        tokens = fit_tokens(self.workdir, self.args.warmup_burst)
        body = json.dumps({"text_input": PROMPTS[2], "max_tokens": tokens, "min_tokens": tokens}).encode()

        def one():
            try:
                http.post(f"{self.base}/v2/models/tensorrt_llm_bls/generate", content=body,
                          headers={"content-type": "application/json"}, timeout=self.args.request_timeout)
            except httpx.HTTPError:
                pass

        threads = [threading.Thread(target=one, daemon=True) for _ in range(total or 8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.args.request_timeout)

    # ---- samples ------------------------------------------------------------------------------------
    def sample(self) -> dict:
        stub, server = self.stub, self.info[0].pid
        s = proc_stats(stub) if not self.down.is_set() else {}
        srv = proc_stats(server) if not self.down.is_set() else {}
        m = metrics(self.info[0].metrics_url, timeout=2.0) if not self.down.is_set() else {}
        with self.lock:
            inflight = self.inflight
        live = m.get("live")
        rec = {"t": round(self.now(), 1), "t_life": round(time.monotonic() - self.life_t0, 1), "life": self.life,
               "phase": self.phase, "rss_mb": s.get("rss_mb"), "anon_mb": s.get("anon_mb"),
               "shmem_mb": s.get("shmem_mb"), "file_mb": s.get("file_mb"), "threads": s.get("threads"),
               "server_rss_mb": srv.get("rss_mb"), "server_threads": srv.get("threads"),
               "slots_free": m.get("slots_free"), "live": live, "running": m.get("running"),
               "waiting": m.get("waiting"), "client_inflight": inflight,
               "abandoned_live": None if live is None else max(0, int(live) - inflight)}
        with self.lock:
            self.samples.append(rec)
        return rec

    def sampler(self, stop: threading.Event) -> None:
        while not stop.wait(self.args.sample_interval):
            try:
                self.sample()
            except Exception as e:  # noqa: BLE001 - a sample must never stop the soak
                print(f"sample failed: {e}", file=sys.stderr)

    def new_life(self) -> None:
        self.life += 1
        self.life_t0 = time.monotonic()
        self.stub = engine_process(self.info[0].pid)


def send_hostile(base: str, case: str, model: str, ep: str, prompt: str, n: int,
                 timeout: float) -> tuple[str, str]:
    """One hostile request: its status label (`classify`) and message."""
    content = hostile_body(case, prompt, n, stream=ep == "generate_stream")
    try:
        with http.stream("POST", f"{base}/v2/models/{model}/{ep}", content=content,
                         headers={"content-type": "application/json"}, timeout=timeout) as r:
            text = r.read().decode(errors="replace")
    except (httpx.TimeoutException, httpx.TransportError) as e:
        return "transport_error", f"{type(e).__name__}: {e}"
    return classify(r.status_code, text, stream=ep == "generate_stream")


def _flood_process(base: str, n: int, concurrency: int, seed: int, timeout: float, t_start: float, prompt: str,
                   queue) -> None:
    """The flood's own process (`Soak.flood`): `n` `max_tokens_zero` requests from `concurrency` threads; puts
    [(t0, t1, label, message)] on `queue`, in the soak's seconds (CLOCK_MONOTONIC is one clock for every
    process of the machine). It runs at nice 10: a real flood comes from another machine, and this client's own
    CPU (its HTTP and JSON work, not the server's work for it) would otherwise take a share of the cores the
    server and the good clients run on, and be counted as the server's fault."""
    try:
        os.nice(10)
    except OSError:
        pass
    todo = iter(range(n))
    lock = threading.Lock()
    rng = random.Random(seed)
    spans: list[tuple] = []

    def client():
        while True:
            with lock:
                if next(todo, None) is None:
                    return
                model, ep = rng.choice(MODELS), rng.choice(ENDPOINTS)
            t0 = time.monotonic() - t_start
            label, message = send_hostile(base, "max_tokens_zero", model, ep, prompt, 8, timeout)
            with lock:
                spans.append((t0, time.monotonic() - t_start, label, message[:200]))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    queue.put(spans)


def _answers_generate(base: str, timeout: float) -> bool:
    try:
        r = http.post(f"{base}/v2/models/tensorrt_llm_bls/generate", timeout=timeout,
                      json={"text_input": PROMPTS[0], "max_tokens": 2, "num_draft_tokens": 0})
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def slowed_by_hostile(good: list[tuple], hostile: list[tuple], windows: list[dict], grace: float,
                      factor: float = 1.5) -> dict:
    """Good requests slowed by a hostile one: the p99 of the good requests (chat and batch apart) that
    overlapped no hostile request and no fault is the bound; a good request that overlapped a hostile one and
    took longer than `factor` x that bound is `slowed` (with the hostile cases it overlapped). `beyond_p99`
    counts those above the bound itself (about 1 % by chance: `expected`; more where the load is only busier),
    and `ratio` gives the median, p90 and highest latency / bound of the overlapping ones."""
    def in_fault(t0, t1):
        return any(t0 <= w["end"] + grace and t1 >= w["start"] for w in windows if w is not None)

    hostile = sorted(hostile)
    out: dict = {"factor": factor, "by_profile": {}, "slowed": 0, "beyond_p99": 0, "overlapping": 0,
                 "expected": 0.0, "by_case": {}, "examples": []}
    ratios: list[float] = []
    for chat in (True, False):
        spans = [(t0, t1) for t0, t1, c in good if c == chat and not in_fault(t0, t1)]
        over = {sp: [case for h0, h1, case in hostile if h0 < sp[1] and h1 > sp[0]] for sp in spans}
        base = sorted(t1 - t0 for (t0, t1), cases in over.items() if not cases)
        if len(base) < 20:
            continue
        p99 = base[min(len(base) - 1, int(0.99 * len(base)))]
        hit = {sp: cases for sp, cases in over.items() if cases}
        beyond = {sp: cases for sp, cases in hit.items() if sp[1] - sp[0] > p99}
        slow = {sp: cases for sp, cases in beyond.items() if sp[1] - sp[0] > factor * p99}
        ratios += [(t1 - t0) / p99 for t0, t1 in hit] if p99 > 0 else []
        name = "chat" if chat else "batch"
        out["by_profile"][name] = {"p99_alone_s": round(p99, 3), "alone": len(base), "overlapping": len(hit),
                                   "beyond_p99": len(beyond), "slowed": len(slow)}
        out["slowed"] += len(slow)
        out["beyond_p99"] += len(beyond)
        out["overlapping"] += len(hit)
        out["expected"] += 0.01 * len(hit)
        for (t0, t1), cases in slow.items():
            for case in set(cases):
                out["by_case"][case] = out["by_case"].get(case, 0) + 1
        for (t0, t1), cases in sorted(beyond.items(), key=lambda kv: kv[0][0] - kv[0][1])[:10 - len(out["examples"])]:
            out["examples"].append({"profile": name, "t0": round(t0, 2), "latency_s": round(t1 - t0, 3),
                                    "p99_alone_s": round(p99, 3), "hostile": sorted(set(cases))[:5]})
    out["expected"] = round(out["expected"], 1)
    out["fraction"] = round(out["slowed"] / out["overlapping"], 4) if out["overlapping"] else 0.0
    ratios.sort()
    out["ratio"] = ({"p50": round(ratios[len(ratios) // 2], 2), "p90": round(ratios[int(0.9 * len(ratios))], 2),
                     "max": round(ratios[-1], 2)} if ratios else None)
    return out


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def kill_server(info, engine: int | None = None) -> None:
    """SIGKILL the server's process group (tritonserver and its stubs) and the engine process (a session of its
    own): a crash, not a clean stop."""
    try:
        os.killpg(info.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _signal(engine, signal.SIGKILL)


def _signal(pid: int | None, sig: int) -> None:
    if pid is not None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def pause_server(soak: Soak, seconds: float) -> dict:
    """SIGSTOP the server's process group for `seconds`, then SIGCONT; what the clients had in flight."""
    info = soak.info[0]
    with soak.lock:
        inflight = soak.inflight
    start = soak.now()
    soak.pause = {"start": start, "end": start + seconds + 3600}   # open until resumed
    soak.phase = "paused"
    engine = soak.stub          # the engine process leads a session of its own: not in the server's group
    os.killpg(info.pid, signal.SIGSTOP)
    _signal(engine, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        _signal(engine, signal.SIGCONT)
        os.killpg(info.pid, signal.SIGCONT)
    soak.pause["end"] = soak.now()
    soak.phase = "load"
    return {"at_s": round(start, 1), "paused_s": round(soak.pause["end"] - start, 1), "inflight_at_pause": inflight}


def plot(report: dict, path: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    samples = report["samples"]
    fig, (ax1, ax3) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    ax2 = ax1.twinx()
    for life in sorted({s["life"] for s in samples}):
        pts = [s for s in samples if s["life"] == life and s["rss_mb"] is not None]
        if not pts:
            continue
        t = [s["t"] for s in pts]
        ax1.plot(t, [s["rss_mb"] for s in pts], "-", color="tab:blue", label="engine process RSS (MB)" if life == 0 else None)
        ax2.plot(t, [s["threads"] for s in pts], "--", color="tab:orange", label="threads" if life == 0 else None)
        v = report["memory"][life] if life < len(report["memory"]) else {}
        if v.get("warmup_s") is not None:
            ax1.axvspan(t[0], t[0] + v["warmup_s"], color="0.9", label="warm-up" if life == 0 else None)
    for ev in report["faults"]:
        ax1.axvline(ev["at_s"], color="tab:red", linestyle=":")
        ax1.annotate(ev["kind"], (ev["at_s"], ax1.get_ylim()[1]), color="tab:red", fontsize=8, va="top")
    ax1.set_ylabel("RSS (MB)")
    ax2.set_ylabel("threads")
    ax1.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    t = [s["t"] for s in samples]
    for key, style in (("slots_free", "-"), ("live", "-"), ("abandoned_live", "--"), ("client_inflight", ":")):
        ax3.plot(t, [s[key] if s[key] is not None else float("nan") for s in samples], style, label=key)
    ax3.set_xlabel("soak time (s)")
    ax3.set_ylabel("requests / slots")
    ax3.legend(loc="upper left", fontsize=8, ncol=4)
    gate = "PASS" if report["gate"]["passed"] else "FAIL"
    fig.suptitle(f"soak {report['duration_s']:.0f} s: {report['requests_total']} requests, gate {gate}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def server_gone(report: dict) -> list[dict]:
    """Lives in which tritonserver vanished on its own (no RSS sample outside a planned restart)."""
    gone, seen = [], set()
    for x in report.get("samples", []):
        if x.get("server_rss_mb") is None and x.get("phase") != "restart" and x.get("life") not in seen:
            seen.add(x.get("life"))
            gone.append({"life": x.get("life"), "at_s": round(x.get("t", 0), 1)})
    return gone


def gate(report: dict, args) -> dict:
    reasons = []
    for g in report.get("server_gone", []):
        reasons.append(f"tritonserver died on its own at {g['at_s']:.0f} s (server life {g['life']}); its log is "
                       f"kept in {', '.join(report.get('server_logs', [])) or 'nowhere'}")
    if report["good_wrong_text"]:
        reasons.append(f"{report['good_wrong_text']} good requests returned a different text")
    if report["good_failed"]:
        reasons.append(f"{report['good_failed']} good requests failed")
    ours = {f"{case} {label}": n for case, row in report["hostile_by_case"].items() for label, n in row.items()
            if ours_bad(label)}
    ours.update({f"{case} {where}: {label} (one by one)": 1 for case, row in report["hostile_one_by_one"].items()
                 for where, label in row.items() if ours_bad(label)})
    if ours:
        reasons.append(f"hostile requests answered with our 5xx / a stream error / a dropped connection: {ours}")
    for i, v in enumerate(report["memory"]):
        if v["judged"] and not v["flat"]:
            reasons.append(f"memory of server life {i}: {v['verdict']}")
    end = report["end"]
    total = report["slots_total"]
    if end.get("live") != 0 or (total is not None and end.get("slots_free") != total):
        reasons.append(f"after the drain: live requests {end.get('live')}, slots free {end.get('slots_free')} of {total}")
    for f in report["faults"]:
        if f["kind"] == "pause" and not report["after_pause"]["good_completed"]:
            reasons.append("no good request completed after the pause")
        if f["kind"] == "term" and not f.get("new_engine_pid"):
            reasons.append(f"the engine process was not started again after its SIGTERM: {f}")
        if f["kind"] == "flood" and set(f.get("by_status", {})) - {"400"}:
            reasons.append(f"the max_tokens=0 flood got other answers than 400: {f['by_status']}")
    slow = report.get("slowed_by_hostile") or {}
    if slow.get("overlapping") and slow["slowed"] > max(3, args.slowed_max_fraction * slow["overlapping"]):
        reasons.append(f"{slow['slowed']} of {slow['overlapping']} good requests that overlapped a hostile one took "
                       f"longer than {slow.get('factor', args.slowed_factor):g} x the p99 of those that did not "
                       f"(> {args.slowed_max_fraction:g}; by case {slow['by_case']}; latency / p99 of the "
                       f"overlapping ones: {slow.get('ratio')})")
    probe = report["abandoned"].get("probe")
    if probe is not None:
        if probe["all_free_after_s"] is None:
            reasons.append(f"abandoned-request probe: slots not all free after {args.drain_timeout:g}s "
                           f"(live max {probe['live_max']})")
        if not probe["good_request_meanwhile"].get("ok") or not probe["good_request_meanwhile"].get("same_text"):
            reasons.append(f"abandoned-request probe: the good request sent meanwhile: "
                           f"{probe['good_request_meanwhile']}")
    if not report["by_kind"].get("good_served"):
        reasons.append("no good request was served")
    return {"passed": not reasons, "reasons": reasons,
            "bounds": {"rss_slope_max_mb_per_min": args.rss_slope_max, "rss_spike_max_mb": args.rss_spike_max,
                       "warmup_s": args.warmup, "memory_min_life_s": args.memory_min_life}}


def parse_args(argv=None, default_out: Path = Path("soak.json")) -> argparse.Namespace:
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
    ap.add_argument("--abandon-timeout", type=float, default=0.3,
                    help="client timeout (s) of a non-streaming /generate that gives up (default 0.3)")
    ap.add_argument("--abandon-tokens", type=int, default=256,
                    help="max_tokens of a /generate whose client gives up (default 256)")
    ap.add_argument("--probe-tokens", type=int, default=512,
                    help="max_tokens of the after-load probe's abandoned requests (0 = no probe; default 512)")
    ap.add_argument("--warmup-burst", type=int, default=256,
                    help="max_tokens of the full batch of requests sent at the start of each server life (0 = none)")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--no-restart", action="store_true", help="do not kill and restart the server halfway")
    ap.add_argument("--pause-at", type=float, default=0.25,
                    help="SIGSTOP the server at this fraction of the duration (0 = never; default 0.25)")
    ap.add_argument("--pause-s", type=float, default=10.0, help="seconds the server stays stopped (default 10)")
    ap.add_argument("--pause-grace", type=float, default=5.0,
                    help="seconds after SIGCONT during which a failure still counts as during_pause")
    ap.add_argument("--flood-at", type=float, default=0.4,
                    help="a flood of max_tokens=0 requests at this fraction of the duration (0 = none; default 0.4)")
    ap.add_argument("--flood-n", type=int, default=500, help="requests in the flood (default 500)")
    ap.add_argument("--term-at", type=float, default=0.9,
                    help="SIGTERM the engine process at this fraction of the duration (0 = never; default 0.9: "
                         "the engine it starts is a server life too short for the memory verdict)")
    ap.add_argument("--slowed-factor", type=float, default=3.0,
                    help="a good request that overlapped a hostile one is slowed by it when it took longer than "
                         "this many times the p99 of those that overlapped none (default 3: sharing two cores "
                         "fairly with a flood's refusals can double a request's time; bench/README.md \"Soak\")")
    ap.add_argument("--slowed-max-fraction", type=float, default=0.05,
                    help="largest fraction of the good requests that overlapped a hostile one and were slowed "
                         "by it (default 0.05)")
    ap.add_argument("--sample-interval", type=float, default=1.0, help="seconds between RSS / metrics samples")
    ap.add_argument("--warmup", type=float, default=60.0,
                    help="seconds of each server life excluded from the memory verdict (at most 40%% of the life)")
    ap.add_argument("--rss-slope-max", type=float, default=3.0,
                    help="largest RSS slope (MB/min, Theil-Sen, second half after the warm-up) that is flat")
    ap.add_argument("--rss-spike-max", type=float, default=64.0,
                    help="largest RSS above the post-warm-up median (MB) that is flat")
    ap.add_argument("--memory-min-life", type=float, default=240.0,
                    help="a server life shorter than this (s) is sampled but not judged by the memory gate")
    ap.add_argument("--drain-timeout", type=float, default=180.0,
                    help="longest wait after the load for live requests to end and slots to free")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=default_out, help=f"the JSON report (default {default_out})")
    return ap.parse_args(argv)


def keep_server_log(soak: Soak, workdir: Path) -> None:
    """Copy this life's tritonserver.log (stubs and engine process included) beside the report: a temporary
    workdir goes at the end, and a restart starts a new log."""
    src = Path(workdir) / "server" / "tritonserver.log"
    dst = soak.args.out.parent / f"{soak.args.out.stem}-server-life{soak.life}.log"
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        soak.server_logs.append(str(dst))
    except OSError as e:
        print(f"could not keep {src}: {e}", file=sys.stderr)


def restart_server(soak: Soak, server: "Server", total: int | None) -> dict:
    """SIGKILL the server mid-load and start it again; requests in flight see the connection drop."""
    print(f"{soak.now():.0f}s: killing the server", flush=True)
    soak.down.set()
    soak.phase = "restart"
    t_kill = time.monotonic()
    at_s = soak.now()
    kill_server(soak.info[0], soak.stub)
    time.sleep(1.0)                             # requests in flight see the connection drop
    keep_server_log(soak, soak.workdir)         # the next life's log replaces it
    server.stop()                               # reap and clear the recorded state
    soak.info[0] = server.start()
    restart_s = round(time.monotonic() - t_kill, 1)
    soak.new_life()
    soak.phase = "load"
    soak.down.clear()
    threading.Thread(target=soak.warmup_burst, args=(total,), daemon=True).start()
    print(f"restarted in {restart_s}s", flush=True)
    return {"kind": "kill", "at_s": round(at_s, 1), "restart_s": restart_s}


def load(soak: Soak, args, server: "Server", total: int | None) -> list[dict]:
    """The users' load with the faults (pause, kill, flood, term) at their times; returns the faults as they
    happened."""
    deadline = soak.t_start + args.duration
    users = [threading.Thread(target=soak.user, args=(i, i < args.chat_users, deadline), daemon=True)
             for i in range(args.chat_users + args.batch_users)]
    for u in users:
        u.start()
    events, faults = [], []
    if args.pause_at > 0:
        events.append((args.pause_at * args.duration, "pause"))
    if not args.no_restart:
        events.append((args.duration / 2, "kill"))
    if args.flood_at > 0 and args.flood_n > 0:
        events.append((args.flood_at * args.duration, "flood"))
    if args.term_at > 0:
        events.append((args.term_at * args.duration, "term"))
    for at, kind in sorted(events):
        time.sleep(max(0.0, at - soak.now()))
        if kind == "kill":
            faults.append(restart_server(soak, server, total))
            continue
        if kind == "flood":
            print(f"{soak.now():.0f}s: a flood of {args.flood_n} max_tokens=0 requests", flush=True)
            faults.append(soak.flood(args.flood_n))
            continue
        if kind == "term":
            print(f"{soak.now():.0f}s: SIGTERM of the engine process (pid {soak.stub})", flush=True)
            ev = soak.term_engine()
            print(f"{soak.now():.0f}s: the engine is back: {ev}", flush=True)
            faults.append(ev)
            continue
        print(f"{soak.now():.0f}s: pausing the server (SIGSTOP) for {args.pause_s:g}s", flush=True)
        ev = pause_server(soak, args.pause_s)
        print(f"{soak.now():.0f}s: resumed (SIGCONT); {ev['inflight_at_pause']} requests were in flight", flush=True)
        faults.append({"kind": "pause", **ev})
    for u in users:
        u.join(max(1.0, deadline - time.monotonic() + args.request_timeout))
    return faults


def drain(soak: Soak, args, info: list, total: int | None) -> tuple[dict, dict, float]:
    """After the load: wait for live requests to end and slots to free; (end-of-load sample, end metrics, s)."""
    soak.phase = "drain"
    end_of_load = soak.sample()
    t_drain = time.monotonic()
    end = metrics(info[0].metrics_url)
    while time.monotonic() - t_drain < args.drain_timeout:
        end = metrics(info[0].metrics_url)
        if end.get("live") == 0 and (total is None or end.get("slots_free") == total):
            break
        time.sleep(1.0)
    return end_of_load, end, round(time.monotonic() - t_drain, 1)


def abandoned_summary(soak: Soak, end_of_load: dict, drained_s: float, probe, request_timeout_s: str) -> dict:
    load_samples = [s for s in soak.samples if s["phase"] in ("load", "paused") and s["live"] is not None]
    return {
        "generate_given_up": soak.kinds.get("abandoned_generate", 0),
        "streams_dropped": soak.kinds.get("disconnected_stream", 0),
        "abandoned_live_max": max((s["abandoned_live"] for s in load_samples), default=None),
        "abandoned_live_mean": round(statistics.mean(s["abandoned_live"] for s in load_samples), 2)
        if load_samples else None,
        "samples_with_no_free_slot": sum(1 for s in load_samples if s["slots_free"] == 0),
        "samples": len(load_samples),
        "end_of_load": {k: end_of_load[k] for k in ("live", "slots_free", "running", "waiting",
                                                     "client_inflight", "abandoned_live")},
        "drained_after_s": drained_s, "probe": probe, "request_timeout_s": request_timeout_s}


def build_report(soak: Soak, args, workdir: Path, one_by_one: dict, faults: list, abandoned: dict,
                 total: int | None, end: dict) -> dict:
    lat = sorted(soak.latency)
    by_life = [[s for s in soak.samples if s["life"] == i] for i in range(soak.life + 1)]
    memory = [memory_verdict([s for s in life if s["phase"] != "drain"], args.warmup, args.rss_slope_max,
                             args.rss_spike_max, args.memory_min_life) for life in by_life]
    return {
        "duration_s": args.duration, "workdir": str(workdir) if args.workdir else "tiny models (temp)",
        "users": {"chat": args.chat_users, "batch": args.batch_users},
        "requests_total": sum(soak.kinds.values()),
        "requests_served": sum(v for k, v in soak.kinds.items() if k in ("good_served", "hostile_200")),
        "by_kind": dict(sorted(soak.kinds.items())),
        "good_failed": soak.kinds.get("good_failed", 0),
        "good_wrong_text": len(soak.wrong_text),
        "failed_examples": soak.failed_good[:10], "wrong_text_examples": soak.wrong_text[:5],
        "abandoned_log": soak.abandoned_log,
        "latency_s": {"p50": round(statistics.median(lat), 3) if lat else None,
                      "p99": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
                      "max": round(lat[-1], 3) if lat else None},
        "hostile_one_by_one": one_by_one,
        "hostile_by_case": {c: dict(sorted(v.items())) for c, v in sorted(soak.hostile.items())},
        "hostile_by_status": dict(sorted(sum(soak.hostile.values(), Counter()).items())),
        "hostile_examples": dict(sorted(soak.hostile_examples.items())),
        "faults": faults, "after_pause": soak.after_pause, "after_term": soak.after_term, "abandoned": abandoned,
        "slowed_by_hostile": slowed_by_hostile(soak.good_spans, soak.hostile_spans,
                                               [soak.pause, *soak.windows], args.pause_grace,
                                               args.slowed_factor),
        "slots_total": total, "memory": memory, "end": end, "samples": soak.samples,
    }


def write_report(report: dict, args) -> int:
    """The JSON report and its plot; the summary and the gate's verdict on stdout; the exit status."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    png = plot(report, args.out.with_suffix(".png"))
    report["plot"] = png
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    summary = {k: report[k] for k in ("requests_total", "by_kind", "good_failed", "good_wrong_text", "latency_s",
                                      "hostile_by_status", "faults", "after_pause", "after_term",
                                      "slowed_by_hostile", "abandoned", "end")}
    summary["memory"] = [{k: v.get(k) for k in ("verdict", "rss_mb", "rss_slope_mb_per_min_second_half", "threads")}
                         for v in report["memory"]]
    summary["hostile_one_by_one_statuses"] = dict(Counter(
        label for row in report["hostile_one_by_one"].values() for label in row.values()))
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}" + (f" and {png}" if png else "") + f" ({report['wall_s']:.0f} s)")
    if report["gate"]["passed"]:
        print("soak gate: PASS")
        return 0
    print("soak gate: FAIL\n  - " + "\n  - ".join(report["gate"]["reasons"]))
    return 1


@dataclass
class Server:
    """How the soak starts and stops the server it loads (the caller's: `specbuild.pipeline.serve` in bench/soak.py;
    the load side does not start servers). `start()` returns the server's info (`pid`, `http_url`, `metrics_url`);
    `default_request_timeout_s` is the engine's default bound on a request's life, for the report."""
    start: Callable[[], Any]
    stop: Callable[[], None]
    default_request_timeout_s: float | None = None


def run(args, workdir: Path, server: Server) -> int:
    """The whole soak on `workdir` (deployed): start the server, the hostile cases one by one, the load with its
    faults, the drain, the abandoned-request probe, the report and the gate; the exit status."""
    t_wall = time.monotonic()
    info = [server.start()]
    soak = Soak(args, info, workdir)
    stop_sampling = threading.Event()
    try:
        soak.compute_reference()
        print("hostile cases one by one ...", flush=True)
        one_by_one = soak.hostile_one_by_one()
        total = slots_total(workdir)
        soak.t_start = soak.life_t0 = time.monotonic()
        soak.stub = engine_process(info[0].pid)
        threading.Thread(target=soak.sampler, args=(stop_sampling,), daemon=True).start()
        soak.sample()
        threading.Thread(target=soak.warmup_burst, args=(total,), daemon=True).start()
        faults = load(soak, args, server, total)
        end_of_load, end, drained_s = drain(soak, args, info, total)
        stop_sampling.set()
        soak.sample()
        probe = None
        if args.probe_tokens > 0:
            print(f"abandoned-request probe: {total or 8} x /generate of {args.probe_tokens} tokens, clients give "
                  f"up after {args.abandon_timeout:g}s ...", flush=True)
            probe = soak.abandoned_probe(total)
            end = metrics(info[0].metrics_url)
        abandoned = abandoned_summary(soak, end_of_load, drained_s, probe,
                                      request_timeout(workdir, server.default_request_timeout_s))
        report = build_report(soak, args, workdir, one_by_one, faults, abandoned, total, end)
    finally:
        stop_sampling.set()
        keep_server_log(soak, workdir)
        server.stop()
    report["server_logs"] = soak.server_logs
    report["server_gone"] = server_gone(report)
    report["gate"] = gate(report, args)
    report["wall_s"] = round(time.monotonic() - t_wall, 1)
    return write_report(report, args)
