"""Pre-flight refusals and version/option resolution of the trtllm backend; messages must name the fix."""

from __future__ import annotations

import pytest

from specbuild.engines.trtllm.checks import check_vocab, speculative_mode, validate_engine_config
from specbuild.engines.trtllm.settings import settings_from
from specbuild.engines.trtllm.versions import ENGINE, LLMAPI, resolve, supported_matrix
from specbuild.core.errors import CheckFailed, UsageError


def engine_cfg(mode=2, k=4, gather=False, paged_fmha=True):
    return {"pretrained_config": {"architecture": "LlamaForCausalLM"},
            "build_config": {"speculative_decoding_mode": mode, "max_draft_len": k,
                             "gather_generation_logits": gather,
                             "plugin_config": {"use_paged_context_fmha": paged_fmha}}}


def test_target_engine_without_speculative_mode_is_refused_with_the_rebuild_flag():
    with pytest.raises(CheckFailed, match="--speculative_decoding_mode draft_tokens_external --max_draft_len K"):
        validate_engine_config(engine_cfg(mode=1, k=0), "target")
    with pytest.raises(CheckFailed, match="speculative"):
        validate_engine_config({"build_config": {}}, "target")


def test_target_engine_checks_max_draft_len_and_paged_context_fmha():
    assert validate_engine_config(engine_cfg(k=8), "target", max_draft_len=8) == {
        "role": "target", "speculative_decoding_mode": "draft_tokens_external", "max_draft_len": 8}
    with pytest.raises(CheckFailed, match="rebuild with --max-draft-len 10"):
        validate_engine_config(engine_cfg(k=4), "target", max_draft_len=10)
    with pytest.raises(CheckFailed, match="--use_paged_context_fmha enable"):
        validate_engine_config(engine_cfg(paged_fmha=False), "target")


def test_draft_engine_needs_generation_logits_when_draft_logits_are_used():
    with pytest.raises(CheckFailed, match="--gather_generation_logits"):
        validate_engine_config(engine_cfg(mode=1, k=0), "draft", use_draft_logits=True)
    ok = validate_engine_config(engine_cfg(mode=1, k=0, gather=True), "draft", use_draft_logits=True)
    assert ok["role"] == "draft"


def test_speculative_mode_reads_flags_and_names():
    assert speculative_mode(engine_cfg(mode=2)) == "draft_tokens_external"
    assert speculative_mode({"build_config": {"speculative_decoding_mode": "DRAFT_TOKENS_EXTERNAL"}}) == \
        "draft_tokens_external"
    assert speculative_mode({}) == "none"


def test_vocab_mismatch_names_the_fix():
    assert check_vocab({"vocab_size": 152064}, {"vocab_size": 152064}) == 152064
    with pytest.raises(CheckFailed, match="target vocab_size 152064, draft vocab_size 151936.*pad the draft"):
        check_vocab({"vocab_size": 152064}, {"vocab_size": 151936})


def test_version_matrix():
    r = resolve()                       # the default pin: the newest stable release, LLM-API path
    assert (r.trtllm_version, r.generation, r.container) == ("1.2.1", LLMAPI, "nvcr.io/nvidia/tensorrt-llm/release:1.2.1")
    r = resolve("1.2.1", generation=ENGINE)
    assert (r.backend_family, r.container) == ("1.2", "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3")
    r = resolve("0.18.0")
    assert (r.trtllm_version, r.generation, r.container) == (
        "0.18.0", ENGINE, "nvcr.io/nvidia/tritonserver:25.03-trtllm-python-py3")
    assert resolve("1.0.0").generation == LLMAPI
    for version, family, tag in (("0.20.0", "0.20", "25.06"), ("0.21.0", "0.21", "25.08"), ("1.0.0", "1.0", "25.09"),
                                 ("1.1.0", "1.1", "25.12"), ("1.2.1", "1.2", "26.04")):
        r = resolve(version, generation=ENGINE)
        assert (r.backend_family, r.container, r.untested) == (
            family, f"nvcr.io/nvidia/tritonserver:{tag}-trtllm-python-py3", False), version
    # no tritonserver container carries 1.2.0 (26.03: 1.2.0rc8; 26.04 .. 26.07: 1.2.1): not pinned to 26.04
    with pytest.raises(UsageError, match="no tritonserver.*carries TensorRT-LLM 1.2.0.*--container-tag.*1.2.1"):
        resolve("1.2.0", generation=ENGINE)
    assert resolve("1.2.0", generation=ENGINE, container_tag="my/tag:1").container == "my/tag:1"
    with pytest.raises(UsageError, match="not in the version table"):    # 0.17: no backend release read
        resolve("0.17.0", container_tag="my/tag:1")
    forced = resolve("0.17.0", container_tag="my/tag:1", force=True)
    assert (forced.container, forced.backend_family, forced.untested) == ("my/tag:1", "0.18", True)
    assert resolve("0.18.2").backend_family == "0.18" and resolve("0.19.0", container_tag="t:1").backend_family == "0.19"
    assert resolve(installed="0.18.2").detected is True
    for bad in ("0.9.0", "banana"):
        with pytest.raises(UsageError, match="supported TensorRT-LLM combinations"):
            resolve(bad)
    # past the engine path's end: refused for it with the reason and the LLM-API alternative, even with --force
    for force in (False, True):
        with pytest.raises(UsageError, match="has no engine path.*deleted.*--trtllm-generation llmapi") as e:
            resolve("1.3.0", generation=ENGINE, container_tag="x:1", force=force)
        assert "#15907" in str(e.value)
    with pytest.raises(UsageError, match="does not support the llmapi path"):
        resolve("1.3.0")
    with pytest.raises(UsageError, match="--container-tag"):
        resolve("0.19.0")
    with pytest.raises(UsageError, match="tensorrt_llm 0.18.0 is installed"):
        resolve("0.17.0", installed="0.18.0")
    assert "llmapi path" in supported_matrix()


def test_settings_validation_names_the_flag():
    s = settings_from({"tp": 2, "max_draft_len": 8})
    assert (s.tp, s.draft_tp, s.target_gpu_ids, s.shared_gpu, s.num_gpus) == (2, 2, "0,1", True, 2)
    with pytest.raises(UsageError, match="--max-seq-len"):
        settings_from({"max_input_len": 4096, "max_seq_len": 1024})
    with pytest.raises(UsageError, match="--quantization 'int3'"):
        settings_from({"quantization": "int3"})
    with pytest.raises(UsageError, match="--fast-logits exists only on the engine path"):
        settings_from({"trtllm_version": "1.1.0", "fast_logits": True})
    with pytest.raises(UsageError, match="--kv-cache-free-gpu-mem-fraction"):
        settings_from({"kv_cache_free_gpu_mem_fraction": 1.5})
    with pytest.raises(UsageError, match="--target-gpu-ids"):
        settings_from({"target_gpu_ids": "gpu0"})
