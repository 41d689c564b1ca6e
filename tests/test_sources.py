"""Model sources: local dirs, pickle refusal, custom code refusal, GGUF validation, hub offline, demo names."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from specbuild.core.errors import SourceError
from specbuild.pipeline.sources import cache_dir, convert_gguf, resolve


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECBUILD_CACHE", str(root))
    return root


def pickle_only(src, dst):
    """A copy of `src` whose weights are a pickle pytorch_model.bin instead of safetensors."""
    shutil.copytree(src, dst)
    state = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    torch.save(state, dst / "pytorch_model.bin")
    return dst


def test_local_dir(tiny_llama):
    src = resolve(str(tiny_llama))
    assert src.kind == "local" and src.weights == "safetensors"
    assert os.fspath(src) == str(tiny_llama.resolve())
    assert src.describe()["source"] == str(tiny_llama)


def test_nonexistent_path(tmp_path):
    with pytest.raises(SourceError, match="does not exist") as e:
        resolve(str(tmp_path / "nope" / "model"))
    assert "demo:smollm2-135m-instruct" in str(e.value)


def test_dir_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(SourceError, match="no config.json"):
        resolve(str(tmp_path / "m"))


def test_pickle_refused_without_flag(tmp_path, tiny_llama_draft):
    d = pickle_only(tiny_llama_draft, tmp_path / "p")
    with pytest.raises(SourceError, match="--allow-pickle") as e:
        resolve(str(d))
    assert "pytorch_model.bin" in str(e.value)
    assert resolve(str(d), allow_pickle=True).weights == "pickle"


def test_remote_code_refused_without_flag(tmp_path, tiny_llama):
    d = tmp_path / "rc"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match="--trust-remote-code"):
        resolve(str(d))
    assert resolve(str(d), trust_remote_code=True).kind == "local"


def test_file_that_is_not_gguf(tmp_path, cache):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"PK\x03\x04 definitely a zip, not a gguf" * 10)
    with pytest.raises(SourceError, match="not a GGUF file"):
        resolve(str(f))
    assert not (cache / "gguf").exists()


def test_truncated_gguf_fails_cleanly(tmp_path, cache):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 40)
    with pytest.raises(SourceError, match="could not load"):
        resolve(str(f))
    # No finished (or half-written) conversion is left in the cache.
    assert [p.name for p in (cache / "gguf").iterdir()] == []
    assert cache_dir() == cache


def test_convert_gguf_reuses_finished_cache_entry(tmp_path, cache, tiny_llama):
    """A cache entry with the completion marker is returned without re-conversion (keyed by sha256)."""
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\x00" * 60)
    from specbuild.core.manifest import sha256_file

    final = cache / "gguf" / sha256_file(f)[:32]
    shutil.copytree(tiny_llama, final)
    (final / ".specbuild-source.json").write_text("{}")
    assert convert_gguf(f, cache) == final
    assert resolve(str(f)).path == final


def test_unknown_demo_lists_known(cache):
    with pytest.raises(SourceError, match="demo:smollm2-135m-instruct"):
        resolve("demo:gpt-17")


def test_hub_id_offline_error(monkeypatch, cache):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: fails at once
    with pytest.raises(SourceError) as e:
        resolve("someorg/some-model")
    msg = str(e.value)
    assert "someorg/some-model" in msg and "local directory" in msg and ".gguf" in msg


def test_unwritable_cache(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("SPECBUILD_CACHE", str(blocker / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\x00" * 60)
    with pytest.raises(SourceError, match="SPECBUILD_CACHE"):
        resolve(str(f))

