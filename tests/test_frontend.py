"""The serving frontend without a server: parsing and caps, concurrency (many threads submitting, cancelling
and storming with hostile requests beside good ones), admission (bounded queue, queue-time limit),
containment (one failing sequence stops alone), metrics pushed, and close() stopping its threads."""

from __future__ import annotations

import math
import random
import threading

import numpy as np
import pytest

from specbuild.engines.embedded import Engine, SamplingParams
from specbuild.engines.embedded.frontend import BadRequest, Frontend, RequestLimits, parse_request

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The quick brown fox", "Paris is the capital of", "def fibonacci(n):", "import os\n"]
WAIT = 120  # seconds; generous for a slow shared machine (never reached when things work)


def tensors(**kw):
    out = {}
    for k, v in kw.items():
        if isinstance(v, str):
            v = v.encode()
        out[k] = np.array([[v]], dtype=np.object_ if isinstance(v, bytes) else None)
    return out.get


def good(prompt, **kw):
    return tensors(**{"text_input": prompt, "max_tokens": 12, "min_tokens": 12, **kw})


class Sink:
    """A response sender: collects replies, `done` once the final one arrived."""

    def __init__(self):
        self.replies, self.done = [], threading.Event()

    def __call__(self, reply):
        assert not self.done.is_set(), "a reply after the final one"
        self.replies.append(reply)
        if reply.final:
            self.done.set()

    @property
    def text(self):
        return "".join(r.text for r in self.replies)

    @property
    def error(self):
        return self.replies[-1].error if self.replies else None

    @property
    def kind(self):
        return self.replies[-1].kind if self.replies else None


@pytest.fixture()
def eng(tiny_llama, tiny_llama_draft):
    e = Engine.from_checkpoints(tiny_llama, tiny_llama_draft, max_batch_size=3, max_seq_len=96, max_draft_len=4)
    yield e
    e.shutdown()


@pytest.fixture()
def reference(eng):
    return {p: eng.generate(p, SamplingParams(max_tokens=12, min_tokens=12), num_draft_tokens=0).text
            for p in PROMPTS}


# ---- parsing --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    ({"max_tokens": 4}, "text_input is missing"),
    ({"text_input": "", "max_tokens": 4}, "text_input is empty"),
    ({"text_input": "x" * 70000, "max_tokens": 4}, "max_prompt_bytes=65536"),
    ({"text_input": "hi"}, "max_tokens is missing"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens=0 must be >= 1"),
    ({"text_input": "hi", "max_tokens": 4, "temperature": float("nan")}, "temperature=nan must be a finite"),
    ({"text_input": "hi", "max_tokens": 4, "temperature": float("inf")}, "temperature=inf must be a finite"),
    ({"text_input": "hi", "max_tokens": 4, "temperature": -1.0}, "temperature=-1.0 must be"),
    ({"text_input": "hi", "max_tokens": 4, "top_p": float("nan")}, "top_p=nan must be in (0, 1]"),
    ({"text_input": "hi", "max_tokens": 4, "top_p": 1.5}, "top_p=1.5 must be in (0, 1]"),
    ({"text_input": "hi", "max_tokens": 4, "top_k": -3}, "top_k=-3 must be >= 0"),
    ({"text_input": "hi", "max_tokens": 4, "temperature": "hot"}, "temperature must be a number"),
    ({"text_input": b"\xff\xfe", "max_tokens": 4}, "not valid UTF-8"),
])
def test_parse_refuses_with_the_limit_named(kw, message):
    with pytest.raises(BadRequest) as e:
        parse_request(tensors(**kw))
    assert message in str(e.value)


