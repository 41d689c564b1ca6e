"""The streamed weights moved onto huge pages (engines/embedded/hugepages.py): the same values and the same tokens,
every streamed tensor inside the one mapping, and nothing moved where the machine or the user says no."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from specbuild.engines.embedded import SamplingParams, fused, hugepages
from specbuild.engines.embedded.kernels import TiledLinear

needs_ext = pytest.mark.skipif(fused.extension() is None, reason=f"fused decode step: {fused.status()}")
PROMPTS = ["The quick brown fox", "def fibonacci(n):\n", "Paris is the capital of"]


def _engine(tiny_llama):
    from specbuild.engines.embedded import Engine

    return Engine.from_checkpoints(tiny_llama, tiny_llama, max_batch_size=4, max_seq_len=192, linear_kernel="tiled",
                                   draft_quantize="int4", online_costs=False, draft_activations="int8")


def _tokens(eng):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    return [[o.token_ids for o in eng.generate_batch([(p, params, k) for p in PROMPTS], proposer="draft")]
            for k in (0, 4)]


def _inside(t: torch.Tensor, arena) -> bool:
    base = torch.frombuffer(arena, dtype=torch.uint8).data_ptr()
    return base <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= base + len(arena)


@needs_ext
def test_an_engine_on_huge_pages_streams_them_and_decodes_the_same_tokens(tiny_llama, monkeypatch):
    monkeypatch.setattr(hugepages, "available", lambda: None)   # the move itself, on any kernel's THP setting
    monkeypatch.setattr(TiledLinear, "screen_min_out", 0)       # the tiny head screens, as a real one does
    eng = _engine(tiny_llama)
    for model in (eng.target, eng.draft):
        arena = model._huge_pages
        slots = hugepages.streamed_tensors(model)
        tensors = [hugepages._get(*s) for s in slots]
        assert tensors and all(_inside(t, arena) for t in tensors)
        assert min(t.data_ptr() for t in tensors) % hugepages.HUGE == 0
        kinds = {attr for _, attr, _ in slots}
        assert kinds >= ({"panels", "_screen"} if model is eng.target else {"_interleaved", "_screen"})
    assert isinstance(dict(eng.target.lm_head.named_buffers())["panels"], torch.Tensor)   # still a buffer
    moved = _tokens(eng)
    monkeypatch.setattr(hugepages, "available", lambda: "off for the comparison")
    base = _engine(tiny_llama)
    assert not hasattr(base.target, "_huge_pages") and not hasattr(base.draft, "_huge_pages")
    assert _tokens(base) == moved
    assert moved[0] == moved[1]                                  # and speculation is still lossless


def test_nothing_moves_where_huge_pages_are_off_or_refused(tiny_llama, monkeypatch, tmp_path):
    from specbuild.engines.embedded.weights import load_model

    model = load_model(tiny_llama)
    monkeypatch.setenv("SPECBUILD_HUGE_PAGES", "0")
    assert hugepages.available() == "SPECBUILD_HUGE_PAGES=0" and hugepages.place_weights_(model) == 0
    monkeypatch.delenv("SPECBUILD_HUGE_PAGES")
    never = tmp_path / "enabled"
    never.write_text("always madvise [never]\n")
    monkeypatch.setattr(hugepages, "THP_ENABLED", never)
    assert "[never]" in hugepages.available()
    monkeypatch.setattr(hugepages, "THP_ENABLED", tmp_path / "missing")
    assert "no " in hugepages.available()
    assert not hasattr(model, "_huge_pages")


@needs_ext
@pytest.mark.skipif(hugepages.available() is not None, reason=f"huge pages here: {hugepages.available()}")
def test_the_kernel_backs_the_mapping_with_huge_pages(tiny_llama):
    """Where THP is on (madvise or always), the mapping is backed by huge pages, not only marked for them: its own
    entry in /proc/self/smaps holds at least one 2 MB page."""
    eng = _engine(tiny_llama)
    arena = eng.target._huge_pages
    start = torch.frombuffer(arena, dtype=torch.uint8).data_ptr()
    huge_kb = None
    for block in Path("/proc/self/smaps").read_text().split("\n"):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", block)
        if m:
            inside = int(m.group(1), 16) <= start < int(m.group(2), 16)
        elif inside and block.startswith("AnonHugePages:"):
            huge_kb = int(block.split()[1])
            break
    assert huge_kb is not None and huge_kb >= 2048, f"the target's mapping holds {huge_kb} kB of huge pages"
