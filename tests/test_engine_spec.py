"""Speculative decoding end to end on tiny real checkpoints: lossless greedy output for the draft and n-gram
proposers, KV rollback, every stop condition, seeds, and the sampled distribution under speculation."""

from __future__ import annotations

import pytest
import torch

from specbuild.engines.embedded import Engine, EngineLimitError, SamplingParams
from specbuild.engines.embedded.model import ragged_forward
from specbuild.engines.embedded.sampling import processed_probs
from specbuild.core.errors import SourceError

PROMPTS = ["The quick brown fox", "def fibonacci(n):\n", "Paris is the capital of"]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)



pytestmark = pytest.mark.usefixtures("one_torch_thread")

@pytest.fixture(scope="module")
def eng(tiny_llama, tiny_llama_draft):
    """Target with an unrelated draft: almost every draft is rejected."""
    return Engine.from_checkpoints(tiny_llama, tiny_llama_draft, max_batch_size=4, max_seq_len=128)


@pytest.fixture(scope="module")
def plain(eng):
    return {p: eng.generate(p, GREEDY, num_draft_tokens=0) for p in PROMPTS}


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_spec_equals_target_only(eng, eng_self, plain, k):
    drafted = accepted = 0
    for p in PROMPTS:
        base = plain[p]
        assert len(base.token_ids) == 24 and base.stats.num_draft_tokens == 0
        bad = eng.generate(p, GREEDY, num_draft_tokens=k, proposer="draft")
        good = eng_self.generate(p, GREEDY, num_draft_tokens=k, proposer="draft")
        ngram = eng.generate(p, GREEDY, num_draft_tokens=k, proposer="ngram")
        for out in (bad, good, ngram):
            assert out.token_ids == base.token_ids and out.text == base.text
        assert good.stats.acceptance_rate == 1.0
        assert good.stats.mean_accepted_length == pytest.approx(1 + k, rel=0.35)   # last round may be short
        assert bad.stats.num_accepted_tokens < bad.stats.num_draft_tokens           # rejections happened
        drafted += bad.stats.num_draft_tokens
        accepted += bad.stats.num_accepted_tokens
    # The random tiny models both fall into repetitions, so the unrelated draft is right on those stretches.
    assert accepted / drafted < 0.5


def test_streamed_text_equals_full_decode(eng, plain):
    out = plain[PROMPTS[0]]
    assert out.text and out.text == eng.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_qwen2_target_with_ngram_speculation(tiny_qwen2):
    e = Engine.from_checkpoints(tiny_qwen2, max_batch_size=2, max_seq_len=96)
    assert e.config.policy.proposer == "ngram" and not e.config.has_draft
    for p in PROMPTS[:2]:
        base = e.generate(p, GREEDY, num_draft_tokens=0)
        assert e.generate(p, GREEDY, num_draft_tokens=4).token_ids == base.token_ids
    with pytest.raises(EngineLimitError, match="no draft model"):
        e.generate(p, GREEDY, num_draft_tokens=2, proposer="draft")