def test_stop_word_caps_and_defaults():
    limits = RequestLimits(max_stop_words=3, max_stop_word_bytes=4)
    words = lambda *w: {"text_input": np.array([[b"hi"]], dtype=np.object_), "max_tokens": np.array([[4]]),
                        "stop_words": np.array([[s.encode() for s in w]], dtype=np.object_)}.get  # noqa: E731
    assert parse_request(words("a", "", "b"), limits).params.stop == ("a", "b")   # empty words dropped
    with pytest.raises(BadRequest, match="max_stop_words=3"):
        parse_request(words("a", "b", "c", "d"), limits)
    with pytest.raises(BadRequest, match="max_stop_word_bytes=4"):
        parse_request(words("abcdefgh"), limits)
    p = parse_request(tensors(text_input="hi", max_tokens=4, top_p=0.0, min_length=9, temperature=1e-40))
    assert p.params.top_p == 1.0 and p.params.min_tokens == 4 and p.params.greedy   # 0 = off; clamp; tiny T
    assert not p.options.stream and p.options.num_draft_tokens is None


# ---- lifecycle ------------------------------------------------------------------------------------
def test_concurrent_storm_beside_good_requests(eng, reference):
    """8 threads: good requests (must equal the reference), hostile ones (refused or run alone), and
    cancellations racing the engine. At the end: no entry, no slot, no thread left."""
    fe = Frontend(eng)
    fe.start()
    hostile = [dict(temperature=float("nan")), dict(temperature=float("inf")), dict(temperature=1e-40),
               dict(temperature=1e30), dict(top_p=1e-30, temperature=1.0), dict(top_p=float("nan")),
               dict(top_k=10 ** 9, temperature=0.7), dict(max_tokens=10 ** 6), dict(max_tokens=-1),
               dict(text_input="y" * 100000), dict(temperature="x")]
    results, lock = [], threading.Lock()
    rng = random.Random(0)

    def worker(w):
        for i in range(6):
            prompt = PROMPTS[(w + i) % len(PROMPTS)]
            sink, key = Sink(), f"w{w}-{i}"
            if i % 3 == 1:
                kw = dict(text_input=prompt, max_tokens=12, min_tokens=0, **{})
                kw.update(hostile[(w * 6 + i) % len(hostile)])
                fe.handle(tensors(**kw), sink, key)
                cancel = False
            else:
                fe.handle(good(prompt, stream=bool(i % 2), num_draft_tokens=rng.choice([0, 2, 4]),
                               exclude_input_in_output=True), sink, key)
                cancel = (w + i) % 5 == 0
                if cancel:
                    fe.cancel(key)
            assert sink.done.wait(WAIT), key
            with lock:
                results.append((prompt, i % 3 != 1, cancel, sink))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT * 2)
    assert len(results) == 48
    for prompt, is_good, cancelled, sink in results:
        if is_good and not cancelled:
            assert sink.error is None and sink.text == reference[prompt]
        elif not is_good:
            assert sink.error is None or sink.kind in ("invalid", "internal"), sink.error
    m = fe.metrics()
    assert m["live"] == 0 and m["slots_free"] == 3 and m["running"] == 0 and m["waiting"] == 0
    assert m["requests_refused_invalid_total"] >= 1
    fe.close(timeout=5)
    assert not fe._sender.is_alive() and eng._thread is None


def test_bounded_queue_and_queue_time_limit(eng):
    eng.set_admission(max_queue_size=1, queue_timeout_s=5.0)
    now = [0.0]
    eng.scheduler.clock = lambda: now[0]
    fe = Frontend(eng)
    fe.start(run_engine=False)              # the test steps the engine itself
    sinks = [Sink() for _ in range(6)]
    for i in range(4):                      # 3 slots ...
        fe.handle(good(PROMPTS[i], max_tokens=60, min_tokens=60), sinks[i], f"r{i}")
        if i < 3:
            eng.scheduler.step()
    fe.handle(good(PROMPTS[0]), sinks[4], "r4")   # ... 1 waiting: the next is refused at once
    assert sinks[4].done.wait(WAIT) and sinks[4].kind == "unavailable" and "max_queue_size=1" in sinks[4].error
    now[0] = 10.0                           # r3 has waited 10 s > 5 s
    eng.scheduler.step()
    assert sinks[3].done.wait(WAIT) and sinks[3].kind == "unavailable" and "queue_timeout_s=5" in sinks[3].error
    for k in ("r0", "r1", "r2"):
        assert fe.cancel(k)
    for s in sinks[:3]:
        assert s.done.wait(WAIT) and s.error is None
    assert fe.live() == 0 and eng.metrics()["slots_free"] == 3
    fe.close()


