"""The embedded deployment on a real tritonserver (tiny models through convert -> build -> deploy).

One server for the module (the session-scoped `running_server` of tests/servers.py). Covers HTTP
generate, generate_stream (SSE), gRPC streaming, continuous batching across 16 concurrent streams,
lossless speculation through the server, custom metrics, every refused request, client cancellation,
`infer`, and stop/restart (last: it restarts the shared server).
"""

from __future__ import annotations

import re
import threading
import time

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from click.testing import CliRunner

from specbuild.core import contract
from specbuild.pipeline import serve
from specbuild.pipeline.client import Client, RequestError, grpc_inputs, metric, parse_metrics

pytestmark = pytest.mark.server

PROMPTS = ["The quick brown fox", "Paris is the capital of", "def fibonacci(n):", "Triton Inference Server"]
# min_tokens = max_tokens: a random tiny model may emit EOS early; this keeps every output 16 tokens long.
GEN = {"max_tokens": 16, "min_tokens": 16}
LONG = 1000  # tokens of a request that is cancelled early (max_seq_len is 1024): ~2 s of work on this box


def client(srv, model=contract.ENSEMBLE_MODEL) -> Client:
    return Client(srv.http_url, srv.grpc_url, model=model, timeout=120)


def scrape(srv) -> dict[str, float]:
    return parse_metrics(httpx.get(srv.metrics_url, timeout=10).text)


def wait_metrics(srv, pred, what: str, limit: float = 30.0) -> dict[str, float]:
    """Custom metrics are refreshed by the model's watchdog thread: poll until `pred` holds."""
    deadline = time.monotonic() + limit
    while True:
        m = scrape(srv)
        if pred(m):
            return m
        assert time.monotonic() < deadline, f"metrics never showed {what}: " + str(
            {k: v for k, v in m.items() if k.startswith("specbuild")})
        time.sleep(0.2)


@pytest.fixture(scope="module")
def reference(running_server):
    """Greedy output of every prompt, non-streaming, speculation off (the ground truth)."""
    c = client(running_server, contract.SPECULATIVE_MODEL)
    return {p: c.generate(p, **GEN, num_draft_tokens=0).text for p in PROMPTS}


def test_http_generate(running_server, reference):
    for model in contract.CLIENT_MODELS:
        gen = client(running_server, model).generate(PROMPTS[0], **GEN, return_perf_metrics=True)
        assert gen.text == reference[PROMPTS[0]] and gen.text
        assert gen.total_draft_tokens > 0 and 0 <= gen.total_accepted_draft_tokens <= gen.total_draft_tokens
        assert gen.acceptance_rate == pytest.approx(gen.total_accepted_draft_tokens / gen.total_draft_tokens)
    plain = client(running_server).generate(PROMPTS[0], **GEN)
    assert plain.total_draft_tokens is None  # perf metrics only when asked for
    full = client(running_server).generate(PROMPTS[0], **GEN, exclude_input_in_output=False)
    assert full.text == PROMPTS[0] + reference[PROMPTS[0]]


def test_http_generate_stream_sse(running_server, reference):
    for model in contract.CLIENT_MODELS:
        gen = client(running_server, model).generate_stream(PROMPTS[1], **GEN, return_perf_metrics=True)
        assert "".join(gen.chunks) == reference[PROMPTS[1]]
        assert len(gen.chunks) > 1 and gen.arrivals == sorted(gen.arrivals)
        assert gen.total_draft_tokens > 0


def test_grpc_streaming(running_server, reference):
    for model in contract.CLIENT_MODELS:
        seen = []
        gen = client(running_server, model).grpc_stream(PROMPTS[2], on_chunk=seen.append, **GEN,
                                                        return_perf_metrics=True)
        assert gen.text == reference[PROMPTS[2]] and seen == gen.chunks and len(seen) > 1
        assert gen.total_draft_tokens > 0
    one = client(running_server).grpc_stream(PROMPTS[2], stream=False, **GEN)
    assert one.chunks == [reference[PROMPTS[2]]]


