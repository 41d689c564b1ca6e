"""Pre-flight checks on a (target, draft) pair: can these two checkpoints do speculative decoding together?

Each check yields a `CheckResult(name, status, message)`; status is `pass`, `warn` or `fail`, and the
message names the problem and the fix. `run_checks` runs them all (it never stops at the first failure,
so the user sees every problem at once); `specbuild check` prints them as a table, `convert` refuses on
any `fail`. The architecture check consults `specbuild.engines.<backend>.SUPPORTED_ARCHITECTURES` (and
`SUPPORTED_ROPE_TYPES`) when the backend package defines them, else the embedded engine's lists below.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specbuild.core.paths import PICKLE_SUFFIXES, model_files
from specbuild.core.constants import EMBEDDED_ARCHITECTURES

EMBEDDED_ROPE_TYPES = ("default", "linear", "llama3")
TOKENIZER_FILE_SETS = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: str          # "pass" | "warn" | "fail"
    message: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def failures(results: list[CheckResult]) -> list[CheckResult]:
    return [r for r in results if r.status == "fail"]


def format_table(results: list[CheckResult]) -> str:
    width = max([len(r.name) for r in results] + [5])
    lines = [f"{'CHECK':<{width}}  STATUS  MESSAGE", f"{'-' * width}  ------  -------"]
    lines += [f"{r.name:<{width}}  {r.status.upper():<6}  {r.message}" for r in results]
    return "\n".join(lines)


def failure_message(results: list[CheckResult]) -> str:
    bad = failures(results)
    body = "\n".join(f"  - {r.name}: {r.message}" for r in bad)
    return f"{len(bad)} pre-flight check(s) failed:\n{body}"


# ---------------------------------------------------------------------------------------------- safetensors

def read_safetensors_header(path: Path) -> dict[str, Any]:
    """Read and validate a safetensors header with `safetensors` itself (every dtype it knows, its own
    checks that the header covers the file exactly). No tensor data is read.

    Raises ValueError describing the corruption; returns {tensor name: {"dtype", "shape"}}.
    """
    from safetensors import SafetensorError, safe_open

    size = os.path.getsize(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            header = {}
            for name in f.keys():
                sl = f.get_slice(name)
                header[name] = {"dtype": sl.get_dtype(), "shape": list(sl.get_shape())}
    except SafetensorError as e:
        msg = str(e)
        hint = " (truncated?)" if "incomplete" in msg or "too small" in msg or "not fully covered" in msg else ""
        raise ValueError(f"{path.name} ({size} bytes) is not readable safetensors: {msg}; the file looks "
                         f"truncated or corrupt{hint}") from None
    return header


def parameter_count(model_dir: Path) -> int:
    """Number of parameters, from safetensors headers (no weights read) or, for pickle, a memory-mapped load."""
    total = 0
    for f in model_files(model_dir):
        if f.suffix == ".safetensors":
            total += sum(math.prod(v["shape"]) for v in read_safetensors_header(f).values())
        else:
            import torch

            state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            total += sum(t.numel() for t in state.values() if hasattr(t, "numel"))
    return total


# ---------------------------------------------------------------------------------------------- per-model

def _config(path: Path) -> dict[str, Any]:
    cfg = json.loads((path / "config.json").read_text())
    return cfg.get("text_config", cfg) if "vocab_size" not in cfg else cfg


def _check_weights(role: str, path: Path) -> CheckResult:
    files = model_files(path)
    if not files:
        return CheckResult(f"{role} weights", "fail", f"{path} has no weight files; pass a complete model directory.")
    if files[0].suffix in PICKLE_SUFFIXES:
        return CheckResult(f"{role} weights", "warn", f"{len(files)} pickle file(s) (allowed by --allow-pickle); "
                           "they are re-saved as safetensors at convert.")
    for f in files:
        try:
            read_safetensors_header(f)
        except ValueError as e:
            return CheckResult(f"{role} weights", "fail", f"{e}. Re-download or re-export {path}.")
    return CheckResult(f"{role} weights", "pass", f"{len(files)} safetensors file(s), headers and sizes consistent")


def _check_tokenizer_files(role: str, path: Path) -> CheckResult:
    for group in TOKENIZER_FILE_SETS:
        if all((path / f).is_file() for f in group):
            return CheckResult(f"{role} tokenizer files", "pass", "+".join(group))
    return CheckResult(f"{role} tokenizer files", "fail",
                       f"{path} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json+merges.txt). Copy "
                       "the tokenizer files of the model into the directory (AutoTokenizer.save_pretrained).")


def backend_support(backend: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(architectures, rope types) the backend can run; its package may override the embedded defaults."""
    try:
        mod = importlib.import_module(f"specbuild.engines.{backend}")
    except ImportError:
        mod = None
    return (tuple(getattr(mod, "SUPPORTED_ARCHITECTURES", EMBEDDED_ARCHITECTURES)),
            tuple(getattr(mod, "SUPPORTED_ROPE_TYPES", EMBEDDED_ROPE_TYPES)))


