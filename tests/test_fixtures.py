import json

from transformers import AutoModelForCausalLM, AutoTokenizer


def test_tiny_models_load_and_share_tokenizer(tiny_llama, tiny_llama_draft, tiny_qwen2):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tok("The quick brown fox")["input_ids"]
    assert ids and tok.decode(ids) == "The quick brown fox"
    for d in (tiny_llama, tiny_llama_draft, tiny_qwen2):
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["vocab_size"] == len(tok)
        assert (d / "model.safetensors").exists()
    m = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    assert m.config.model_type == "qwen2"