def test_speculation_is_lossless_through_the_server(running_server, reference):
    c = client(running_server, contract.SPECULATIVE_MODEL)
    for k in (1, 2, 4):
        for p in PROMPTS:
            gen = c.generate(p, **GEN, num_draft_tokens=k, return_perf_metrics=True)
            assert gen.text == reference[p], (k, p)
            assert gen.total_draft_tokens > 0
    off = c.generate(PROMPTS[0], **GEN, num_draft_tokens=0, return_perf_metrics=True)
    assert off.total_draft_tokens == 0 and off.text == reference[PROMPTS[0]]
    # seeded sampling is reproducible through the server
    a = c.generate(PROMPTS[1], max_tokens=12, temperature=1.0, seed=11, num_draft_tokens=3)
    b = c.generate(PROMPTS[1], max_tokens=12, temperature=1.0, seed=11, num_draft_tokens=3)
    assert a.text == b.text


def test_16_concurrent_streams_interleave(running_server, reference):
    """A long non-streaming "anchor" request occupies the engine while 15 streams arrive: with continuous
    batching the streams sent while it runs finish before it does (served one at a time, none would). The anchor
    does not stream, so it adds no response traffic that would slow the others' admission. Only streams sent
    before the anchor ended can show it: on a loaded machine the client may send them late, and then the round
    is run again (a precondition of the client's timing, not a tolerance on the server's)."""
    n = 15
    for _ in range(3):
        anchor, results = _anchor_and_streams(running_server, n)
        sent = [g for g in results if g.sent_at < anchor["done"]]
        if len(sent) >= n // 2:
            break
    else:
        pytest.fail(f"the 1000-token anchor ended before half of the {n} streams were sent, 3 times; sent at "
                    f"{sorted(round(g.sent_at - anchor['done'], 3) for g in results)} s from its end")
    # batched output is the same as each prompt alone
    for i, gen in enumerate(results):
        assert "".join(gen.chunks) == reference[PROMPTS[i % 4]]
    # Served one at a time, no stream would end before the anchor; under continuous batching those sent while it
    # ran end beside it. (Not all: on a loaded 2-core box the last ones may be admitted as the anchor ends.)
    ends = sorted(round(g.sent_at + g.arrivals[-1] - anchor["done"], 3) for g in sent)
    beside = sum(e < 0 for e in ends)
    assert beside >= len(sent) // 2, (f"only {beside} of the {len(sent)} streams sent while the anchor ran ended "
                                      f"beside it; their ends relative to the anchor's (s): {ends}")
    m = wait_metrics(running_server, lambda m: metric(m, "specbuild_max_running_requests") >= 2,
                     "a running batch > 1")
    assert metric(m, "specbuild_max_running_requests") >= 2


def _anchor_and_streams(srv, n: int) -> tuple[dict, list]:
    """The anchor (1000 tokens, not streamed) and, once it runs, n streams released together -> (anchor, streams).
    The streams' clients and threads are ready before the anchor starts, so what separates "the anchor runs" from
    the sends is one barrier, not n clients' construction (on a slowed 2-core box that took longer than the anchor)."""
    anchor: dict = {}

    def run_anchor():
        anchor["gen"] = client(srv, contract.SPECULATIVE_MODEL).generate(PROMPTS[0], max_tokens=1000,
                                                                          min_tokens=1000)
        anchor["done"] = time.perf_counter()

    clients = [client(srv, contract.CLIENT_MODELS[i % 2]) for i in range(n)]
    barrier = threading.Barrier(n + 1)                  # the streams and this thread, once the anchor runs
    results: list = [None] * n
    errors: list = []

    def one(i):
        try:
            barrier.wait(timeout=120)
            results[i] = clients[i].generate_stream(PROMPTS[i % 4], **GEN)
        except threading.BrokenBarrierError:
            pass                                        # released without sending: the failure is reported below
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    anchor_thread = threading.Thread(target=run_anchor)
    anchor_thread.start()
    try:
        wait_metrics(srv, lambda m: metric(m, "specbuild_running_requests") >= 1, "the anchor running")
        assert "done" not in anchor, "the anchor finished before the test could start the others"
        barrier.wait(timeout=60)
    except BaseException:
        barrier.abort()
        raise
    finally:
        for t in [*threads, anchor_thread]:
            t.join(timeout=300)
    assert not errors, errors
    assert "done" in anchor, "the anchor did not finish"
    return anchor, results


