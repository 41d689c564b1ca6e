"""Pre-flight checks on real tiny checkpoints (and broken copies of them)."""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import pytest

from specbuild.pipeline.checks import (format_table, read_safetensors_header, run_checks, backend_support,
                              EMBEDDED_ARCHITECTURES)
from tinymodels import CORPUS, make_checkpoint, make_tokenizer


def variant(src: Path, dst: Path, **config_updates) -> Path:
    """A copy of checkpoint `src` at `dst` with config.json keys replaced (None deletes a key)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in config_updates.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.fixture(scope="session")
def other_tokenizer(tmp_path_factory) -> Path:
    """A tokenizer of the same size trained on different text: different ids and merges."""
    corpus = [line[::-1] + " zebra quartz" for line in CORPUS]
    return make_tokenizer(tmp_path_factory.mktemp("tok2") / "tokenizer", corpus=corpus)


@pytest.fixture(scope="session")
def big_tokenizer(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok3") / "tokenizer", vocab_size=400)


@pytest.fixture(scope="session")
def padded_draft(tmp_path_factory, tiny_tokenizer) -> Path:
    """Same tokenizer (384 tokens), embedding padded to 400 rows."""
    return make_checkpoint(tmp_path_factory.mktemp("m") / "padded-draft", tiny_tokenizer, layers=1, hidden=32,
                           heads=2, kv_heads=1, intermediate=64, vocab_size=400, seed=4)


def by_name(results):
    return {r.name: r for r in results}


def test_good_pair_passes(tiny_llama, tiny_llama_draft, tiny_qwen2):
    results = run_checks(tiny_llama, tiny_llama_draft)
    assert all(r.status == "pass" for r in results), format_table(results)
    names = by_name(results)
    assert "LlamaForCausalLM" in names["target architecture"].message
    assert "smaller" in names["draft size"].message
    # A Qwen2 target with a Llama draft of the same tokenizer is a valid pair too.
    assert not [r for r in run_checks(tiny_qwen2, tiny_llama_draft) if r.status == "fail"]


def test_mismatched_tokenizer_fails(tmp_path, tiny_llama, other_tokenizer):
    draft = make_checkpoint(tmp_path / "d", other_tokenizer, layers=1, hidden=32, heads=2, kv_heads=1)
    r = by_name(run_checks(tiny_llama, draft))["same tokenizer"]
    assert r.status == "fail"
    assert "token->id maps differ" in r.message and "merges differ" in r.message
    assert "same tokenizer files" in r.message  # the fix


def test_chat_template_and_special_token_differences_fail(tmp_path, tiny_llama, tiny_llama_draft):
    draft = variant(tiny_llama_draft, tmp_path / "d")
    (draft / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    tc = json.loads((draft / "tokenizer_config.json").read_text())
    tc["bos_token"] = "<|endoftext|>"
    (draft / "tokenizer_config.json").write_text(json.dumps(tc))
    r = by_name(run_checks(tiny_llama, draft))["same tokenizer"]
    assert r.status == "fail"
    assert "chat templates differ" in r.message and "bos_token differs" in r.message


def test_vocab_beyond_padding_fails(tmp_path, tiny_llama, big_tokenizer):
    draft = make_checkpoint(tmp_path / "d", big_tokenizer, layers=1, hidden=32, heads=2, kv_heads=1)
    r = by_name(run_checks(tiny_llama, draft))["vocab size"]
    assert r.status == "fail" and "beyond embedding padding" in r.message


def test_padding_only_vocab_difference_passes(tiny_llama, padded_draft):
    r = by_name(run_checks(tiny_llama, padded_draft))["vocab size"]
    assert r.status == "pass" and "padding-only" in r.message and "400" in r.message


def test_padding_only_refused_for_a_backend_that_does_not_pad(monkeypatch, tiny_llama, padded_draft):
    fake = types.ModuleType("specbuild.engines.nopad")
    monkeypatch.setitem(sys.modules, "specbuild.engines.nopad", fake)
    r = by_name(run_checks(tiny_llama, padded_draft, backend="nopad"))["vocab size"]
    assert r.status == "fail" and "--backend embedded" in r.message
    fake.PADS_DRAFT_VOCAB = True
    assert by_name(run_checks(tiny_llama, padded_draft, backend="nopad"))["vocab size"].status == "pass"


def test_config_vocab_smaller_than_tokenizer_fails(tmp_path, tiny_llama, tiny_llama_draft):
    draft = variant(tiny_llama_draft, tmp_path / "d", vocab_size=100)
    r = by_name(run_checks(tiny_llama, draft))["vocab size"]
    assert r.status == "fail" and "smaller than its tokenizer" in r.message


def test_unsupported_architecture_fails(tmp_path, tiny_llama, tiny_llama_draft):
    draft = variant(tiny_llama_draft, tmp_path / "d", architectures=["GPT2LMHeadModel"])
    r = by_name(run_checks(tiny_llama, draft))["draft architecture"]
    assert r.status == "fail"
    assert "GPT2LMHeadModel" in r.message and "LlamaForCausalLM" in r.message


def test_backend_hook_overrides_architectures(monkeypatch, tmp_path, tiny_llama, tiny_llama_draft):
    fake = types.ModuleType("specbuild.engines.fakebackend")
    fake.SUPPORTED_ARCHITECTURES = ("GPT2LMHeadModel",)
    monkeypatch.setitem(sys.modules, "specbuild.engines.fakebackend", fake)
    assert backend_support("fakebackend")[0] == ("GPT2LMHeadModel",)
    assert backend_support("no-such-backend")[0] == EMBEDDED_ARCHITECTURES
    r = by_name(run_checks(tiny_llama, tiny_llama_draft, backend="fakebackend"))["target architecture"]
    assert r.status == "fail" and "fakebackend" in r.message


@pytest.mark.parametrize("rope, status", [
    ({"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}, "fail"),
    ({"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0}, "pass"),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}, "pass"),
])
def test_rope_types(tmp_path, tiny_llama, tiny_llama_draft, rope, status):
    draft = variant(tiny_llama_draft, tmp_path / "d", rope_parameters=rope)
    r = by_name(run_checks(tiny_llama, draft))["draft engine settings"]
    assert r.status == status, r.message
    if status == "fail":
        assert "'yarn'" in r.message and "llama3" in r.message


def test_bad_heads_and_quantized_fail(tmp_path, tiny_llama, tiny_llama_draft):
    draft = variant(tiny_llama_draft, tmp_path / "d", num_key_value_heads=3, head_dim=None,
                    quantization_config={"quant_method": "gptq"})
    r = by_name(run_checks(tiny_llama, draft))["draft engine settings"]
    assert r.status == "fail"
    assert "not a multiple of num_key_value_heads" in r.message and "gptq" in r.message


def test_safetensors_header_accepts_every_dtype_safetensors_knows(tmp_path):
    """The header is read by `safetensors` itself: dtypes a hand-written table missed (F8_E8M0 scales of MX
    formats, complex) are valid files, not corruption."""
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "mx.safetensors"
    save_file({"scale": torch.ones(4).to(torch.float8_e8m0fnu), "w": torch.zeros(2, 3),
               "c": torch.zeros(2, dtype=torch.complex64)}, str(path))
    header = read_safetensors_header(path)
    assert header["scale"] == {"dtype": "F8_E8M0", "shape": [4]}
    assert header["w"]["shape"] == [2, 3] and header["c"]["dtype"] == "C64"


def test_truncated_safetensors_fails(tmp_path, tiny_llama, tiny_llama_draft):
    draft = variant(tiny_llama_draft, tmp_path / "d")
    truncate(draft / "model.safetensors", 0.6)
    with pytest.raises(ValueError, match="truncated"):
        read_safetensors_header(draft / "model.safetensors")
    results = by_name(run_checks(tiny_llama, draft))
    assert results["draft weights"].status == "fail" and "Re-download" in results["draft weights"].message
    assert results["draft size"].status == "fail"


def test_corrupt_safetensors_header_fails(tmp_path, tiny_llama, tiny_llama_draft):
    draft = variant(tiny_llama_draft, tmp_path / "d")
    data = bytearray((draft / "model.safetensors").read_bytes())
    data[8:20] = b"#not json!!!"
    (draft / "model.safetensors").write_bytes(bytes(data))
    r = by_name(run_checks(tiny_llama, draft))["draft weights"]
    assert r.status == "fail" and "invalid JSON in header" in r.message


def test_missing_tokenizer_files_fail(tmp_path, tiny_llama, tiny_llama_draft):
    draft = variant(tiny_llama_draft, tmp_path / "d")
    (draft / "tokenizer.json").unlink()
    results = by_name(run_checks(tiny_llama, draft))
    assert results["draft tokenizer files"].status == "fail"
    assert "save_pretrained" in results["draft tokenizer files"].message
    assert results["same tokenizer"].status == "fail"


def test_draft_size_rules(tiny_llama, tiny_llama_draft):
    larger = by_name(run_checks(tiny_llama_draft, tiny_llama))["draft size"]
    assert larger.status == "fail" and "--force" in larger.message
    forced = by_name(run_checks(tiny_llama_draft, tiny_llama, force=True))["draft size"]
    assert forced.status == "warn"
    same = by_name(run_checks(tiny_llama, tiny_llama))["draft size"]
    assert same.status == "warn" and "1.0x" in same.message


def test_format_table_lists_every_check(tiny_llama, tiny_llama_draft):
    results = run_checks(tiny_llama, tiny_llama_draft)
    table = format_table(results).splitlines()
    assert table[0].split() == ["CHECK", "STATUS", "MESSAGE"]
    assert len(table) == len(results) + 2
