"""Test support for the TensorRT-LLM backend (tests/test_trtllm_*.py).

TensorRT-LLM cannot exist on CPU-only CI, so three stand-ins are built here, each only recording what
our code hands it so tests can check the exact arguments, argv and files:

- a `tensorrt_llm` package (Mapping, models.<Class>.from_hugging_face/save_checkpoint/quantize,
  QuantConfig, QuantAlgo) that appends every call to a JSON-lines log;
- a `trtllm-build` executable that logs its argv and writes the engine config.json the real tool
  writes (build_config.speculative_decoding_mode as the integer flag, max_draft_len, ...);
- the container's `all_models` Python model directories (copied, not run).
"""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from pathlib import Path

from specbuild.core.manifest import HashCache
from specbuild.pipeline.stage import PlanStep, StageContext, stage_dir

STANDIN_INIT = '''
__version__ = "{version}"


class Mapping:
    def __init__(self, world_size=1, rank=0, tp_size=1, pp_size=1, **kw):
        self.world_size, self.rank, self.tp_size, self.pp_size = world_size, rank, tp_size, pp_size

    def as_dict(self):
        return {{"world_size": self.world_size, "rank": self.rank, "tp_size": self.tp_size,
                "pp_size": self.pp_size}}
'''

STANDIN_MODELS = '''
import json, os
from pathlib import Path


def _log(**record):
    with open(os.environ["TRTLLM_STANDIN_LOG"], "a") as f:
        f.write(json.dumps(record) + "\\n")


class _Model:
    def __init__(self, mapping):
        self.mapping = mapping

    @classmethod
    def from_hugging_face(cls, model_dir, dtype, mapping=None, quant_config=None, **kw):
        _log(call="from_hugging_face", cls=cls.__name__, model_dir=str(model_dir), dtype=dtype,
             mapping=mapping.as_dict(), quant=quant_config.as_dict(), kwargs=sorted(kw))
        return cls(mapping)

    def save_checkpoint(self, output_dir, save_config=True):
        _log(call="save_checkpoint", output_dir=str(output_dir), save_config=save_config, rank=self.mapping.rank)
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{self.mapping.rank}.safetensors").write_bytes(b"")
        if save_config:
            (out / "config.json").write_text(json.dumps({"architecture": type(self).__name__}))

    @classmethod
    def quantize(cls, model_dir, output_dir, dtype="auto", mapping=None, quant_config=None, **kw):
        _log(call="quantize", cls=cls.__name__, model_dir=str(model_dir), dtype=dtype, mapping=mapping.as_dict(),
             quant=quant_config.as_dict(), kwargs=kw)
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")
        for r in range(mapping.world_size):
            (out / f"rank{r}.safetensors").write_bytes(b"")


class LLaMAForCausalLM(_Model):
    pass


class QWenForCausalLM(_Model):
    pass
'''

STANDIN_MODELING_UTILS = '''
class QuantConfig:
    def __init__(self, quant_algo=None, kv_cache_quant_algo=None):
        self.quant_algo, self.kv_cache_quant_algo = quant_algo, kv_cache_quant_algo

    def as_dict(self):
        return {"quant_algo": self.quant_algo, "kv_cache_quant_algo": self.kv_cache_quant_algo}
'''

STANDIN_QUANT = '''
class QuantAlgo:
    W8A16 = "W8A16"
    W4A16 = "W4A16"
    FP8 = "FP8"
'''

FAKE_TRTLLM_BUILD = '''#!{python}
"""Stand-in trtllm-build: logs argv, writes config.json + rank engines like the real tool."""
import json, os, sys
from pathlib import Path
argv = sys.argv[1:]
with open(os.environ["TRTLLM_STANDIN_LOG"], "a") as f:
    f.write(json.dumps({{"call": "trtllm-build", "argv": argv}}) + "\\n")
def opt(name, default=None):
    return argv[argv.index(name) + 1] if name in argv else default
out = Path(opt("--output_dir"))
out.mkdir(parents=True, exist_ok=True)
mode = 2 if opt("--speculative_decoding_mode") == "draft_tokens_external" else 1
if os.environ.get("STANDIN_DROP_SPEC_MODE"):
    mode = 1
cfg = {{"pretrained_config": {{"architecture": "LlamaForCausalLM"}},
       "build_config": {{"max_batch_size": int(opt("--max_batch_size")),
                        "max_draft_len": int(opt("--max_draft_len", 0)),
                        "speculative_decoding_mode": mode,
                        "gather_generation_logits": "--gather_generation_logits" in argv,
                        "plugin_config": {{"use_paged_context_fmha": opt("--use_paged_context_fmha") == "enable"}}}}}}
(out / "config.json").write_text(json.dumps(cfg))
for shard in Path(opt("--checkpoint_dir")).glob("rank*.safetensors"):
    (out / shard.name.replace(".safetensors", ".engine")).write_bytes(b"engine")
'''


