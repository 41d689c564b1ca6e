"""A self-draft attending over the target's KV cache (engine `draft_kv="shared"`): no draft prefill and no
catch-up forwards, one cache in memory, and greedy output still the target's, alone and in a batch."""

from __future__ import annotations

import pytest

from specbuild.engines.embedded import Engine, SamplingParams
from specbuild.engines.embedded.quant import quantize_model_
from specbuild.core.errors import SourceError

PROMPTS = ["The quick brown fox", "def fibonacci(n):\n", "Paris is the capital of",
           " ".join(["the quick brown fox jumps over the lazy dog"] * 3)]
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(tiny_llama, draft_kv):
    eng = Engine.from_checkpoints(tiny_llama, tiny_llama, max_batch_size=4, max_seq_len=192, draft_kv=draft_kv)
    quantize_model_(eng.draft, "int8")          # an int8 self-draft: agrees often, not always
    return eng


def _record_draft_forwards(eng, monkeypatch):
    """(rows, longest row) of every forward of the draft model, fused or eager (both go through ragged_forward)."""
    from specbuild.engines.embedded import model as model_mod, proposers

    shapes = []
    real = model_mod.ragged_forward

    def rec(model, cache, slots, starts, rows, *a, **kw):
        if model is eng.draft:
            shapes.append((len(rows), max(len(r) for r in rows)))
        return real(model, cache, slots, starts, rows, *a, **kw)

    monkeypatch.setattr(model_mod, "ragged_forward", rec)
    monkeypatch.setattr(proposers, "ragged_forward", rec)
    return shapes


@pytest.mark.parametrize("draft_kv", ["shared", "own"])
def test_greedy_output_is_the_targets_with_either_cache(tiny_llama, draft_kv, monkeypatch):
    eng = _engine(tiny_llama, draft_kv)
    assert (eng.scheduler.draft.cache is eng.scorer.cache) == (draft_kv == "shared")
    plain = [eng.generate(p, GREEDY, num_draft_tokens=0).token_ids for p in PROMPTS]
    shapes = _record_draft_forwards(eng, monkeypatch)
    outs = eng.generate_batch([(p, GREEDY, 3) for p in PROMPTS])
    assert [o.token_ids for o in outs] == plain
    assert sum(o.stats.num_draft_tokens for o in outs) > 0
    longest_row = max(t for _, t in shapes)
    if draft_kv == "shared":
        assert longest_row == 1                  # only [last] then one token per draft step: no prompt prefill
    else:
        assert longest_row >= len(eng.tokenizer(PROMPTS[-1])["input_ids"]) - 1   # the draft prefilled the prompt


def test_engine_shares_by_default_only_for_the_same_checkpoint(tiny_llama, tiny_llama_draft):
    same = Engine.from_checkpoints(tiny_llama, tiny_llama, max_batch_size=2, max_seq_len=64)
    other = Engine.from_checkpoints(tiny_llama, tiny_llama_draft, max_batch_size=2, max_seq_len=64)
    assert same.config.draft_kv == "shared" and same.scheduler.draft.cache is same.scorer.cache
    assert other.config.draft_kv == "own" and other.scheduler.draft.cache is not other.scorer.cache


def test_sharing_needs_the_targets_kv_layout(tiny_llama, tiny_llama_draft):
    with pytest.raises(SourceError, match="draft_kv='shared' needs a draft with the target's KV layout"):
        Engine.from_checkpoints(tiny_llama, tiny_llama_draft, max_batch_size=2, max_seq_len=64, draft_kv="shared")
