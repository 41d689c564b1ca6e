"""`convert` for the embedded backend: normalized target/ and draft/ checkpoints.

Each model directory gets safetensors weights cast to the chosen dtype, `config.json` (dtype and, for a
padded draft, vocab_size updated), `generation_config.json` if the source has one, and the tokenizer
files. When the target and draft vocabularies differ only by embedding padding (same tokenizer, both
vocab sizes >= the tokenizer's), the draft's embedding and lm_head rows are resized to the target's
vocab size (new rows are zero; rows past the tokenizer are never real tokens) and the manifest records
`vocab_resized: {from, to, tokenizer_size}` so the engine can mask those ids.

Driven by `specbuild.pipeline.convert.convert` through the stage runner; options used: target_dir, draft_dir,
dtype, force. The pre-flight checks that `pipeline.convert` ran on exactly these directories arrive as
`ctx.preflight`, and their results go into the manifest.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specbuild.core.errors import UsageError
from specbuild.core.manifest import sha256_file
from specbuild.core.paths import model_files
from specbuild.core.stage import PlanStep, StageContext, StageResult
from specbuild.core.constants import DTYPES, TOKENIZER_FILES

_RESIZABLE = ("embed_tokens", "lm_head", "wte", "word_embeddings")


def _dtype(name: str):
    import torch

    if name not in DTYPES:
        raise UsageError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}.")
    return getattr(torch, name)


def _read_config(src: Path) -> dict[str, Any]:
    return json.loads((src / "config.json").read_text())


def _weight_names(src: Path) -> list[str]:
    files = model_files(src)
    if len(files) == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]


def _side_files(src: Path) -> list[str]:
    return [n for n in TOKENIZER_FILES if (src / n).is_file()]


def _load(path: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    if path.suffix == ".safetensors":
        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)  # pickle: only with --allow-pickle


def _resize(t, rows: int):
    import torch

    if t.shape[0] >= rows:
        return t[:rows].clone()
    pad = torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype)
    return torch.cat([t, pad], dim=0)


def convert_model(src: Path, out: Path, *, dtype: str, vocab_size: int | None = None,
                  tokenizer_size: int | None = None, label: str = "") -> dict[str, Any]:
    """Write a normalized copy of the HF directory `src` into `out`; return its manifest entry."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    cfg = _read_config(src)
    old_vocab = cfg.get("vocab_size")
    resize = vocab_size is not None and vocab_size != old_vocab
    target_dtype = _dtype(dtype)
    files, names = model_files(src), _weight_names(src)
    weight_map: dict[str, str] = {}
    params = 0
    total_bytes = 0
    for f, name in zip(files, names):
        state = _load(f)
        tensors = {}
        seen: set[int] = set()
        for key, t in tqdm(state.items(), desc=f"{label} {f.name}".strip(), unit="tensor", file=sys.stderr,
                           leave=False, mininterval=0.5):
            if not isinstance(t, torch.Tensor):
                continue
            if t.is_floating_point():
                t = t.to(target_dtype)
            if resize and t.dim() >= 1 and t.shape[0] == old_vocab and any(r in key for r in _RESIZABLE):
                t = _resize(t, vocab_size)
            if t.data_ptr() in seen:  # tied weights from a pickle share storage; safetensors wants copies
                t = t.clone()
            seen.add(t.data_ptr())
            tensors[key] = t.contiguous()
            weight_map[key] = name
            params += t.numel()
            total_bytes += t.numel() * t.element_size()
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        del state, tensors
    if len(names) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    cfg["dtype"] = dtype
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtype
    if resize:
        cfg["vocab_size"] = vocab_size
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for n in _side_files(src):
        shutil.copyfile(src / n, out / n)
    entry = {"source_dir": str(src), "architecture": (cfg.get("architectures") or ["?"])[0],
             "params": params, "vocab_size": cfg.get("vocab_size"), "dtype": dtype,
             "files": {p.name: sha256_file(p) for p in sorted(out.iterdir()) if p.is_file()}}
    if resize:
        entry["vocab_resized"] = {"from": old_vocab, "to": vocab_size, "tokenizer_size": tokenizer_size}
    return entry


def _tokenizer_size(src: Path) -> int | None:
    tj = src / "tokenizer.json"
    if not tj.is_file():
        return None
    data = json.loads(tj.read_text())
    ids = list(data.get("model", {}).get("vocab", {}).values()) if isinstance(data.get("model", {}).get("vocab"),
                                                                               dict) else []
    ids += [t["id"] for t in data.get("added_tokens", [])]
    return max(ids) + 1 if ids else None


def run(ctx: StageContext) -> StageResult:
    opts = ctx.options
    target, draft = Path(opts["target_dir"]), Path(opts["draft_dir"])
    dtype = opts.get("dtype", "float32")
    _dtype(dtype)
    target_vocab = _read_config(target)["vocab_size"]
    ctx.progress(f"converting target {target} -> {dtype}")
    outputs = {"target": convert_model(target, ctx.out_dir / "target", dtype=dtype, label="target")}
    ctx.progress(f"converting draft {draft} -> {dtype}")
    outputs["draft"] = convert_model(draft, ctx.out_dir / "draft", dtype=dtype, vocab_size=target_vocab,
                                     tokenizer_size=_tokenizer_size(draft), label="draft")
    return StageResult(outputs=outputs, checks=list(ctx.preflight))


def plan(ctx: StageContext) -> list[PlanStep]:
    opts = ctx.options
    target, draft = Path(opts["target_dir"]), Path(opts["draft_dir"])
    dtype = opts.get("dtype", "float32")
    _dtype(dtype)
    steps = [PlanStep("note", note=f"embedded convert: cast floating-point weights to {dtype}")]
    target_vocab = _read_config(target).get("vocab_size")
    for role, src in (("target", target), ("draft", draft)):
        vocab = _read_config(src).get("vocab_size")
        if role == "draft" and vocab != target_vocab:
            steps.append(PlanStep("note", note=f"resize the draft's embedding/lm_head from {vocab} to {target_vocab}"))
        names = _weight_names(src) + (["model.safetensors.index.json"] if len(model_files(src)) > 1 else [])
        for name in [*names, "config.json", *_side_files(src)]:
            steps.append(PlanStep("write", path=str(ctx.out_dir / role / name)))
    steps.append(PlanStep("write", path=str(ctx.out_dir / "manifest.json")))
    return steps