def test_kv_cache_is_consistent_after_rejections(eng):
    """After every step, the target cache of the live sequence equals a fresh prefill of its accepted tokens."""
    sched, cache = eng.scheduler, eng.scorer.cache
    rid = eng.submit(PROMPTS[0], GREEDY, num_draft_tokens=4, proposer="draft", on_output=lambda d: None)
    seq = sched.by_id[rid]
    rejections = 0
    while not seq.finished:
        n_before = len(seq.tokens)
        sched.step()
        if seq.finished:
            break
        rejections += (len(seq.tokens) - n_before) < 5
        assert seq.target_len == len(seq.tokens) - 1 and seq.draft_len <= len(seq.tokens) - 1
        ref = eng.scorer.cache.__class__(num_layers=eng.target.cfg.num_layers, num_slots=1,
                                         kv_heads=eng.target.cfg.num_kv_heads, max_seq=128,
                                         head_dim=eng.target.cfg.head_dim, dtype=torch.float32, device="cpu")
        ragged_forward(eng.target, ref, [0], [0], [seq.tokens[:seq.target_len]], "none")
        n = seq.target_len
        for layer in (0, eng.target.cfg.num_layers - 1):
            torch.testing.assert_close(cache.k[layer][seq.slot, :, :n], ref.k[layer][0, :, :n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cache.v[layer][seq.slot, :, :n], ref.v[layer][0, :, :n], atol=1e-5, rtol=1e-5)
    assert rejections > 0


def test_int8_draft_and_build_dir_layout(tmp_path, tiny_llama, plain):
    """An int8 copy of the target as draft (quant.py) through an engine dir laid out like the build stage's."""
    import json
    import shutil

    eng_dir = tmp_path / "engine"
    shutil.copytree(tiny_llama, eng_dir / "target")
    shutil.copytree(tiny_llama, eng_dir / "draft")
    (eng_dir / "tokenizer").mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.move(eng_dir / "target" / f, eng_dir / "tokenizer" / f)
    (eng_dir / "engine_config.json").write_text(json.dumps({
        "target": "target", "draft": "draft", "draft_format": "hf-safetensors", "draft_quantize": "int8",
        "tokenizer": "tokenizer", "max_batch_size": 2, "max_seq_len": 64, "max_draft_len": 5, "dtype": "float32",
        "device": "cpu", "threads": None, "policy": {"k": 3, "proposer": "draft"}}))
    e = Engine.from_build_dir(eng_dir)
    assert e.config.max_seq_len == 64 and e.config.policy.k == 3 and e.config.has_draft
    from specbuild.engines.embedded.quant import Int8Linear

    assert isinstance(e.draft.layers[0].qkv, Int8Linear) and not isinstance(e.target.layers[0].qkv, Int8Linear)
    out = e.generate(PROMPTS[0], GREEDY)
    assert out.token_ids == plain[PROMPTS[0]].token_ids and out.stats.num_draft_tokens > 0
    with pytest.raises(SourceError, match="engine_config.json"):
        Engine.from_build_dir(tmp_path)


# ---- stop conditions ---------------------------------------------------------------------------------
def test_max_tokens_stops_with_length_even_mid_draft(eng, plain):
    for k in (0, 5):
        out = eng.generate(PROMPTS[0], SamplingParams(max_tokens=3, ignore_eos=True), num_draft_tokens=k)
        assert out.finish_reason == "length" and out.token_ids == plain[PROMPTS[0]].token_ids[:3]


def _first_new_token(ids):
    """A token whose first occurrence is not at the start, and its index."""
    for i, t in enumerate(ids):
        if i >= 3 and t not in ids[:i]:
            return t, i
    raise AssertionError("the tiny model's greedy continuation has no new token to stop on; change the prompt")


@pytest.mark.parametrize("k", [0, 3])
def test_stop_token_ids_end_the_request_without_the_stop_token(eng_self, plain, k):
    base = plain[PROMPTS[0]].token_ids
    t, i = _first_new_token(base)
    out = eng_self.generate(PROMPTS[0], SamplingParams(max_tokens=24, stop_token_ids=(t,)), num_draft_tokens=k)
    assert out.finish_reason == "stop" and out.token_ids == base[:i]


@pytest.mark.parametrize("k", [0, 3])
def test_min_tokens_suppresses_stop_tokens(eng, eng_self, plain, k):
    base = plain[PROMPTS[0]].token_ids
    t, i = _first_new_token(base)
    params = SamplingParams(max_tokens=24, stop_token_ids=(t,), min_tokens=i + 2)
    ref = eng.generate(PROMPTS[0], params, num_draft_tokens=0)
    out = eng_self.generate(PROMPTS[0], params, num_draft_tokens=k)
    assert out.token_ids == ref.token_ids and len(out.token_ids) >= i + 2
    assert t not in out.token_ids[:i + 2]


@pytest.mark.parametrize("k", [0, 4])
def test_stop_string_is_trimmed_and_never_streamed(eng, plain, k):
    base = plain[PROMPTS[0]]
    text = base.text
    cut = next(i for i in range(4, len(text) - 2) if text.find(text[i:i + 2]) == i and "\ufffd" not in text[i:i + 2])
    stop = text[cut:cut + 2]
    deltas = []
    rid = eng.submit(PROMPTS[0], SamplingParams(max_tokens=24, stop=(stop, "never-there")), num_draft_tokens=k,
                     on_output=deltas.append)
    while not (deltas and deltas[-1].finished):
        eng.scheduler.step()
    assert all(d.request_id == rid for d in deltas)
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stats is not None
    assert "".join(d.text for d in deltas) == base.text[:cut]


def test_default_eos_is_the_tokenizers(eng):
    assert eng.eos_token_id == eng.tokenizer.eos_token_id == 2
    seq = eng._make_sequence("hi", SamplingParams(max_tokens=8), None, None, None)
    assert seq.stop_ids == {2} and seq.num_draft_tokens == eng.config.policy.k
    assert eng._make_sequence("hi", SamplingParams(max_tokens=8, ignore_eos=True), None, None, None).stop_ids == set()


# ---- sampling -------------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible(eng):
    p = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    for k in (0, 3):
        a = eng.generate(PROMPTS[2], p, num_draft_tokens=k)
        b = eng.generate(PROMPTS[2], p, num_draft_tokens=k)
        assert a.token_ids == b.token_ids
    others = {tuple(eng.generate(PROMPTS[2], SamplingParams(max_tokens=16, temperature=1.5, seed=s,
                                                            ignore_eos=True), num_draft_tokens=3).token_ids)
              for s in range(4)}
    assert len(others) > 1


def _chi2_pvalue(counts: torch.Tensor, p: torch.Tensor, support: list[int]) -> float:
    n = counts.sum()
    exp = p[support] * n
    stat = ((counts[support] - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(support) - 1) / 2.0), stat / 2.0))