def make_standin_tensorrt_llm(root: Path, version: str = "0.18.0") -> Path:
    pkg = root / "tensorrt_llm"
    (pkg / "models").mkdir(parents=True)
    (pkg / "quantization").mkdir()
    (pkg / "__init__.py").write_text(STANDIN_INIT.format(version=version))
    (pkg / "models" / "__init__.py").write_text(STANDIN_MODELS)
    (pkg / "models" / "modeling_utils.py").write_text(STANDIN_MODELING_UTILS)
    (pkg / "quantization" / "__init__.py").write_text(STANDIN_QUANT)
    return root


def make_fake_trtllm_build(bindir: Path) -> Path:
    bindir.mkdir(parents=True, exist_ok=True)
    exe = bindir / "trtllm-build"
    exe.write_text(FAKE_TRTLLM_BUILD.format(python=sys.executable))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def make_backend_models(root: Path) -> Path:
    """The container's all_models layout: Python model dirs (model.py) next to upstream configs."""
    for rel in ("inflight_batcher_llm/preprocessing", "inflight_batcher_llm/postprocessing",
                "inflight_batcher_llm/tensorrt_llm_bls", "llmapi/tensorrt_llm"):
        d = root / rel / "1"
        d.mkdir(parents=True)
        (d / "model.py").write_text(textwrap.dedent(f"# container model {rel}\n"))
    (root / "inflight_batcher_llm/tensorrt_llm_bls/1/lib").mkdir()
    (root / "inflight_batcher_llm/tensorrt_llm_bls/1/lib/decode.py").write_text("# container BLS loop\n")
    return root


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def context(stage: str, workdir: Path, options: dict, upstream: dict | None = None) -> StageContext:
    """A StageContext as run_stage builds it for a dry run (out_dir = the final stage directory)."""
    prev = {"convert": None, "build": "convert", "deploy": "build"}[stage]
    up_dir = stage_dir(workdir, prev) if (prev and upstream is not None) else None
    return StageContext(stage=stage, backend="trtllm", workdir=workdir, out_dir=stage_dir(workdir, stage),
                        options={**options, "backend": "trtllm"}, upstream=upstream, upstream_dir=up_dir,
                        hashes=HashCache(None))


def written(steps: list[PlanStep]) -> dict[str, str]:
    return {s.path: s.content for s in steps if s.kind == "write"}


def runs(steps: list[PlanStep]) -> list[list[str]]:
    return [s.argv for s in steps if s.kind == "run"]


def env_with_path(bindir: Path) -> str:
    return f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"


# ---- upstream's own Triton models (tests that run them) --------------------------------------------------------
BACKEND_DIR_ENV = "SPECBUILD_TRTLLM_BACKEND_DIR"     # one checkout of a release tag (or its inflight_batcher_llm)
UPSTREAM_ENV = "SPECBUILD_TRTLLM_UPSTREAM"           # trees gathered by scripts/gather_trtllm_upstream.py
# Where a clone finds them without the variable: `../shared/upstream/trtllm-backend/` beside the repository
# (upstream's own v0.18.0, v0.19.0 and c2e65b8 trees with SOURCE.json and the licence; CI clones have it).
SHARED_UPSTREAM = Path(__file__).resolve().parents[1].parent / "shared" / "upstream" / "trtllm-backend"
GATHER_HINT = ("gather them outside the project with `python scripts/gather_trtllm_upstream.py --out "
               f"{SHARED_UPSTREAM} --backend-git <tensorrtllm_backend clone>` (and/or "
               "--trtllm-checkout <TensorRT-LLM clone at a release tag>), point SPECBUILD_TRTLLM_UPSTREAM at such a "
               "folder, or set SPECBUILD_TRTLLM_BACKEND_DIR to a tensorrtllm_backend checkout of a release tag")