def test_metrics_present_and_moving(running_server):
    """The counters a client reads after its response include that response: no waiting, no polling (the
    frontend publishes the metrics before it delivers a final reply)."""
    from specbuild.engines.embedded.adaptive import DEFAULT_DRAFT_COST_RATIO
    from specbuild.core.metrics import metric_sum

    before = wait_metrics(running_server, lambda m: metric(m, "specbuild_running_requests") == 0, "an idle engine")
    first = before
    for name in ("specbuild_requests_total", "specbuild_generated_tokens_total", "specbuild_draft_tokens_total",
                 "specbuild_accepted_tokens_total", "specbuild_drafts_total", "specbuild_acceptance_rate",
                 "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens", "specbuild_requests_timed_out_total",
                 "specbuild_queue_full_total", "nv_inference_request_success"):
        assert any(k == name or k.startswith(name + "{") for k in before), name
    c = client(running_server, contract.SPECULATIVE_MODEL)
    c.generate(PROMPTS[3], max_tokens=12, min_tokens=12, num_draft_tokens=0)      # plain steps at one sequence
    before = scrape(running_server)
    assert metric(before, "specbuild_target_step_ms") > 0          # the serving loop has measured a plain step
    for _ in range(3):
        gen = c.generate(PROMPTS[3], max_tokens=12, min_tokens=12, num_draft_tokens=4, return_perf_metrics=True)
        after = scrape(running_server)                    # at once: the counters already include it

        def delta(name):
            return metric(after, name) - metric(before, name)

        assert delta("specbuild_requests_total") == 1 and delta("specbuild_generated_tokens_total") == 12
        assert delta("specbuild_draft_tokens_total") == gen.total_draft_tokens > 0
        assert delta("specbuild_accepted_tokens_total") == gen.total_accepted_draft_tokens
        # the vLLM-schema counters count the same things
        assert delta("vllm:spec_decode_num_draft_tokens") == gen.total_draft_tokens
        assert delta("vllm:spec_decode_num_accepted_tokens") == gen.total_accepted_draft_tokens
        assert delta("vllm:spec_decode_num_drafts") == delta("specbuild_drafts_total") > 0
        per_pos = metric_sum(after, "vllm:spec_decode_num_accepted_tokens_per_pos") - \
            metric_sum(before, "vllm:spec_decode_num_accepted_tokens_per_pos")
        assert per_pos == gen.total_accepted_draft_tokens
        before = after
    drafted, accepted = metric(after, "specbuild_draft_tokens_total"), metric(after, "specbuild_accepted_tokens_total")
    assert metric(after, "specbuild_acceptance_rate") == pytest.approx(accepted / drafted)
    # What adaptive K prices the draft with: with plain and drafting steps measured at one sequence, the draft step
    # over the plain step measured while serving, no longer the uncalibrated build's default c.
    c_now = metric(after, "specbuild_draft_cost_ratio")
    assert c_now > 0 and c_now != pytest.approx(DEFAULT_DRAFT_COST_RATIO, abs=1e-9)
    key = 'nv_inference_request_success{model="tensorrt_llm_bls",version="1"}'   # tritonserver's own counter
    wait_metrics(running_server, lambda m: m.get(key, 0) >= first.get(key, 0) + 4, "Triton's success count")