def rope_type(cfg: dict[str, Any]) -> str:
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return str(rope.get("rope_type") or rope.get("type") or "default")


def _check_architecture(role: str, cfg: dict[str, Any], backend: str) -> CheckResult:
    archs, _ = backend_support(backend)
    arch = (cfg.get("architectures") or ["<none>"])[0]
    if arch not in archs:
        return CheckResult(f"{role} architecture", "fail",
                           f"{arch} is not supported by the {backend} backend (supported: {', '.join(archs)}). "
                           "Pick a checkpoint of a supported architecture"
                           + (" or try --backend trtllm." if backend == "embedded" else "."))
    return CheckResult(f"{role} architecture", "pass", arch)


def _check_engine_settings(role: str, cfg: dict[str, Any], backend: str) -> CheckResult:
    _, ropes = backend_support(backend)
    problems = []
    rt = rope_type(cfg)
    if rt not in ropes:
        problems.append(f"rope type {rt!r} is not supported (supported: {', '.join(ropes)})")
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
    hidden = cfg.get("hidden_size")
    if not heads or not hidden:
        problems.append("config.json lacks num_attention_heads/hidden_size")
    else:
        if not cfg.get("head_dim") and hidden % heads:
            problems.append(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        if heads % kv:
            problems.append(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"activation {cfg['hidden_act']!r} is not supported (only silu)")
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        problems.append(f"the checkpoint is quantized ({method}); pass a full-precision checkpoint")
    if problems:
        return CheckResult(f"{role} engine settings", "fail",
                           f"the {backend} engine cannot run this model: " + "; ".join(problems) + ".")
    sliding = cfg.get("use_sliding_window") or (cfg.get("model_type") == "mistral" and cfg.get("sliding_window"))
    if sliding:
        return CheckResult(f"{role} engine settings", "warn",
                           f"sliding-window attention ({cfg.get('sliding_window')}) is ignored: outputs match the "
                           "reference only for sequences shorter than the window; keep max tokens below it.")
    return CheckResult(f"{role} engine settings", "pass", f"rope {rt}, {heads} heads / {kv} kv heads")


# ---------------------------------------------------------------------------------------------- the pair

def _tokenizer_facts(path: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    merges: Any = None
    if (path / "tokenizer.json").is_file():
        merges = json.loads((path / "tokenizer.json").read_text()).get("model", {}).get("merges")
    elif (path / "merges.txt").is_file():
        merges = (path / "merges.txt").read_text().splitlines()
    specials = {k: (getattr(tok, k, None), getattr(tok, f"{k}_id", None)) for k in ("bos_token", "eos_token",
                                                                                    "pad_token")}
    return {"vocab": tok.get_vocab(), "merges": merges, "specials": specials,
            "chat_template": getattr(tok, "chat_template", None), "size": len(tok)}


def _compare_tokenizers(t: dict[str, Any], d: dict[str, Any]) -> list[str]:
    diffs = []
    if t["vocab"] != d["vocab"]:
        differ = [k for k in t["vocab"] if d["vocab"].get(k) != t["vocab"][k]]
        extra = [k for k in d["vocab"] if k not in t["vocab"]]
        example = ", ".join(f"{k!r}: {t['vocab'][k]} vs {d['vocab'].get(k)}" for k in differ[:3])
        diffs.append(f"token->id maps differ ({len(differ)} target tokens map elsewhere or are missing, {len(extra)} "
                     f"draft-only tokens{'; e.g. ' + example if example else ''})")
    if t["merges"] != d["merges"]:
        diffs.append("BPE merges differ")
    for k, tv in t["specials"].items():
        dv = d["specials"][k]
        if tv != dv:
            diffs.append(f"{k} differs ({tv[0]!r}/{tv[1]} vs {dv[0]!r}/{dv[1]})")
    if t["chat_template"] != d["chat_template"]:
        diffs.append("chat templates differ")
    return diffs


def _check_tokenizer_pair(target: Path, draft: Path) -> tuple[CheckResult, dict | None, dict | None]:
    try:
        t, d = _tokenizer_facts(target), _tokenizer_facts(draft)
    except Exception as e:  # transformers raises many types for broken tokenizer files
        return (CheckResult("same tokenizer", "fail", f"a tokenizer could not be loaded ({type(e).__name__}: {e}); "
                            "fix or re-export the tokenizer files."), None, None)
    diffs = _compare_tokenizers(t, d)
    if diffs:
        return (CheckResult("same tokenizer", "fail", "target and draft tokenizers differ: " + "; ".join(diffs)
                            + ". Speculative decoding needs one tokenizer: pick a draft from the target's model "
                            "family (same tokenizer files)."), t, d)
    return CheckResult("same tokenizer", "pass", f"identical ({t['size']} tokens, merges, specials, chat "
                       "template)"), t, d


def backend_pads_vocab(backend: str) -> bool:
    """Whether the backend's convert resizes a padding-only draft vocab (`PADS_DRAFT_VOCAB` in its package)."""
    if backend == "embedded":
        return True
    try:
        return bool(getattr(importlib.import_module(f"specbuild.engines.{backend}"), "PADS_DRAFT_VOCAB", False))
    except ImportError:
        return False


def _check_vocab(tcfg: dict, dcfg: dict, t: dict | None, d: dict | None, same_tokenizer: bool,
                 backend: str = "embedded") -> CheckResult:
    vt, vd = tcfg.get("vocab_size"), dcfg.get("vocab_size")
    if t is None or d is None:
        return CheckResult("vocab size", "fail", "cannot compare vocabularies without both tokenizers; fix the "
                           "tokenizer check first.")
    for role, v, tok in (("target", vt, t), ("draft", vd, d)):
        if not isinstance(v, int) or v < tok["size"]:
            return CheckResult("vocab size", "fail", f"the {role}'s config vocab_size {v} is smaller than its "
                               f"tokenizer ({tok['size']} tokens): the checkpoint is inconsistent; re-export it.")
    if vt == vd:
        return CheckResult("vocab size", "pass", f"{vt} for both")
    if not same_tokenizer or t["size"] != d["size"]:
        return CheckResult("vocab size", "fail", f"vocab sizes differ ({vt} vs {vd}) beyond embedding padding "
                           f"(tokenizers: {t['size']} vs {d['size']} tokens). Use a draft with the target's "
                           "tokenizer and vocabulary.")
    if not backend_pads_vocab(backend):
        return CheckResult("vocab size", "fail", f"padding-only difference ({vt} vs {vd}, tokenizer {t['size']}), "
                           f"but the {backend} backend needs identical vocab sizes. Pad the draft first: `specbuild "
                           "convert --backend embedded` writes it resized to WORKDIR/checkpoints/draft; pass that "
                           "directory as --draft.")
    return CheckResult("vocab size", "pass", f"padding-only difference ({vt} vs {vd}, tokenizer {t['size']}): "
                       f"convert resizes the draft's embedding and lm_head to {vt}")


def _check_sizes(target: Path, draft: Path, force: bool) -> CheckResult:
    try:
        pt, pd = parameter_count(target), parameter_count(draft)
    except (ValueError, OSError, RuntimeError) as e:
        return CheckResult("draft size", "fail", f"cannot count parameters ({e}); fix the weights check first.")
    ratio = pt / pd if pd else float("inf")
    sizes = f"target {pt / 1e6:.1f}M params, draft {pd / 1e6:.1f}M"
    if pd > pt:
        if force:
            return CheckResult("draft size", "warn", f"{sizes}: the draft is larger than the target (--force given); "
                               "speculation will be slower than plain decoding.")
        return CheckResult("draft size", "fail", f"{sizes}: the draft is larger than the target, so speculation "
                           "can only slow decoding down. Swap --target/--draft, pick a smaller draft, or pass "
                           "--force to proceed anyway.")
    if ratio < 2:
        return CheckResult("draft size", "warn", f"{sizes}: the draft is only {ratio:.1f}x smaller; speculation pays "
                           "off when a draft step is much cheaper than a target step (aim for 5-10x or more).")
    return CheckResult("draft size", "pass", f"{sizes} ({ratio:.1f}x smaller)")


def run_checks(target: os.PathLike | str, draft: os.PathLike | str, *, backend: str = "embedded",
               force: bool = False) -> list[CheckResult]:
    """Every pre-flight check on resolved local HF directories (see `specbuild.pipeline.sources.resolve`)."""
    target, draft = Path(os.fspath(target)), Path(os.fspath(draft))
    results: list[CheckResult] = []
    cfgs = {}
    for role, path in (("target", target), ("draft", draft)):
        cfgs[role] = _config(path)
        results += [_check_weights(role, path), _check_tokenizer_files(role, path),
                    _check_architecture(role, cfgs[role], backend), _check_engine_settings(role, cfgs[role], backend)]
    if all(r.status != "fail" for r in results if r.name.endswith("tokenizer files")):
        tok, t, d = _check_tokenizer_pair(target, draft)
    else:
        tok, t, d = CheckResult("same tokenizer", "fail", "tokenizer files are missing; see above."), None, None
    results += [tok, _check_vocab(cfgs["target"], cfgs["draft"], t, d, tok.status == "pass", backend)]
    if all(r.status != "fail" for r in results if r.name.endswith("weights")):
        results.append(_check_sizes(target, draft, force))
    else:
        results.append(CheckResult("draft size", "fail", "cannot compare sizes of unreadable weights; see above."))
    return results
