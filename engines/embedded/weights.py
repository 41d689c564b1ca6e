"""Load a convert-stage checkpoint dir (config.json + *.safetensors, optionally sharded with
model.safetensors.index.json, HF weight names) into the embedded `Transformer`, fusing QKV and gate/up."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specbuild.engines.embedded.model import ModelConfig, Transformer, rope_inv_freq
from specbuild.core.errors import SourceError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise SourceError(f"dtype {name!r} is not supported; use one of {sorted(set(DTYPES))}.") from None


def read_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise SourceError(f"{model_dir} has no config.json; pass a checkpoint directory written by "
                          f"`specbuild convert` (or a Hugging Face safetensors directory).")
    return json.loads(path.read_text())


def _safetensor_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise SourceError(f"{model_dir}: shards {missing} named in model.safetensors.index.json are missing; "
                              f"re-run `specbuild convert`.")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SourceError(f"{model_dir} holds no *.safetensors; re-run `specbuild convert` "
                          f"(pickled .bin checkpoints are not loaded by the embedded engine).")
    return files


def load_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in _safetensor_files(Path(model_dir)):
        state.update(load_file(str(f)))
    return state


def load_model(model_dir: str | Path, *, dtype="float32", device="cpu") -> Transformer:
    """Build the decoder for `model_dir` with fused weights, in eval mode, on `device`."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_hf(read_config(model_dir))
    dt = torch_dtype(dtype)
    sd = load_state(model_dir)

    def take(name: str) -> torch.Tensor:
        try:
            return sd.pop(name)
        except KeyError:
            raise SourceError(f"{model_dir}: weight {name!r} is missing from the safetensors; the checkpoint "
                              f"is incomplete or not a {cfg.model_type} model.") from None

    out: dict[str, torch.Tensor] = {"embed.weight": take("model.embed_tokens.weight"),
                                    "norm.weight": take("model.norm.weight")}
    for i in range(cfg.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        a = p + "self_attn."
        out[q + "qkv.weight"] = torch.cat([take(a + "q_proj.weight"), take(a + "k_proj.weight"),
                                           take(a + "v_proj.weight")])
        if cfg.qkv_bias:
            out[q + "qkv.bias"] = torch.cat([take(a + "q_proj.bias"), take(a + "k_proj.bias"),
                                             take(a + "v_proj.bias")])
        out[q + "o.weight"] = take(a + "o_proj.weight")
        out[q + "gate_up.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        out[q + "down.weight"] = take(p + "mlp.down_proj.weight")
        out[q + "input_norm.weight"] = take(p + "input_layernorm.weight")
        out[q + "post_norm.weight"] = take(p + "post_attention_layernorm.weight")
    if cfg.tie_word_embeddings or "lm_head.weight" not in sd:
        sd.pop("lm_head.weight", None)
        out["lm_head.weight"] = out["embed.weight"]
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    leftovers = [k for k in sd if "rotary_emb" not in k]
    if leftovers:
        raise SourceError(f"{model_dir}: unexpected weights {leftovers[:5]} (e.g. attention biases the config does "
                          f"not declare); this architecture variant is not supported by the embedded engine.")

    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict({k: v.to(dt) for k, v in out.items()}, strict=True, assign=True)
    model.inv_freq = rope_inv_freq(cfg)
    if cfg.tie_word_embeddings or out["lm_head.weight"] is out["embed.weight"]:
        model.lm_head.weight = model.embed.weight
    return model.to(device).eval().requires_grad_(False)


def load_quantized_model(model_dir, *, dtype="float32", device="cpu") -> "torch.nn.Module":
    """Load a directory written by ``save_quantized_model`` into the engine's ``Transformer``."""
    from pathlib import Path

    from safetensors.torch import load_file

    from specbuild.engines.embedded.quant import (INT8_WEIGHTS, BlockLinear, Int8Linear,
                                                  load_quantized_state_dict_)

    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.json"
    info = json.loads(cfg_path.read_text()).get("specbuild_quantization") if cfg_path.is_file() else None
    path = model_dir / (info or {}).get("weights", INT8_WEIGHTS)
    if not info or not path.is_file():
        raise SourceError(f"{model_dir} has no quantized weights + config.json: it is not a draft written by "
                          "`specbuild build --draft-quantize int8|int4`; rebuild the engine.")
    cfg = ModelConfig.from_hf(json.loads(cfg_path.read_text()))
    tensors = load_file(str(path))
    with torch.device("meta"):
        model = Transformer(cfg)
    load_quantized_state_dict_(model, tensors)
    dt = torch_dtype(dtype)
    quantized = {n for n, m in model.named_modules() if isinstance(m, (Int8Linear, BlockLinear))}
    rest = {k: (v.to(dt) if v.is_floating_point() else v) for k, v in tensors.items()
            if k.rsplit(".", 1)[0] not in quantized}
    missing, unexpected = model.load_state_dict(rest, strict=False, assign=True)
    missing = [k for k in missing if k.rsplit(".", 1)[0] not in quantized]
    if missing or unexpected:
        raise SourceError(f"{path}: tensors do not match the model config (missing {missing[:3]}, unexpected "
                          f"{unexpected[:3]}); rebuild with `specbuild build --force`.")
    model.inv_freq = rope_inv_freq(cfg)
    return model.to(device).eval().requires_grad_(False)
