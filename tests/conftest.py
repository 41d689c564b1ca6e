from __future__ import annotations

from pathlib import Path

import pytest

import specbuild  # noqa: F401  (before torch: it sets torch's OpenMP wait policy, ./__init__.py)

from tinymodels import make_checkpoint, make_tokenizer


@pytest.fixture(scope="module")
def one_torch_thread():
    """Engine tests on tiny models: one intra-op thread is faster, and on a shared 2-core box OpenMP threads
    spinning against other processes make them 10-30x slower. Use with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def eng_self(tiny_llama):
    """An embedded engine whose draft is the target itself: every draft is accepted. Priced by the default cost
    model, not measured step costs (online, a draft that is the target costs a whole step and adaptive K would
    rightly stop drafting)."""
    from specbuild.engines.embedded import Engine

    return Engine.from_checkpoints(tiny_llama, tiny_llama, max_batch_size=4, max_seq_len=128, online_costs=False)


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tiny_tokenizer) -> Path:
    """Target: 4 layers, hidden 64."""
    return make_checkpoint(tmp_path_factory.mktemp("m") / "llama-target", tiny_tokenizer, layers=4, seed=1)


@pytest.fixture(scope="session")
def tiny_llama_draft(tmp_path_factory, tiny_tokenizer) -> Path:
    """An unrelated, smaller draft with the same tokenizer (acceptance near zero)."""
    return make_checkpoint(tmp_path_factory.mktemp("m") / "llama-draft", tiny_tokenizer, layers=1,
                           hidden=32, heads=2, kv_heads=1, intermediate=64, seed=2)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory, tiny_tokenizer) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("m") / "qwen2-target", tiny_tokenizer, arch="qwen2",
                           layers=2, tie=False, seed=3)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct as an HF directory (materialized once into $SPECBUILD_CACHE, ~1 min)."""
    from specbuild.pipeline.sources import resolve

    return resolve("demo:smollm2-135m-instruct").path


# Real tritonserver fixtures (running_server, server_workdir): see tests/servers.py.
pytest_plugins = ["servers"]