def gathered_root() -> Path:
    """$SPECBUILD_TRTLLM_UPSTREAM, else ../shared/upstream/trtllm-backend beside the repository when it is there,
    else the cache's trtllm-upstream/."""
    from specbuild.core.paths import cache_dir
    if os.environ.get(UPSTREAM_ENV):
        return Path(os.environ[UPSTREAM_ENV]).expanduser()
    if SHARED_UPSTREAM.is_dir():
        return SHARED_UPSTREAM
    return cache_dir() / "trtllm-upstream"


def gathered_trees() -> dict[str, Path]:
    """{version-table family: tree} of the gathered trees (SOURCE.json names the family each matched)."""
    out: dict[str, Path] = {}
    root = gathered_root()
    if not root.is_dir():
        return out
    for src in sorted(root.glob("*/SOURCE.json")):
        fam = json.loads(src.read_text()).get("family")
        if fam and (src.parent / "inflight_batcher_llm").is_dir():
            out[fam] = src.parent
    return out


def upstream_tree(family: str | None = None):
    """A gathered tree (of `family`, else the newest family gathered) -> (its all_models dir, family), or skip."""
    import pytest
    from packaging.version import Version
    trees = gathered_trees()
    if not trees:
        pytest.skip(f"needs upstream's Python models in {gathered_root()}: {GATHER_HINT}")
    if family is None:
        family = max(trees, key=Version)
    if family not in trees:
        pytest.skip(f"no gathered tree of family {family} in {gathered_root()} (have {sorted(trees)}): {GATHER_HINT}")
    return trees[family], family


def upstream_llmapi_tree():
    """The newest gathered tree holding upstream's llmapi model (llmapi/tensorrt_llm/1/model.py), or skip."""
    import pytest
    from packaging.version import Version
    trees = {f: t for f, t in gathered_trees().items() if (t / "llmapi" / "tensorrt_llm" / "1" / "model.py").is_file()}
    if not trees:
        pytest.skip(f"needs upstream's llmapi model.py in {gathered_root()}: {GATHER_HINT}")
    fam = max(trees, key=Version)
    return trees[fam], fam


def upstream_backend_dir():
    """(models dir, tag family) from $SPECBUILD_TRTLLM_BACKEND_DIR (a tensorrtllm_backend checkout of a release
    tag, or its all_models/inflight_batcher_llm), else the newest gathered tree; or pytest.skip with the reason."""
    import pytest

    from specbuild.core.upstream_facts import extract_tree, families, models_dir
    raw = os.environ.get(BACKEND_DIR_ENV)
    if not raw:
        tree, _ = upstream_tree()
        raw = str(tree)
    root = models_dir(raw)
    tree = extract_tree(root)
    for name, fam in families().items():
        if fam["models"] == tree:
            return root, name
    pytest.fail(f"{root} matches no family of the version table ({sorted(families())}); add its release with "
                "python -m specbuild.core.upstream_facts extract")


def trtllm_chain(workdir: Path, target: Path, draft: Path, *, version: str, backend_models: Path,
                 max_batch_size: int = 4, max_seq_len: int = 512, max_draft_len: int = 4,
                 container_tag: str | None = None, **deploy_extra) -> Path:
    """convert -> build -> deploy --backend trtllm through run_stage, with the recording tensorrt_llm stand-in and
    fake trtllm-build (set up by the caller: PYTHONPATH / PATH / TRTLLM_STANDIN_LOG)."""
    from specbuild.pipeline.stage import run_stage

    common = {"trtllm_version": version, **({"container_tag": container_tag} if container_tag else {})}
    run_stage("convert", backend="trtllm", workdir=workdir, inputs={"pair": "x"},
              options={"target_dir": str(target), "draft_dir": str(draft), **common})
    run_stage("build", backend="trtllm", workdir=workdir, inputs={}, upstream_stage="convert",
              options={"max_batch_size": max_batch_size, "max_seq_len": max_seq_len, "max_input_len": max_seq_len // 2,
                       "max_draft_len": max_draft_len, **common})
    run_stage("deploy", backend="trtllm", workdir=workdir, inputs={}, upstream_stage="build",
              options={"backend_models_dir": str(backend_models), **common, **deploy_extra})
    return workdir
