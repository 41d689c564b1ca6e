"""The embedded decoder against Hugging Face: same checkpoint, same logits (prefill and incremental decode),
for Llama, Qwen2 (qkv bias, untied), RoPE variants and sharded checkpoints; ragged batches and KV rollback."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from specbuild.engines.embedded.kvcache import KVCache
from specbuild.engines.embedded.model import ragged_forward
from specbuild.engines.embedded.weights import load_model
from specbuild.core.errors import SourceError

ATOL = 2e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _cache(model, slots=3, max_seq=64):
    c = model.cfg
    return KVCache(num_layers=c.num_layers, num_slots=slots, kv_heads=c.num_kv_heads, max_seq=max_seq,
                   head_dim=c.head_dim, dtype=torch.float32, device="cpu")


def _hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _check_against_hf(model_dir, n_prefill=9, n_decode=4, slot=1):
    ids = torch.randint(0, 300, (n_prefill + n_decode,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = _hf_logits(model_dir, ids)
    m = load_model(model_dir)
    cache = _cache(m)
    pre = ragged_forward(m, cache, [slot], [0], [ids[:n_prefill]], "all")
    assert pre.shape == (n_prefill, m.cfg.vocab_size)
    torch.testing.assert_close(pre, ref[:n_prefill], atol=ATOL, rtol=1e-4)
    for t in range(n_prefill, n_prefill + n_decode):                     # incremental decode, one token a step
        step = ragged_forward(m, cache, [slot], [t], [[ids[t]]], "last")
        torch.testing.assert_close(step[0], ref[t], atol=ATOL, rtol=1e-4)


def test_llama_logits_match_hf(tiny_llama):
    _check_against_hf(tiny_llama)


def test_qwen2_logits_match_hf(tiny_qwen2):
    m = load_model(tiny_qwen2)
    assert m.cfg.qkv_bias and not m.cfg.tie_word_embeddings and m.layers[0].qkv.bias is not None
    assert m.lm_head.weight.data_ptr() != m.embed.weight.data_ptr()
    _check_against_hf(tiny_qwen2)


def test_tied_embeddings_share_storage(tiny_llama):
    m = load_model(tiny_llama)
    assert m.cfg.tie_word_embeddings and m.lm_head.weight is m.embed.weight


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16, "rope_theta": 500000.0},
])
def test_rope_variants_and_sharded_checkpoint_match_hf(tmp_path, tiny_tokenizer, rope):
    cfg = LlamaConfig(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, intermediate_size=96, max_position_embeddings=256,
                      rope_parameters=rope, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    out = tmp_path / "ckpt"
    model.save_pretrained(out, max_shard_size="200KB")                   # several shards + index.json
    assert (out / "model.safetensors.index.json").exists()
    assert json.loads((out / "config.json").read_text())["rope_parameters"]["rope_type"] == rope["rope_type"]
    _check_against_hf(out, n_prefill=20, n_decode=3)


def test_ragged_batch_equals_single_rows(tiny_llama):
    m = load_model(tiny_llama)
    rows = [[5, 9, 13, 200, 7], [42], [3, 4, 5]]
    starts = [0, 0, 0]
    batch_cache, single_cache = _cache(m), _cache(m)
    batched = ragged_forward(m, batch_cache, [2, 0, 1], starts, rows, "all")
    singles = torch.cat([ragged_forward(m, single_cache, [s], [0], [r], "all") for s, r in zip([2, 0, 1], rows)])
    torch.testing.assert_close(batched, singles, atol=1e-5, rtol=1e-5)
    last = ragged_forward(m, batch_cache, [0, 2], [1, 5], [[8, 9], [10]], "last")   # continue, mixed lengths
    ref0 = ragged_forward(m, single_cache, [0], [1], [[8, 9]], "last")
    ref2 = ragged_forward(m, single_cache, [2], [5], [[10]], "last")
    torch.testing.assert_close(last, torch.cat([ref0, ref2]), atol=1e-5, rtol=1e-5)


def test_kv_rollback_overwrites_rejected_positions(tiny_llama):
    """Write a 'rejected draft' at positions 6..9, roll back to 6 and continue: same logits as a clean run."""
    m = load_model(tiny_llama)
    ids = [11, 22, 33, 44, 55, 66]
    clean, dirty = _cache(m), _cache(m)
    ragged_forward(m, clean, [0], [0], [ids], "none")
    ragged_forward(m, dirty, [0], [0], [ids], "none")
    ragged_forward(m, dirty, [0], [6], [[1, 2, 3, 4]], "all")           # rejected draft
    a = ragged_forward(m, clean, [0], [6], [[77, 88]], "all")
    b = ragged_forward(m, dirty, [0], [6], [[77, 88]], "all")
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_loader_errors_are_actionable(tmp_path, tiny_llama):
    with pytest.raises(SourceError, match="config.json"):
        load_model(tmp_path)
    bad = tmp_path / "gemma"
    shutil.copytree(tiny_llama, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "gemma3"}))
    with pytest.raises(SourceError, match="not supported"):
        load_model(bad)
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").unlink()
    with pytest.raises(SourceError, match="safetensors"):
        load_model(bad)