def test_sampled_tokens_follow_processed_target_distribution(tiny_llama, tiny_llama_draft):
    """Chi-square (false-alarm rate 1e-3 each) against the target's processed distribution computed
    independently (unrelated draft, K=3, temperature 2, top-k 6): the first token (sampled at prefill), and the
    second given the most common first (sampled by the first speculation round, which drafted K = 3)."""
    eng = Engine.from_checkpoints(tiny_llama, tiny_llama_draft, max_batch_size=16, max_seq_len=32)
    params = dict(max_tokens=5, temperature=2.0, top_k=6, ignore_eos=True)
    ids = eng.tokenizer.encode(PROMPTS[0])
    from specbuild.engines.embedded.kvcache import KVCache

    c = eng.target.cfg

    def target_probs(prefix):
        cache = KVCache(num_layers=c.num_layers, num_slots=1, kv_heads=c.num_kv_heads, max_seq=32,
                        head_dim=c.head_dim, dtype=torch.float32, device="cpu")
        return processed_probs(ragged_forward(eng.target, cache, [0], [0], [prefix], "last"),
                               SamplingParams(**params))[0]

    p = target_probs(ids)
    support = torch.nonzero(p).flatten().tolist()
    assert len(support) == 6
    n = 400
    outs = eng.generate_batch([(ids, SamplingParams(**params, seed=s), 3) for s in range(n)])
    assert all(o.stats.drafted_per_pos[2] >= 1 for o in outs)          # the first round drafted K = 3
    counts = torch.zeros(len(p))
    for o in outs:
        counts[o.token_ids[0]] += 1
    assert counts.sum() == counts[support].sum()            # never outside top-k
    assert _chi2_pvalue(counts, p, support) > 1e-3
    first = int(counts.argmax())
    p2 = target_probs(ids + [first])
    support2 = torch.nonzero(p2).flatten().tolist()
    counts2 = torch.zeros(len(p2))
    for o in outs:
        if o.token_ids[0] == first:
            counts2[o.token_ids[1]] += 1
    assert counts2.sum() >= 40 and counts2.sum() == counts2[support2].sum()
    assert _chi2_pvalue(counts2, p2, support2) > 1e-3


# ---- the real model (slow) ----------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_greedy_spec_equals_plain(smollm2_dir):
    model_dir = smollm2_dir
    e = Engine.from_checkpoints(model_dir, model_dir, max_batch_size=2, max_seq_len=256, draft_quantize="int8")
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
                   "Summarize: The meeting covered budgets, hiring plans and the roadmap. Summary: The meeting"]:
        base = e.generate(prompt, p, num_draft_tokens=0)
        assert len(base.token_ids) == 24
        assert base.text == e.tokenizer.decode(base.token_ids, skip_special_tokens=True)   # incremental detok
        for prop in ("ngram", "draft"):
            out = e.generate(prompt, p, num_draft_tokens=4, proposer=prop)
            assert out.token_ids == base.token_ids, prop
        assert out.stats.acceptance_rate > 0.5            # draft = an int8 copy of the target
