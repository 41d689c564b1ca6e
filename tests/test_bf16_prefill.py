"""`prefill_precision: bf16` (EngineConfig; `specbuild build --prefill-precision bf16`): the target's prompt rows
run on the fused extension's AVX-512 BF16 kernel (csrc/fused.cpp `bf16_gemm`), every other row in fp32. Its rows
are batch-invariant, so a prompt's cache is the same bits in any chunk or batch, and speculation stays lossless
against the same engine without it. Where it cannot run (no extension, no AVX-512 BF16, the eager step) the engine
refuses it with the fix."""

from __future__ import annotations

import pytest
import torch

from specbuild.engines.embedded import Engine, SamplingParams, fused
from specbuild.engines.embedded.config import ConfigError, EngineConfig

ext = fused.extension()
has_bf16 = ext is not None and ext.has_bf16_prefill()
needs_bf16 = pytest.mark.skipif(not has_bf16, reason="no fused extension with AVX-512 BF16 here "
                                                      f"({fused.status()})")
PROMPTS = ["The quick brown fox", "def fibonacci(n):\n", "Paris is the capital of"]
LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 4)
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
NONE = torch.empty(0)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _bf16_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) from the bf16-rounded inputs and weights, summed in float64."""
    y = x.bfloat16().double() @ w.bfloat16().double().T
    return y if bias is None else y + bias.double()


@needs_bf16
@pytest.mark.parametrize("bias", [False, True])
def test_the_bf16_kernel_computes_the_products_of_the_bf16_rounded_inputs(bias):
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(1001, 576, generator=gen), torch.randn(37, 576, generator=gen)   # a panel remainder: 1001
    b = torch.randn(1001, generator=gen) if bias else None
    y = ext.bf16_linear(x, ext.pack_panels_bf16(w), b if bias else NONE, 1001)
    ref = _bf16_reference(x, w, b)
    assert y.shape == (37, 1001) and y.dtype == torch.float32
    # only the fp32 sums' rounding separates them (576 terms of magnitude ~1: ~1e-4), not bf16's (~1e-1 here)
    assert (y.double() - ref).abs().max() < 5e-4
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    assert (y.double() - exact).abs().max() > 1e-2            # and it is not the fp32 product: the rounding is real


@needs_bf16
def test_bf16_rows_do_not_depend_on_the_other_rows_at_any_row_count():
    """Every tile shape (1-6 row tiles, 4-panel groups and single panels, 48-row blocks): row i of an m-row call is
    bitwise row i computed alone, so a prompt's cache is the same in any chunk."""
    gen = torch.Generator().manual_seed(12)
    w, b = torch.randn(1001, 576, generator=gen), torch.randn(1001, generator=gen)
    panels = ext.pack_panels_bf16(w)
    x = torch.randn(300, 576, generator=gen)
    alone = torch.cat([ext.bf16_linear(x[i:i + 1], panels, b, 1001) for i in range(300)])
    for m in (1, 2, 3, 5, 6, 7, 12, 13, 47, 48, 49, 97, 300):
        assert torch.equal(ext.bf16_linear(x[:m], panels, b, 1001), alone[:m]), m
    for a in (1, 5, 48, 123):
        assert torch.equal(ext.bf16_linear(x[a:a + 50], panels, b, 1001), alone[a:a + 50]), a


@needs_bf16
def test_panels_of_another_shape_are_refused():
    gen = torch.Generator().manual_seed(1)
    panels = ext.pack_panels_bf16(torch.randn(64, 32, generator=gen))
    with pytest.raises(RuntimeError, match="pack_panels_bf16"):
        ext.bf16_linear(torch.randn(2, 48, generator=gen), panels, NONE, 64)
    with pytest.raises(RuntimeError, match="K even"):
        ext.pack_panels_bf16(torch.randn(64, 33, generator=gen))


@pytest.fixture(scope="module")
def engines(tiny_llama):
    """The same target (draft = target: every draft accepted) with an fp32 and a bf16 prefill."""
    if not has_bf16:
        pytest.skip(f"no fused extension with AVX-512 BF16 here ({fused.status()})")
    made = {p: Engine.from_checkpoints(tiny_llama, tiny_llama, max_batch_size=4, max_seq_len=128,
                                       prefill_precision=p) for p in ("fp32", "bf16")}
    if made["bf16"].decode_step != "fused":
        pytest.skip("the tiny model does not run on the fused step here")
    return made


def _hidden(eng: Engine, prompt: str, prefill: bool) -> torch.Tensor:
    """The final-normed hidden state after `prompt`, fed as one forward into the cache's scratch slot."""
    from specbuild.engines.embedded.model import ragged_forward

    ids = eng.tokenizer.encode(prompt)
    cache = eng.scorer.cache
    return ragged_forward(eng.target, cache, [cache.scratch_slot], [0], [ids], "hidden", prefill=prefill)


