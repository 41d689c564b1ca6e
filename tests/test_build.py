"""`specbuild build --backend embedded`: engine directory, calibration, no-op re-runs, the int8 draft, errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specbuild.pipeline.build import build
from specbuild.cli.main import cli
from specbuild.pipeline.convert import convert
from specbuild.engines.embedded.adaptive import CostModel, predicted_speedup
from specbuild.engines.embedded.calibrate import estimate_alpha, speedup_table
from specbuild.core.errors import ManifestError, UsageError

SMALL = dict(max_batch_size=2, max_seq_len=128, max_draft_len=4)


@pytest.fixture(scope="module")
def pair_workdir(tmp_path_factory, tiny_llama, tiny_llama_draft):
    """Converted (tiny target, unrelated tiny draft) + a calibrated build."""
    wd = tmp_path_factory.mktemp("build-pair")
    convert(tiny_llama, tiny_llama_draft, workdir=wd)
    result = build(workdir=wd, **SMALL)
    return wd, result


@pytest.fixture(scope="module")
def self_draft_workdir(tmp_path_factory, tiny_llama):
    """draft == target, stored as int8 weight-only: the recipe of the demo draft."""
    wd = tmp_path_factory.mktemp("build-int8")
    convert(tiny_llama, tiny_llama, workdir=wd)
    result = build(workdir=wd, draft_quantize="int8", **SMALL)
    return wd, result


# ---- the speedup model ---------------------------------------------------------------------------

def test_predicted_speedup_and_the_recommended_k():
    # Paper form: t_verify = t_target, c = 0.1, a = 0.8, K = 4 -> (1 - .8^5) / (.2 * 1.4) = 2.4011
    paper = CostModel(cost_ratio=0.1, verify_intercept=0.0, verify_slope=0.0)
    assert predicted_speedup(0.8, 4, paper) == pytest.approx(2.4011, abs=1e-4)
    assert predicted_speedup(0.8, 0, paper) == 1.0
    k, table = speedup_table(0.8, paper, 8)
    assert k == max(table, key=table.get) and 3 <= k <= 6
    # A draft as expensive as the target never pays: best is still a K, but below 1x.
    k, table = speedup_table(0.5, CostModel(cost_ratio=1.0, verify_intercept=0.1, verify_slope=0.1), 2)
    assert k == 1 and table[1] < 1.0


def test_estimate_alpha_counts_only_tested_positions():
    # K=3, rounds accepting 3, 0, 1 -> trials 3 + 2 + 1, successes 4
    assert estimate_alpha([2, 1, 1], [3, 3, 3]) == pytest.approx(4 / 6)
    assert estimate_alpha([5, 5], [5, 5]) == 1.0
    assert estimate_alpha([0, 0], [4, 4]) == 0.0
    assert estimate_alpha([], []) == 0.0


# ---- the engine directory ------------------------------------------------------------------------

def test_build_writes_engine_dir_and_sane_calibration(pair_workdir):
    wd, result = pair_workdir
    assert not result.skipped
    out = wd / "engines"
    cfg = json.loads((out / "engine_config.json").read_text())
    assert cfg["max_batch_size"] == 2 and cfg["max_seq_len"] == 128 and cfg["max_draft_len"] == 4
    assert cfg["dtype"] == "float32" and cfg["device"] == "cpu" and cfg["draft"] == "draft"
    assert cfg["draft_format"] == "hf-safetensors" and cfg["policy"]["proposer"] == "draft"
    assert cfg["draft_kv"] == "own"                  # an unrelated draft keeps its own KV cache
    for rel in ("target/model.safetensors", "target/config.json", "draft/model.safetensors",
                "tokenizer/tokenizer.json", "manifest.json"):
        assert (out / rel).is_file(), rel
    cal = result.calibration
    assert cal == cfg["calibration"] == result.manifest["extra"]["calibration"]
    assert 0.0 <= cal["alpha"] <= 1.0 and 0.0 <= cal["acceptance_rate"] <= 1.0
    assert set(cal["alpha_by_kind"]) == {"chat", "code", "summarization"}
    assert 1 <= cal["recommended_k"] <= 4
    assert cfg["policy"]["k"] == "adaptive"          # calibrated, no K given: adaptive K
    assert cal["t_target_s"] > 0 and cal["t_draft_s"] > 0
    assert sorted(cal["t_verify_s"]) == ["1", "2", "3", "4"] and min(cal["t_verify_s"].values()) > 0
    # the step times at more sequences per step, up to max_batch_size (2 here), verify at K <= max_draft_len
    assert list(cal["by_concurrency"]) == ["2"]
    at2 = cal["by_concurrency"]["2"]
    assert sorted(at2["t_verify_s"]) == ["1", "2", "4"] and min(at2["t_verify_s"].values()) > 0
    assert at2["t_target_s"] > 0 and at2["t_draft_s"] > 0
    assert cal["cost_ratio"] == pytest.approx(cal["t_draft_s"] / cal["t_target_s"])
    # what the costs were measured on, down to the fused kernels' build (other kernels: another engine's costs)
    from specbuild.engines.embedded import fused

    assert cal["decode_step"] == ("fused" if fused.extension() is not None else "eager")
    assert cal.get("fused_kernels") == (fused.kernels_id() if cal["decode_step"] == "fused" else None)
    best = max(cal["predicted_speedup"].values())
    assert cal["predicted_speedup"][str(cal["recommended_k"])] == best
    smoke = next(c for c in result.manifest["checks"] if c["name"] == "smoke-generation")
    assert smoke["ok"] and smoke["speculative_equal"] and smoke["tokens"] == 8


def test_rerun_is_noop_and_changed_option_rebuilds(pair_workdir):
    wd, first = pair_workdir
    cfg_path = wd / "engines" / "engine_config.json"
    mtime = cfg_path.stat().st_mtime_ns
    again = build(workdir=wd, **SMALL)
    assert again.skipped and cfg_path.stat().st_mtime_ns == mtime
    assert again.manifest["fingerprint"] == first.manifest["fingerprint"]
    changed = build(workdir=wd, **{**SMALL, "max_batch_size": 3}, num_draft_tokens=2, calibrate=False)
    assert not changed.skipped and changed.manifest["fingerprint"] != first.manifest["fingerprint"]
    cfg = json.loads(cfg_path.read_text())
    assert cfg["max_batch_size"] == 3 and cfg["policy"]["k"] == 2 and cfg["calibration"] is None
    assert cfg["policy"]["max_concurrency"] is None and cfg["policy"]["source"] == "build: not calibrated"


def test_int8_self_draft_loads_and_generates(self_draft_workdir):
    from specbuild.engines.embedded import Engine, Policy, SamplingParams
    from specbuild.engines.embedded.quant import Int8Linear

    wd, result = self_draft_workdir
    out = wd / "engines"
    cfg = json.loads((out / "engine_config.json").read_text())
    assert cfg["draft_format"] == "int8-weight-only" and cfg["draft_quantize"] == "int8"
    assert cfg["draft_kv"] == "shared" == result.manifest["outputs"]["engine"]["draft_kv"]   # a self-draft
    assert (out / "draft" / "model.int8.safetensors").is_file()
    assert not (out / "draft" / "model.safetensors").exists()
    assert result.manifest["outputs"]["draft"]["quantized_linears"] > 0
    # (the measured cut-off of a tiny model may be 0 = never draft; this test is about the int8 draft itself)
    engine = Engine.from_build_dir(out, policy=Policy(k=3))
    assert engine.scheduler.draft.cache is engine.scorer.cache
    assert engine.config.has_draft and engine.config.policy.k == 3
    assert any(isinstance(m, Int8Linear) for m in engine.draft.modules())
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = engine.generate("The quick brown fox", params, num_draft_tokens=0)
    spec = engine.generate("The quick brown fox", params, num_draft_tokens=3, proposer="draft")
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == 12
    assert spec.stats.num_draft_tokens > 0
    # an int8 copy of the target agrees with it far more than an unrelated draft would
    assert result.calibration["alpha"] >= 0.5


def test_int4_self_draft_build(tmp_path, tiny_llama):
    """`--draft-quantize int4`: Q4_1 layers + a Q8_0 lm_head, stored as blocks, reported with the fraction of the
    target's weights they hold exactly (the tiny random model is not a GGUF's: blocks approximate it)."""
    from specbuild.engines.embedded import Engine, Policy, SamplingParams
    from specbuild.engines.embedded.quant import BlockLinear

    convert(tiny_llama, tiny_llama, workdir=tmp_path)
    result = build(workdir=tmp_path, draft_quantize="int4", calibrate=False, num_draft_tokens=3, **SMALL)
    out = tmp_path / "engines"
    cfg = json.loads((out / "engine_config.json").read_text())
    assert cfg["draft_format"] == "int4-blocks" and cfg["draft_quantize"] == "int4" and cfg["draft_kv"] == "shared"
    assert cfg["draft_activations"] == "int8"                  # the default for an int4 draft
    assert (out / "draft" / "model.int4.safetensors").is_file()
    draft = result.manifest["outputs"]["draft"]
    assert draft["scheme"] == "int4" and 0.0 <= draft["exact_fraction"] < 1.0
    assert (out / "draft" / "model.int4.safetensors").stat().st_size < \
        0.5 * (out / "target" / "model.safetensors").stat().st_size
    engine = Engine.from_build_dir(out, policy=Policy(k=3))
    assert isinstance(engine.draft.layers[0].qkv, BlockLinear) and engine.draft.lm_head.scheme == "q8_0"
    assert engine.draft.layers[0].qkv.activations == "int8"
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = engine.generate("The quick brown fox", params, num_draft_tokens=0)
    spec = engine.generate("The quick brown fox", params, num_draft_tokens=3, proposer="draft")
    assert spec.token_ids == plain.token_ids and spec.stats.num_draft_tokens > 0
    build(workdir=tmp_path, draft_quantize="int4", calibrate=False, num_draft_tokens=3, draft_activations="fp32",
          **SMALL)                                             # a changed option rebuilds
    assert json.loads((out / "engine_config.json").read_text())["draft_activations"] == "fp32"


def test_ngram_build_explicit_k_wins_over_calibration(tmp_path, tiny_llama, tiny_llama_draft):
    convert(tiny_llama, tiny_llama_draft, workdir=tmp_path)
    result = build(workdir=tmp_path, proposer="ngram", num_draft_tokens=3, **SMALL)
    cfg = json.loads((tmp_path / "engines" / "engine_config.json").read_text())
    assert cfg["draft"] is None and cfg["policy"]["proposer"] == "ngram" and cfg["policy"]["k"] == 3
    assert not (tmp_path / "engines" / "draft").exists()
    cal = result.calibration
    assert cal["proposer"] == "ngram" and cal["t_draft_s"] == 0.0 and 0.0 <= cal["alpha"] <= 1.0
    assert 1 <= cal["recommended_k"] <= 4


# ---- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"max_draft_len": 0}, "--max-draft-len"),
    ({"max_draft_len": 4, "num_draft_tokens": 5}, "--num-draft-tokens"),
    ({"max_batch_size": 0}, "--max-batch-size"),
    ({"max_seq_len": 4}, "--max-seq-len"),
    ({"dtype": "int4"}, "--dtype"),
    ({"proposer": "medusa"}, "--proposer"),
    ({"draft_quantize": "int2"}, "--draft-quantize"),
    ({"tp": 2}, "--tp/--pp"),
    ({"device": "tpu"}, "--device"),
    ({"threads": 0}, "--threads"),
])
def test_bad_options_are_refused_before_anything_is_written(tmp_path, kwargs, match):
    with pytest.raises(UsageError, match=match):
        build(workdir=tmp_path, **kwargs)
    assert not (tmp_path / "engines").exists()


def test_build_without_convert_says_what_to_run(tmp_path):
    with pytest.raises(ManifestError, match="specbuild convert"):
        build(workdir=tmp_path)
    assert not (tmp_path / "engines").exists()


def test_cli_build_noop_dry_run_and_errors(pair_workdir):
    wd, _ = pair_workdir
    runner = CliRunner()
    ok = runner.invoke(cli, ["build", "--workdir", str(wd), "--max-batch-size", "3", "--max-seq-len", "128",
                             "--max-draft-len", "4", "--num-draft-tokens", "2", "--no-calibrate"])
    assert ok.exit_code == 0, ok.output
    assert "up to date" in ok.output or "built" in ok.output
    again = runner.invoke(cli, ["build", "--workdir", str(wd), "--max-batch-size", "3", "--max-seq-len", "128",
                                "--max-draft-len", "4", "--num-draft-tokens", "2", "--no-calibrate"])
    assert again.exit_code == 0 and "up to date" in again.output
    dry = runner.invoke(cli, ["build", "--workdir", str(wd), "--draft-quantize", "int8", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "model.int8.safetensors" in dry.output and "engine_config.json" in dry.output
    # the dry run says which policy the real run writes
    assert "default policy: adaptive K with the draft, off above the concurrency where the measured crossover" \
        in dry.output
    fixed = runner.invoke(cli, ["build", "--workdir", str(wd), "--num-draft-tokens", "2", "--no-calibrate",
                                "--dry-run"])
    assert "default policy: K=2 with the draft, at any concurrency" in fixed.output
    bad = runner.invoke(cli, ["build", "--workdir", str(wd), "--max-draft-len", "99"])
    assert bad.exit_code == 2 and "--max-draft-len" in bad.output
    missing = runner.invoke(cli, ["build", "--workdir", str(wd / "nowhere")])
    assert missing.exit_code == 1 and "specbuild convert" in missing.output


# ---- the default policy: adaptive K below the measured crossover, no drafting above -------------------------

def test_crossover_batches():
    from specbuild.engines.embedded.calibrate import crossover_batches

    assert crossover_batches(8) == [1, 2, 3, 4, 6, 8] and crossover_batches(5) == [1, 2, 3, 4, 5]
    assert crossover_batches(1) == [1]


def test_build_measures_the_crossover_and_makes_it_the_default_policy(pair_workdir):
    _, result = pair_workdir
    cfg = result.manifest["outputs"]["engine"]       # (a later test rebuilds the directory)
    cross = result.calibration["crossover"]
    assert set(cross) == {"draft", "ngram"}
    for x in cross.values():
        assert x["k"] == "adaptive" and x["reps"] >= 1 and x["seconds"] > 0
        measured = {int(b): s for b, s in x["speedup_by_batch"].items()}
        assert measured and min(measured) == 1 and max(measured) <= SMALL["max_batch_size"]
        assert all(s >= 0 for s in measured.values())
        assert x["spec_max_concurrency"] is None or 0 <= x["spec_max_concurrency"] <= SMALL["max_batch_size"]
        if x["crossover"] is not None:
            assert measured[x["crossover"]] < 1.0 and x["spec_max_concurrency"] < x["crossover"]
    assert cfg["policy"]["k"] == "adaptive" and cfg["policy"]["source"] == "build: calibrated, measured cut-off"
    assert cfg["policy"]["max_concurrency"] == cross["draft"]["spec_max_concurrency"]


def test_explicit_options_win_over_the_measured_policy(tmp_path, tiny_llama, tiny_llama_draft):
    convert(tiny_llama, tiny_llama_draft, workdir=tmp_path)
    fixed = build(workdir=tmp_path, **SMALL, num_draft_tokens=2, spec_max_concurrency=1)
    cfg = json.loads((tmp_path / "engines" / "engine_config.json").read_text())
    assert cfg["policy"] == {"k": 2, "proposer": "draft", "max_concurrency": 1, "source": "build: calibrated"}
    assert "crossover" not in fixed.calibration                 # an explicit cut-off is not measured
    off = build(workdir=tmp_path, **SMALL, crossover=False, force=True)
    cfg = json.loads((tmp_path / "engines" / "engine_config.json").read_text())
    assert "crossover" not in off.calibration
    assert cfg["policy"]["max_concurrency"] is None and cfg["policy"]["k"] == "adaptive"


def test_crossover_confirms_a_loss_and_a_marginal_gain_but_not_a_clear_gain(monkeypatch):
    """Each concurrency's speedup is the median of off/on pairs; below CLEAR_GAIN (1.05) three more pairs are
    measured before it counts, so a gain within the probe's noise (1.02x, then 0.95x) does not set the cut-off."""
    import types

    from specbuild.engines.embedded import calibrate

    ratios = {1: [2.0, 2.0], 2: [1.3, 1.3], 3: [1.03, 1.02, 0.95, 0.96, 0.94], 4: [1.5] * 5}
    pairs: dict = {}

    def rate(engine, prompts, *, k, proposer, steps, max_tokens):
        b = len(prompts)
        if k == 0:
            return 1.0
        i = pairs[b] = pairs.get(b, -1) + 1
        return ratios[b][i]

    monkeypatch.setattr(calibrate, "_decode_rate", rate)
    tok = types.SimpleNamespace(encode=lambda text, add_special_tokens=True: [1, 2, 3],
                                apply_chat_template=lambda *a, **kw: "x", chat_template=None)
    engine = types.SimpleNamespace(tokenizer=tok, config=types.SimpleNamespace(max_draft_len=4, max_seq_len=256))
    got = calibrate.measure_crossover(engine, proposer="draft", k=-1, max_batch_size=4, budget_s=60)
    assert {b: pairs[b] + 1 for b in pairs} == {1: 2, 2: 2, 3: 5}       # 3 re-measured; 4 never reached
    assert got["speedup_by_batch"] == {"1": 2.0, "2": 1.3, "3": 0.96}
    assert got["crossover"] == 3 and got["spec_max_concurrency"] == 2