def _stream_error(srv, model: str, inputs: list) -> str:
    import queue

    q: queue.Queue = queue.Queue()
    c = grpcclient.InferenceServerClient(srv.grpc_url)
    try:
        c.start_stream(callback=lambda result, error: q.put((result, error)))
        c.async_stream_infer(model, inputs, enable_empty_final_response=True)
        result, error = q.get(timeout=60)
        assert error is not None, "request was accepted"
        return error.message()
    finally:
        c.stop_stream()
        c.close()


@pytest.mark.parametrize("model", contract.CLIENT_MODELS)
def test_bad_requests_are_refused_and_the_server_keeps_serving(running_server, reference, model):
    c = client(running_server, model)
    bad_http = [
        ({"max_tokens": 4}, "text_input"),
        ({"text_input": "", "max_tokens": 4}, "text_input is empty"),
        ({"text_input": "hi", "max_tokens": 0}, "max_tokens=0 must be >= 1"),
        ({"text_input": "hi", "max_tokens": -5}, "max_tokens=-5 must be >= 1"),
        ({"text_input": "hi", "max_tokens": 100000}, "exceeds max_seq_len=1024"),
        ({"text_input": "hi " * 700, "max_tokens": 900}, "exceeds max_seq_len=1024"),
        ({"text_input": "x" * 70000, "max_tokens": 4}, "max_prompt_bytes=65536"),
        ({"text_input": "hi", "max_tokens": 4, "stop_words": ["s"] * 17}, "max_stop_words=16"),
        ({"text_input": "hi", "max_tokens": 4, "stop_words": ["s" * 300]}, "max_stop_word_bytes=256"),
    ]
    if model == contract.SPECULATIVE_MODEL:
        bad_http.append(({"text_input": "hi", "max_tokens": 4, "num_draft_tokens": 9},
                         "outside [0, max_draft_len=4]"))
    for body, message in bad_http:
        r = httpx.post(f"{running_server.http_url}/v2/models/{model}/generate", json=body, timeout=60)
        assert r.status_code == 400 and message in r.json()["error"], (body, r.text)
        if "text_input" in body:  # the same refusal on the streaming endpoint
            params = {k: v for k, v in body.items() if k != "text_input"}
            with pytest.raises(RequestError, match=re.escape(message)):
                c.generate_stream(body["text_input"], **params)
    # over gRPC: non-UTF-8 bytes, wrong dtype, wrong shape
    assert "not valid UTF-8" in _stream_error(running_server, model,
                                               grpc_inputs({"text_input": b"\xff\xfeok", "max_tokens": 4}))
    wrong_dtype = grpc_inputs({"text_input": "hi"})
    mt = grpcclient.InferInput("max_tokens", [1, 1], "FP32")
    mt.set_data_from_numpy(np.array([[4.0]], dtype=np.float32))
    assert "data-type" in _stream_error(running_server, model, wrong_dtype + [mt]).lower().replace("datatype",
                                                                                                     "data-type")
    shape = grpcclient.InferInput("text_input", [1, 2], "BYTES")
    shape.set_data_from_numpy(np.array([[b"a", b"b"]], dtype=np.object_))
    assert "shape" in _stream_error(running_server, model, [shape] + grpc_inputs({"max_tokens": 4})).lower()
    # ... and good requests still work
    assert c.generate(PROMPTS[0], **GEN).text == reference[PROMPTS[0]]


@pytest.mark.parametrize("model", contract.CLIENT_MODELS)
def test_client_cancellation_frees_the_slot(running_server, model):
    idle = wait_metrics(running_server, lambda m: metric(m, "specbuild_running_requests") == 0, "an idle engine")
    gen = client(running_server, model).grpc_stream(PROMPTS[0], max_tokens=LONG, min_tokens=LONG,
                                                    cancel_after=2)
    assert len(gen.chunks) == 2
    after = wait_metrics(running_server, lambda m: metric(m, "specbuild_requests_aborted_total")
                         >= metric(idle, "specbuild_requests_aborted_total") + 1
                         and metric(m, "specbuild_running_requests") == 0, "the aborted request")
    made = metric(after, "specbuild_generated_tokens_total") - metric(idle, "specbuild_generated_tokens_total")
    assert made < LONG, "the cancelled request ran to max_tokens"


