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
    # only the head screens: no layer gets a screen of its own (nothing reads one), whatever its width
    assert all(m._screen is None for m in eng.target.layers.modules() if isinstance(m, TiledLinear))
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
def test_the_mapping_asks_for_huge_pages_over_whole_pages(tiny_llama, monkeypatch):
    """The kernel sees the mapping marked for huge pages (its smaps VmFlags carry `hg`, MADV_HUGEPAGE), and the
    weights' 2 MB-aligned start leaves room for whole huge pages up to their end wherever the mapping lands (a
    tiny model's weights, under 2 MB, would otherwise fit none when the alignment ate the slack). Whether the kernel
    backs it with huge pages then depends on its free memory; measured: bench/README.md, "2026-12-07 evening"."""
    monkeypatch.setattr(hugepages, "available", lambda: None)
    eng = _engine(tiny_llama)
    arena = eng.target._huge_pages
    start = torch.frombuffer(arena, dtype=torch.uint8).data_ptr()
    tensors = [hugepages._get(*s) for s in hugepages.streamed_tensors(eng.target)]
    first = min(t.data_ptr() for t in tensors)
    last = max(t.data_ptr() + t.numel() * t.element_size() for t in tensors)
    pages = -(-(last - first) // hugepages.HUGE)
    assert first % hugepages.HUGE == 0 and first + pages * hugepages.HUGE <= start + len(arena)
    flags = None
    for line in Path("/proc/self/smaps").read_text().split("\n"):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= start < int(m.group(2), 16)
        elif inside and line.startswith("VmFlags:"):
            flags = line.split()[1:]
            break
    assert flags is not None and "hg" in flags, flags