def test_a_bf16_prefill_computes_prompts_in_bf16_products_and_every_other_row_in_fp32(engines, monkeypatch):
    """The option takes effect: a prompt's rows differ from the fp32 engine's by bf16's rounding (not bitwise
    equal, within 2 %), the same rows fed as any other forward are the fp32 engine's bits, and in a request only
    the prefill reaches the bf16 kernel."""
    h32, h16 = _hidden(engines["fp32"], LONG, True), _hidden(engines["bf16"], LONG, True)
    assert torch.equal(_hidden(engines["bf16"], LONG, False), h32)
    assert not torch.equal(h16, h32)
    assert ((h16 - h32).norm() / h32.norm()).item() < 0.02
    runner = engines["bf16"].scorer.cache._fused_runners[id(engines["bf16"].target)]
    seen = []
    real = type(runner).forward

    class Spy:                                  # pybind methods cannot be patched on the instance: wrap the runner
        def __init__(self, r):
            self.r = r

        def forward(self, *a, **kw):
            seen.append(bool(kw.get("prefill", False)))
            return real(self.r, *a, **kw)

        def num_layers(self):
            return self.r.num_layers()

    monkeypatch.setitem(engines["bf16"].scorer.cache._fused_runners, id(engines["bf16"].target), Spy(runner))
    engines["bf16"].generate(PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True), num_draft_tokens=2)
    assert seen[0] is True and seen.count(True) == 1 and len(seen) > 1   # the prefill, then verifies in fp32


def test_speculation_with_a_bf16_prefill_is_lossless_in_any_batch_and_chunking(engines, monkeypatch):
    eng = engines["bf16"]
    plain = {p: eng.generate(p, GREEDY, num_draft_tokens=0).token_ids for p in PROMPTS + [LONG]}
    for k in (2, 4, -1):
        assert [eng.generate(p, GREEDY, num_draft_tokens=k).token_ids for p in PROMPTS + [LONG]] == \
            [plain[p] for p in PROMPTS + [LONG]], k
    monkeypatch.setattr(eng.scheduler.admission, "prefill_token_budget", 3)     # LONG in 3-token chunks
    outs = eng.generate_batch([(LONG, GREEDY, 3), (PROMPTS[0], GREEDY, 0), (PROMPTS[1], GREEDY, -1),
                               (PROMPTS[2], GREEDY, 2)], proposer="draft")
    assert [o.token_ids for o in outs] == [plain[LONG]] + [plain[p] for p in PROMPTS]


def test_bf16_prefill_where_it_cannot_run_is_refused_with_the_fix(tiny_llama, monkeypatch):
    from specbuild.engines.embedded import step

    if has_bf16:
        with pytest.raises(ConfigError, match="prefill_precision 'bf16' runs on the fused step, and this engine's "
                                              "is eager.*use prefill_precision 'fp32'"):
            Engine.from_checkpoints(tiny_llama, tiny_llama, max_batch_size=2, max_seq_len=64,
                                    prefill_precision="bf16", decode_step="eager")
    elif ext is not None:
        with pytest.raises(ConfigError, match="cannot run here: this build of the fused extension has no AVX-512 "
                                              "BF16 kernels.*prefill_precision 'fp32'"):
            Engine.from_checkpoints(tiny_llama, tiny_llama, max_batch_size=2, max_seq_len=64,
                                    prefill_precision="bf16")
    monkeypatch.setattr(step, "extension", lambda: None)
    with pytest.raises(ConfigError, match="cannot run here: the fused extension is not built.*prefill_precision 'fp32'"):
        Engine.from_checkpoints(tiny_llama, tiny_llama, max_batch_size=2, max_seq_len=64, prefill_precision="bf16")


def test_the_engine_config_keeps_the_precision_and_an_older_one_means_fp32(tmp_path):
    from specbuild.engines.embedded.config import Policy

    EngineConfig(prefill_precision="bf16", policy=Policy(k=0)).save(tmp_path)
    assert EngineConfig.load(tmp_path).prefill_precision == "bf16"
    d = EngineConfig(policy=Policy(k=0)).to_dict()
    del d["prefill_precision"]                  # an engine built before the option
    assert EngineConfig.from_dict(d).prefill_precision == "fp32"


def test_an_unknown_prefill_precision_is_refused():
    with pytest.raises(ConfigError, match="prefill_precision 'fp16' is unknown; use one of \\('fp32', 'bf16'\\)"):
        EngineConfig(prefill_precision="fp16")


def test_the_build_option_reaches_the_engine_config_and_trtllm_refuses_it(tmp_path):
    from specbuild.core.errors import UsageError
    from specbuild.engines.embedded.build import _engine_config
    from specbuild.engines.embedded.config import Policy
    from specbuild.pipeline.build import build

    opts = {"max_batch_size": 2, "max_seq_len": 64, "max_draft_len": 4, "dtype": "float32", "device": "cpu",
            "threads": None, "draft_quantize": None, "prefill_precision": "bf16"}
    assert _engine_config(opts, has_draft=False, policy=Policy(k=0), calibration=None).prefill_precision == "bf16"
    assert _engine_config({**opts, "prefill_precision": None}, has_draft=False, policy=Policy(k=0),
                          calibration=None).prefill_precision == "fp32"
    with pytest.raises(UsageError, match="--prefill-precision applies to --backend embedded only"):
        build(workdir=tmp_path, backend="trtllm", prefill_precision="bf16", dry_run=True)
    with pytest.raises(UsageError, match="unknown --prefill-precision 'fp16'"):
        build(workdir=tmp_path, prefill_precision="fp16")