def test_a_queue_size_of_0_means_no_limit(eng):
    """--max-queue-size 0 (as Triton's own max_queue_size 0) lets any number wait: it used to refuse every request,
    since each one waits for its first step."""
    eng.set_admission(max_queue_size=0)
    assert eng.config.queue_limit is None and eng.scheduler.admission.max_waiting is None
    fe = Frontend(eng)
    fe.start(run_engine=False)
    sinks = {f"r{i}": Sink() for i in range(8)}     # 3 slots, 5 wait
    for i, (rid, sink) in enumerate(sinks.items()):
        fe.handle(good(PROMPTS[i % len(PROMPTS)]), sink, rid)
    assert fe.metrics()["queue_limit"] == 0
    _step_until_done(eng, sinks)
    assert all(s.error is None and s.text for s in sinks.values())
    fe.close()


def _step_until_done(eng, sinks: dict) -> None:
    """Drive the scheduler by hand (the frontend runs without its engine thread) until every sink has its end."""
    for _ in range(100):
        if all(s.done.is_set() for s in sinks.values()):
            break
        eng.scheduler.step()
    for s in sinks.values():
        assert s.done.wait(WAIT)


def test_a_failing_sequence_stops_alone(eng, reference, monkeypatch):
    """NaN logits for one sampled request, and a detokenizer bug in another: each fails with a clear error,
    the batch-level failure is retried per sequence and the greedy requests are untouched."""
    fe = Frontend(eng)
    fe.start(run_engine=False)
    orig_score = eng.scorer.score

    def score(seqs, drafts, **kw):
        out = orig_score(seqs, drafts, **kw)
        return [lg.fill_(math.nan) if s.request_id == "nan" else lg for s, lg in zip(seqs, out)]

    monkeypatch.setattr(eng.scorer, "score", score)
    sinks = {k: Sink() for k in ("good0", "nan", "good1")}
    fe.handle(good(PROMPTS[0], exclude_input_in_output=True), sinks["good0"], "good0")
    fe.handle(good(PROMPTS[1], temperature=0.8, seed=1), sinks["nan"], "nan")
    fe.handle(good(PROMPTS[2], exclude_input_in_output=True), sinks["good1"], "good1")
    eng.scheduler.step()                    # admit + first step
    seq = eng.scheduler.by_id["good1"]
    seq.detok.add = lambda t: (_ for _ in ()).throw(RuntimeError("detok bug"))
    _step_until_done(eng, sinks)
    assert sinks["good0"].error is None and sinks["good0"].text == reference[PROMPTS[0]]
    assert sinks["nan"].kind == "internal" and "not finite" in sinks["nan"].error
    assert sinks["good1"].kind == "internal" and "detok bug" in sinks["good1"].error
    assert fe.live() == 0 and eng.metrics()["slots_free"] == 3
    fe.close()


def test_an_out_of_vocab_end_id_is_a_400_and_harms_no_other_request(eng, reference):
    """Issue 28 probe 1: an end_id outside the vocabulary with min_tokens >= 1 used to index the logits in the
    prefill step (IndexError) and fail every request admitted in that step. Released with good ones, it is
    refused alone (invalid, naming end_id) and the good ones are served their reference texts."""
    fe = Frontend(eng)
    fe.start(run_engine=False)
    sinks = {k: Sink() for k in ("good0", "bad", "good1", "neg")}
    fe.handle(good(PROMPTS[0], exclude_input_in_output=True), sinks["good0"], "good0")
    fe.handle(good(PROMPTS[1], end_id=10 ** 6), sinks["bad"], "bad")
    fe.handle(good(PROMPTS[2], exclude_input_in_output=True), sinks["good1"], "good1")
    fe.handle(good(PROMPTS[3], end_id=-1), sinks["neg"], "neg")
    _step_until_done(eng, sinks)
    for bad in ("bad", "neg"):
        assert sinks[bad].kind == "invalid" and "end_id" in sinks[bad].error, sinks[bad].error
    assert sinks["good0"].error is None and sinks["good0"].text == reference[PROMPTS[0]]
    assert sinks["good1"].error is None and sinks["good1"].text == reference[PROMPTS[2]]
    assert fe.live() == 0 and eng.metrics()["slots_free"] == 3
    fe.close()