def test_http_disconnect_frees_the_slot(running_server):
    idle = wait_metrics(running_server, lambda m: metric(m, "specbuild_running_requests") == 0, "an idle engine")
    url = f"{running_server.http_url}/v2/models/{contract.SPECULATIVE_MODEL}/generate_stream"
    with httpx.stream("POST", url, json={"text_input": PROMPTS[1], "max_tokens": LONG, "min_tokens": LONG, "stream": True},
                      timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 2:
                break
    after = wait_metrics(running_server, lambda m: metric(m, "specbuild_requests_aborted_total")
                         >= metric(idle, "specbuild_requests_aborted_total") + 1
                         and metric(m, "specbuild_running_requests") == 0, "the aborted request")
    assert metric(after, "specbuild_generated_tokens_total") - metric(idle, "specbuild_generated_tokens_total") < LONG


def test_infer_cli(running_server, reference):
    from specbuild.cli.main import cli

    runner = CliRunner(mix_stderr=False) if "mix_stderr" in CliRunner.__init__.__code__.co_varnames else CliRunner()
    base = ["infer", "--url", running_server.http_url, "--grpc-url", running_server.grpc_url, "--max-tokens", "16",
            "--min-tokens", "16"]
    for extra in ([], ["--protocol", "grpc"], ["--no-stream", "--num-draft-tokens", "2"]):
        res = runner.invoke(cli, base + ["--prompt", PROMPTS[0], *extra])
        assert res.exit_code == 0, res.output
        assert res.stdout == reference[PROMPTS[0]] + "\n"
        assert "acceptance rate" in res.stderr and "drafted" in res.stderr
    # without --url: the server recorded in --workdir by `specbuild serve`
    res = runner.invoke(cli, ["infer", "--workdir", str(running_server.workdir), "--max-tokens", "16",
                              "--min-tokens", "16", "--prompt", PROMPTS[0]])
    assert res.exit_code == 0 and res.stdout == reference[PROMPTS[0]] + "\n", res.output
    res = runner.invoke(cli, base + ["--prompt", PROMPTS[0], "--model", "ensemble", "--num-draft-tokens", "2"])
    assert res.exit_code == 2
    res = runner.invoke(cli, base + ["--prompt", "", "--no-stream"])
    assert res.exit_code == 1 and "text_input is empty" in res.stderr


def test_stop_frees_everything_and_restart_serves_again(running_server, reference):
    """stop (no process left, ports free), then start again on the same ports: the server answers as before."""
    old = running_server.info
    log = open(old.log_file, errors="replace").read()
    assert "Signal (11)" not in log and "Signal (6)" not in log, "tritonserver crashed during the module"
    stopped = running_server.stop()
    assert stopped.pid == old.pid
    assert not serve._alive(old.pid) and not serve._group_members(old.pid)
    assert all(serve.port_free("127.0.0.1", p) for p in (old.http_port, old.grpc_port, old.metrics_port))
    running_server.info = serve.start(running_server.workdir, running_server.options)
    assert running_server.info.pid != old.pid and running_server.http_url == old.http_url
    assert client(running_server).generate(PROMPTS[0], **GEN).text == reference[PROMPTS[0]]
    assert client(running_server).grpc_stream(PROMPTS[0], **GEN).text == reference[PROMPTS[0]]


def _hostile_bodies(n: int) -> list[dict]:
    """Malformed and numerically hostile requests (JSON carries NaN/Infinity as Python's json writes them)."""
    kinds = [{"temperature": float("nan")}, {"temperature": float("inf")}, {"temperature": 1e-40},
             {"temperature": 3e38}, {"top_p": float("nan")}, {"top_p": 1e-30, "temperature": 1.0},
             {"top_p": float("-inf")}, {"top_k": 2 ** 31 - 1, "temperature": 0.9}, {"max_tokens": 2 ** 31 - 1},
             {"max_tokens": -1}, {"text_input": "z" * 70000}, {"stop_words": ["w" * 5000]},
             {"stop_words": ["a"] * 100}, {"temperature": "warm"}, {"max_tokens": "many"}, {"text_input": 42},
             {"seed": -1}, {"min_tokens": -3}, {"text_input": ""}, {}]
    out = []
    for i in range(n):
        body = {"text_input": PROMPTS[i % len(PROMPTS)], "max_tokens": 3}
        body.update(kinds[i % len(kinds)])
        out.append(body)
    return out


def test_storm_of_hostile_requests_beside_good_ones(running_server, reference):
    """1000 malformed / numerically hostile requests from 8 threads beside 8 threads of good ones (streaming
    and not, with and without speculation): every good request returns its reference text, every hostile one
    gets an answer (a refusal or a short generation), the server stays ready and no slot is leaked."""
    import json as _json
    from concurrent.futures import ThreadPoolExecutor

    url = running_server.http_url
    bodies = _hostile_bodies(1000)
    stop = threading.Event()
    good_results: list[tuple[str, str]] = []
    errors: list[str] = []

    def hostile(chunk):
        codes = []                  # (index into bodies, status)
        with httpx.Client(timeout=120) as h:
            for i in chunk:
                b = bodies[i]
                r = h.post(f"{url}/v2/models/{contract.SPECULATIVE_MODEL}/generate",
                           content=_json.dumps(b), headers={"content-type": "application/json"})
                codes.append((i, r.status_code))
                if r.status_code == 500:
                    errors.append(r.text[:300])
        return codes

    def good(w):
        c = client(running_server, contract.CLIENT_MODELS[w % 2])
        n = 0
        while not stop.is_set() or n < 2:
            p = PROMPTS[(w + n) % len(PROMPTS)]
            gen = c.generate_stream(p, **GEN) if n % 2 else c.generate(p, **GEN)
            good_results.append((p, gen.text))
            n += 1

    with ThreadPoolExecutor(16) as pool:
        goods = [pool.submit(good, w) for w in range(8)]
        storms = [pool.submit(hostile, range(i, len(bodies), 8)) for i in range(8)]
        codes = [c for _, c in sorted(c for f in storms for c in f.result())]
        stop.set()
        for f in goods:
            f.result()
    # 400: refused by the frontend (or Triton: wrong shape); 500: Triton's own JSON parser refusing a
    # wrong JSON type before the model sees it; 200: a hostile but valid request (e.g. temperature 1e-40)
    wrong_type = [isinstance(b.get("text_input"), int) or any(isinstance(b.get(k), str) for k in
                  ("temperature", "max_tokens")) or b.get("seed", 0) < 0 for b in bodies]
    assert len(codes) == 1000
    assert all(c in ((500, 400) if w else (200, 400)) for c, w in zip(codes, wrong_type)), \
        [(c, b) for c, w, b in zip(codes, wrong_type, bodies) if c not in ((500, 400) if w else (200, 400))][:3] + \
        sorted(set(errors))[:5]
    assert codes.count(400) > 500
    assert good_results and all(text == reference[p] for p, text in good_results), \
        [p for p, t in good_results if t != reference[p]][:5]
    assert httpx.get(f"{url}/v2/health/ready", timeout=10).status_code == 200
    m = wait_metrics(running_server, lambda m: metric(m, "specbuild_live_requests") == 0
                     and metric(m, "specbuild_running_requests") == 0, "an idle engine after the storm")
    assert metric(m, "specbuild_slots_free") == 16
    assert client(running_server).generate(PROMPTS[0], **GEN).text == reference[PROMPTS[0]]
