"""Continuous batching and streaming: requests joining and leaving between steps with different K and
proposers equal their single-sequence outputs; streaming deltas; abort; limits; the serving thread."""

from __future__ import annotations

import threading

import pytest
from transformers import AutoTokenizer

from specbuild.engines.embedded import Engine, EngineLimitError, SamplingParams, StreamDelta
from specbuild.engines.embedded.detok import IncrementalDetokenizer

PROMPTS = ["The quick brown fox", "def fibonacci(n):\n", "Paris is the capital of", "import os\n",
           "Summarize the text:"]
# (prompt index, max_tokens, K, proposer, temperature, seed)
MIX = [(0, 20, 3, "draft", 0.0, None), (1, 12, 0, "draft", 0.0, None), (2, 18, 5, "ngram", 0.0, None),
       (3, 9, 1, "draft", 1.0, 11), (4, 16, 4, "draft", 0.8, 5), (0, 7, 2, "ngram", 1.0, 3)]



pytestmark = pytest.mark.usefixtures("one_torch_thread")

@pytest.fixture(scope="module")
def eng(tiny_llama, tiny_llama_draft):
    return Engine.from_checkpoints(tiny_llama, tiny_llama_draft, max_batch_size=3, max_seq_len=96, max_draft_len=6)


def _params(max_tokens, temperature, seed):
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True)


@pytest.fixture(scope="module")
def singles(eng):
    return [eng.generate(PROMPTS[p], _params(m, t, s), num_draft_tokens=k, proposer=prop)
            for p, m, k, prop, t, s in MIX]


class Collector:
    def __init__(self):
        self.deltas: dict[str, list[StreamDelta]] = {}
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.expected = 0

    def __call__(self, d: StreamDelta):
        with self.lock:
            self.deltas.setdefault(d.request_id, []).append(d)
            if d.finished and sum(1 for v in self.deltas.values() if v[-1].finished) == self.expected:
                self.done.set()

    def finished(self, rid) -> bool:
        return bool(self.deltas.get(rid)) and self.deltas[rid][-1].finished


def test_mixed_batch_with_arrivals_equals_single_sequence_outputs(eng, singles):
    col = Collector()
    col.expected = len(MIX)
    sched = eng.scheduler
    rids: list[str] = []

    def submit(i):
        p, m, k, prop, t, s = MIX[i]
        rids.append(eng.submit(PROMPTS[p], _params(m, t, s), num_draft_tokens=k, proposer=prop, on_output=col))

    submit(0)
    submit(1)
    sched.step()
    sched.step()
    for i in range(2, len(MIX)):            # more requests than slots: some wait in the queue
        submit(i)
    m = eng.metrics()
    assert m["running"] == 2 and m["waiting"] == 4
    sched.step()
    assert eng.metrics()["running"] == 3
    for _ in range(200):
        if col.done.is_set():
            break
        sched.step()
    assert col.done.is_set()
    for rid, single in zip(rids, singles):
        deltas = col.deltas[rid]
        assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished
        assert deltas[-1].stats is not None and deltas[-1].finish_reason == single.finish_reason == "length"
        assert [t for d in deltas for t in d.token_ids] == single.token_ids       # greedy and seeded sampling
        assert "".join(d.text for d in deltas) == single.text
    assert eng.metrics()["running"] == 0 and sched.slots.num_free == 3


def test_generate_batch_equals_singles(eng, singles):
    outs = eng.generate_batch([(PROMPTS[p], _params(m, t, s), k) for p, m, k, prop, t, s in MIX if prop == "draft"])
    ref = [o for o, mix in zip(singles, MIX) if mix[3] == "draft"]
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_abort_mid_generation_frees_the_slot_at_once(eng):
    col = Collector()
    long = SamplingParams(max_tokens=60, ignore_eos=True)
    rid = eng.submit(PROMPTS[0], long, num_draft_tokens=2, on_output=col)
    fillers = [eng.submit(PROMPTS[i], long, num_draft_tokens=0, on_output=col) for i in (1, 2)]
    waiting = eng.submit(PROMPTS[3], long, on_output=col)
    eng.scheduler.step()
    eng.scheduler.step()
    assert eng.metrics()["running"] == 3 and eng.metrics()["waiting"] == 1 and eng.scheduler.slots.num_free == 0
    assert not col.finished(rid) and col.deltas[rid]
    eng.abort(rid)
    assert eng.scheduler.slots.num_free == 1                 # at once, not at the next step
    last = col.deltas[rid][-1]
    assert last.finished and last.finish_reason == "abort" and last.stats is not None
    eng.abort(rid)                                           # idempotent
    eng.abort("no-such-request")
    eng.abort(waiting)                                       # still in the queue
    assert col.deltas[waiting][-1].finish_reason == "abort" and eng.metrics()["waiting"] == 0
    n = len(col.deltas[rid])
    eng.scheduler.step()
    assert len(col.deltas[rid]) == n                         # nothing more for an aborted request
    for f in fillers:
        eng.abort(f)
    assert eng.metrics()["running"] == 0 and eng.scheduler.slots.num_free == 3