def test_a_first_token_that_fails_stops_only_its_request(eng, reference):
    """The step that samples the first tokens of a prefill chunk handles each request alone (as `_stage` does):
    one whose first token cannot be chosen (here: a stop id past the logits, set behind the range check) fails
    with its error; the others admitted in the same step are served."""
    fe = Frontend(eng)
    fe.start(run_engine=False)
    sinks = {k: Sink() for k in ("good0", "bad", "good1")}
    fe.handle(good(PROMPTS[0], exclude_input_in_output=True), sinks["good0"], "good0")
    fe.handle(good(PROMPTS[1]), sinks["bad"], "bad")
    fe.handle(good(PROMPTS[2], exclude_input_in_output=True), sinks["good1"], "good1")
    eng.scheduler.by_id["bad"].stop_ids = frozenset({10 ** 6})
    _step_until_done(eng, sinks)
    assert sinks["bad"].kind == "internal" and "first token" in sinks["bad"].error, sinks["bad"].error
    assert sinks["good0"].error is None and sinks["good0"].text == reference[PROMPTS[0]]
    assert sinks["good1"].error is None and sinks["good1"].text == reference[PROMPTS[2]]
    assert fe.live() == 0 and eng.metrics()["slots_free"] == 3
    fe.close()


def test_metrics_are_pushed_and_close_stops_threads(eng):
    pushed = []
    fe = Frontend(eng, metrics_sink=pushed.append, metrics_interval_s=0.0)
    fe.start()
    sink = Sink()
    fe.handle(good(PROMPTS[0], max_tokens=80, min_tokens=80), sink, "long")
    while not pushed or pushed[-1]["running"] == 0:     # bounded by the request itself
        if sink.done.wait(0.01):
            break
    fe.close(timeout=5)                     # the live request ends (empty final), threads are gone
    assert sink.done.is_set() and sink.replies[-1].final
    assert not fe._sender.is_alive() and eng._thread is None
    assert pushed and pushed[-1]["live"] == 0
    late = Sink()
    fe.handle(good(PROMPTS[0]), late, "late")
    assert late.kind == "unavailable" and "shutting down" in late.error


def test_request_timeout_frees_the_slots_of_vanished_clients(tiny_llama, tiny_llama_draft):
    """Two non-streaming clients gave up without the server hearing of it (tritonserver 2.51 never reports a
    dropped HTTP /generate, server#7077) and hold every slot: at request_timeout_s they are ended with a
    "timeout" error and a waiting request gets a slot."""
    eng = Engine.from_checkpoints(tiny_llama, tiny_llama_draft, max_batch_size=2, max_seq_len=256, max_draft_len=4,
                                  request_timeout_s=30.0)
    now = [0.0]
    eng.scheduler.clock = lambda: now[0]
    fe = Frontend(eng)
    fe.start(run_engine=False)
    gone = [Sink(), Sink()]
    for i, sink in enumerate(gone):
        fe.handle(good(PROMPTS[i], max_tokens=200, min_tokens=200), sink, f"gone{i}")
    eng.scheduler.step()
    now[0] = 20.0
    waiting = Sink()
    fe.handle(good(PROMPTS[2]), waiting, "new")
    eng.scheduler.step()
    assert eng.metrics()["slots_free"] == 0 and eng.metrics()["waiting"] == 1 and not waiting.done.is_set()
    now[0] = 31.0                                   # the first two have lived 31 s > 30 s; "new" 11 s
    for _ in range(100):
        if waiting.done.is_set():
            break
        eng.scheduler.step()
    for sink in gone:
        assert sink.done.wait(WAIT) and sink.kind == "timeout" and "request_timeout_s=30" in sink.error
    assert waiting.done.wait(WAIT) and waiting.error is None and waiting.text
    m = fe.metrics()
    assert m["requests_timed_out_total"] == 2 and m["request_timeouts_total"] == 2 and m["slots_free"] == 2
    assert fe.live() == 0
    fe.close()