def test_limit_errors(eng):
    with pytest.raises(EngineLimitError, match="empty"):
        eng.generate("", SamplingParams(max_tokens=4))
    with pytest.raises(EngineLimitError, match="empty"):
        eng.generate([], SamplingParams(max_tokens=4))
    with pytest.raises(EngineLimitError, match="max_seq_len=96"):
        eng.generate(PROMPTS[0], SamplingParams(max_tokens=95))
    with pytest.raises(EngineLimitError, match="max_draft_len=6"):
        eng.generate(PROMPTS[0], SamplingParams(max_tokens=4), num_draft_tokens=7)
    with pytest.raises(EngineLimitError, match="num_draft_tokens=-2"):     # -1 means adaptive K
        eng.generate(PROMPTS[0], SamplingParams(max_tokens=4), num_draft_tokens=-2)
    with pytest.raises(EngineLimitError, match="proposer 'medusa'"):
        eng.generate(PROMPTS[0], SamplingParams(max_tokens=4), proposer="medusa")
    with pytest.raises(EngineLimitError, match="token ids"):
        eng.generate([1, 10**6], SamplingParams(max_tokens=4))
    for end_id in (10**6, -1):
        with pytest.raises(EngineLimitError, match=r"end_id / stop token ids must be in \[0, "):
            eng.generate(PROMPTS[0], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=(end_id,)))
    assert eng.metrics()["waiting"] == 0 and eng.metrics()["running"] == 0


def test_edge_lengths_one_token_prompt_and_full_context(eng):
    for k in (0, 5):
        one = eng.generate([7], SamplingParams(max_tokens=10, ignore_eos=True), num_draft_tokens=k)
        assert len(one.token_ids) == 10
        full = eng.generate([7] * 86, SamplingParams(max_tokens=10, ignore_eos=True), num_draft_tokens=k)
        assert len(full.token_ids) == 10                        # 86 + 10 = max_seq_len: the last position is used
    ref = eng.generate([7] * 86, SamplingParams(max_tokens=10, ignore_eos=True), num_draft_tokens=0)
    assert full.token_ids == ref.token_ids


def test_failing_consumer_aborts_only_its_request(eng):
    def boom(d):
        raise RuntimeError("client went away")

    col = Collector()
    eng.submit(PROMPTS[0], SamplingParams(max_tokens=10, ignore_eos=True), on_output=boom)
    ok = eng.submit(PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True), on_output=col)
    for _ in range(50):
        if col.finished(ok):
            break
        eng.scheduler.step()
    assert col.deltas[ok][-1].finish_reason == "length" and eng.metrics()["running"] == 0


def test_serving_thread_with_concurrent_submitters(eng, singles):
    col = Collector()
    col.expected = 4
    rids: dict[int, str] = {}
    eng.start()
    try:
        def client(i):
            p, m, k, prop, t, s = MIX[i]
            rids[i] = eng.submit(PROMPTS[p], _params(m, t, s), num_draft_tokens=k, proposer=prop, on_output=col)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=30)
        assert col.done.wait(timeout=120)
        for i, rid in rids.items():
            assert [t for d in col.deltas[rid] for t in d.token_ids] == singles[i].token_ids
        out = eng.generate(PROMPTS[0], _params(20, 0.0, None), num_draft_tokens=3)   # via the thread
        assert out.token_ids == singles[0].token_ids
        before = eng.metrics()
        assert before["requests_total"] >= 5 and before["generated_tokens_total"] > 0
        assert before["draft_tokens_total"] >= before["accepted_tokens_total"] > 0
        assert len(before["accepted_per_pos"]) >= 3 and before["drafts_total"] > 0
    finally:
        eng.shutdown()
    assert eng._thread is None


def test_incremental_detokenizer_holds_back_incomplete_utf8(tiny_tokenizer):
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    text = " héllo wörld ☃ naïve"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, tok.encode("Say:"))
    pieces = []
    for t in ids:
        d.add(t)
        pieces.append(d.flush(False))
    pieces.append(d.flush(True))
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) == text
    assert any(p == "" for p in pieces)                 # a multi-byte char spans tokens and was held back
