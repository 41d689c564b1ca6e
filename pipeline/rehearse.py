"""`specbuild serve --rehearse`: run the TensorRT-LLM repository on the CPU tritonserver before a GPU box.

What runs (assembled in `<workdir>/rehearsal/triton/`, the deployed repository is not touched):

- `ensemble`, `preprocessing`, `postprocessing`, `tensorrt_llm_bls`: the configs exactly as
  `deploy --backend trtllm` wrote them; the Python models (`1/`) of preprocessing, postprocessing and
  tensorrt_llm_bls are **upstream's own**, copied from `--backend-models-dir` (a checkout of the matching
  tensorrtllm_backend tag, its `all_models/inflight_batcher_llm`, or the container's /app/all_models).
- `tensorrt_llm`, `tensorrt_llm_draft`: the deployed configs with only the `backend:` line changed to
  "python", served by the stand-in (model_repository/rehearsal/tensorrt_llm_standin, engines/trtllm/standin.py)
  that implements the C++ backend's request semantics, external draft tokens included, with the embedded
  engine's parts.

Weights: the trtllm convert writes TensorRT-LLM checkpoints, which the embedded loader cannot read, so the
stand-in loads the Hugging Face source directories convert recorded in its manifest
(`extra.trtllm_options.target_dir` / `draft_dir`, also in checkpoints/sources.json). Those directories must
still exist on this machine.

Refusals, each with the reason: no trtllm engine-path deployment; no or wrong `--backend-models-dir`; an
upstream tree whose configs do not match the deployed family (e.g. v0.19 models for a v0.18 deployment);
an upstream Python model needing a module this Python lacks; the source checkpoints gone.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from specbuild.core.errors import CheckFailed, ToolNotAvailable, UsageError
from specbuild.core.manifest import read_manifest
from specbuild.pipeline.stage import stage_dir

REHEARSAL_DIR = "rehearsal"
ENGINE_MODELS = ("tensorrt_llm", "tensorrt_llm_draft")
UPSTREAM_PYTHON_MODELS = ("preprocessing", "postprocessing", "tensorrt_llm_bls")
ROLE = {"tensorrt_llm": "target", "tensorrt_llm_draft": "draft"}
# Modules upstream's Python models import at module load (read from the v0.18.0 / v0.19.0 tags:
# preprocessing/1/model.py, postprocessing/1/model.py, tensorrt_llm_bls/1/{model.py,lib/*.py}).
UPSTREAM_IMPORTS = {"preprocessing": ("numpy", "requests", "PIL", "transformers"),
                    "postprocessing": ("numpy", "transformers"),
                    "tensorrt_llm_bls": ("numpy", "torch", "typing_extensions")}
_BACKEND_LINE = re.compile(r'^backend:\s*"tensorrtllm"\s*$', re.M)


def rehearsal_root(workdir: str | Path) -> Path:
    return Path(workdir).resolve() / REHEARSAL_DIR


def _deployment(workdir: Path) -> tuple[Path, dict[str, Any]]:
    deploy_dir = stage_dir(workdir, "deploy")
    manifest = read_manifest(deploy_dir, "deploy")
    if (manifest.get("options") or {}).get("backend") != "trtllm":
        raise UsageError(f"{deploy_dir} was not deployed with --backend trtllm; --rehearse rehearses the TensorRT-LLM "
                         "repository (the embedded deployment runs with plain `specbuild serve`).")
    recipe = (manifest.get("extra") or {}).get("recipe") or {}
    if recipe.get("generation") not in ("engine", "llmapi"):
        raise UsageError(f"the deployment in {deploy_dir} is the {recipe.get('generation')} path; --rehearse covers "
                         "the engine path (inflight_batcher_llm with tensorrt_llm_bls) and the llmapi path.")
    if not (deploy_dir / "triton").is_dir():
        raise UsageError(f"{deploy_dir}/triton is missing; re-run `specbuild deploy --backend trtllm`.")
    return deploy_dir, manifest


def _sources(workdir: Path, deploy_manifest: dict[str, Any]) -> dict[str, Path]:
    """The Hugging Face directories of target and draft, as convert recorded them."""
    rec: dict[str, Any] = {}
    try:
        conv = read_manifest(stage_dir(workdir, "convert"), "convert")
        rec = (conv.get("extra") or {}).get("trtllm_options") or conv.get("options") or {}
        kept = (conv.get("outputs") or {}).get("hf_checkpoints") or {}   # convert --rehearse kept them
        rec = {**rec, **{f"{role}_dir": str(stage_dir(workdir, "convert") / rel) for role, rel in kept.items()
                         if (stage_dir(workdir, "convert") / rel / "config.json").is_file()}}
    except Exception:  # noqa: BLE001 - fall back to sources.json / the deploy record
        sources = stage_dir(workdir, "convert") / "sources.json"
        if sources.is_file():
            data = json.loads(sources.read_text())
            rec = {f"{r}_dir": data[r]["dir"] for r in ("target", "draft") if r in data}
    rec = {**((deploy_manifest.get("extra") or {}).get("trtllm_options") or {}), **rec}
    out = {}
    for role in ("target", "draft"):
        value = rec.get(f"{role}_dir")
        if not value:
            raise UsageError(f"no {role} source recorded: convert's manifest in {stage_dir(workdir, 'convert')} has no "
                             f"{role}_dir; re-run `specbuild convert --backend trtllm`.")
        path = Path(value)
        if not (path / "config.json").is_file():
            raise ToolNotAvailable(f"the {role} source {path} (recorded by convert) is gone; the rehearsal loads the "
                                   "Hugging Face weights from there because the embedded loader cannot read "
                                   "TensorRT-LLM checkpoints. Restore it or re-run convert.")
        out[role] = path
    return out


def missing_modules() -> dict[str, list[str]]:
    """Per upstream model, the modules it imports at load that this Python cannot import."""
    out = {}
    for model, mods in UPSTREAM_IMPORTS.items():
        miss = [m for m in mods if importlib.util.find_spec(m) is None]
        if miss:
            out[model] = miss
    return out


def check_upstream(models_dir: Path, deployed: Path) -> list[str]:
    """Mismatches between the upstream tree's configs and the deployed ones (empty = the same release)."""
    from specbuild.engines.trtllm.repository import upstream_mismatches
    problems = []
    for model in (*UPSTREAM_PYTHON_MODELS, "ensemble", "tensorrt_llm"):
        theirs = models_dir / model / "config.pbtxt"
        if not theirs.is_file():
            problems.append(f"{theirs} is missing")
            continue
        problems += upstream_mismatches((deployed / model / "config.pbtxt").read_text(), theirs.read_text())
    return problems


def older_family_of_the_lineage(upstream: Path, family: str | None) -> dict[str, Any] | None:
    """When `upstream` is exactly the tree of a version-table family that the deployed `family` derives from
    (e.g. the 0.20 tree for a 1.2 deployment: same names, the later releases only add optional tensors), that
    family and the ids of the changes between them; else None."""
    from specbuild.core.upstream_facts import extract_tree, families
    if not family or family not in families():
        return None
    try:
        tree = extract_tree(upstream)
    except FileNotFoundError:
        return None
    changes: list[str] = []
    found = None
    name = family
    while name:                 # the oldest matching ancestor: the family the tree was read for
        fam = families()[name]
        if name != family and fam["models"] == tree:
            found = {"family": name, "changes": list(changes)}
        derived = fam.get("derived") or {}
        changes = [c["id"] for c in derived.get("changes", [])] + changes
        name = derived.get("from")
    return found


def _llmapi_upstream(backend_models_dir: str | Path) -> Path:
    """The llmapi model dir (holding 1/model.py) in a gathered tree, a checkout or a container's all_models."""
    p = Path(backend_models_dir).expanduser()
    for cand in (p, p / "llmapi" / "tensorrt_llm", p / "all_models" / "llmapi" / "tensorrt_llm",
                 p / "triton_backend" / "all_models" / "llmapi" / "tensorrt_llm"):
        if (cand / "1" / "model.py").is_file():
            return cand.resolve()
    raise UsageError(f"--backend-models-dir: {p} holds no llmapi/tensorrt_llm/1/model.py (upstream's Triton LLM-API "
                     "model); gather it with scripts/gather_trtllm_upstream.py.")


def _module_imports(path: Path) -> set[str]:
    import ast
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def prepare_llmapi(workdir: Path, deploy_dir: Path, manifest: dict[str, Any], backend_models_dir, *,
                   say: Callable[[str], None]) -> Path:
    """The llmapi repository with upstream's own model.py / helpers.py and the `tensorrt_llm` stand-in beside them."""
    if not backend_models_dir:
        raise UsageError("--rehearse needs --backend-models-dir: a tree with upstream's llmapi/tensorrt_llm/1/model.py "
                         "(scripts/gather_trtllm_upstream.py), a TensorRT-LLM checkout or a container's "
                         "/app/all_models.")
    upstream = _llmapi_upstream(backend_models_dir)
    deployed = deploy_dir / "triton" / "tensorrt_llm"
    local = {p.stem for p in (upstream / "1").glob("*.py")} | {"tensorrt_llm", "triton_python_backend_utils"}
    needed = set().union(*(_module_imports(p) for p in (upstream / "1").glob("*.py"))) - local
    missing = sorted(m for m in needed if importlib.util.find_spec(m) is None and m not in sys_stdlib())
    if missing:
        raise ToolNotAvailable(f"upstream's llmapi model ({upstream / '1'}) imports modules this Python lacks: "
                               f"{missing}; install them (e.g. pip install {' '.join(_pip_name(m) for m in missing)})"
                               " and retry.")
    opts = (manifest.get("extra") or {}).get("trtllm_options") or {}
    recipe = (manifest.get("extra") or {}).get("recipe") or {}
    root = rehearsal_root(workdir)
    tmp = root / "triton.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    dst = tmp / "tensorrt_llm"
    # The deployed model as a real deploy leaves it: what deploy rendered (config.pbtxt, 1/model.yaml), then
    # upstream's 1/ copied by deploy's own function, which keeps the rendered files (model.yaml included).
    from specbuild.engines.trtllm.deploy import copy_container_model, rendered_in
    shutil.copytree(deployed, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    rendered = (manifest.get("extra") or {}).get("rendered")
    ours = rendered_in(rendered, "tensorrt_llm") if rendered is not None else {"model.yaml"}
    copy_container_model(upstream / "1", dst / "1", ours=ours)
    pkg = resources.files("specbuild.model_repository") / "rehearsal" / "tensorrt_llm_llmapi" / "tensorrt_llm"
    _copy_resource_tree(pkg, dst / "1" / "tensorrt_llm")
    final_stats = root / "triton" / "tensorrt_llm" / "1" / "stats.json"
    (dst / "1" / "tensorrt_llm" / "_rehearsal.json").write_text(json.dumps(
        {"version": recipe.get("trtllm_version"), "max_seq_len": int(opts.get("max_seq_len") or 1024),
         "max_batch_size": min(int(opts.get("max_batch_size") or 4), 4), "stats_file": str(final_stats)},
        indent=2) + "\n")
    from specbuild.engines.trtllm.repository import upstream_mismatches
    theirs = upstream / "config.pbtxt"
    diffs = upstream_mismatches((deployed / "config.pbtxt").read_text(), theirs.read_text()) if theirs.is_file() \
        else [f"{theirs} is missing"]
    source = {}
    for cand in (upstream.parent.parent / "SOURCE.json", upstream.parent.parent.parent / "SOURCE.json"):
        if cand.is_file():
            source = json.loads(cand.read_text())
            break
    info = {"deployment": str(deploy_dir / "triton"), "generation": "llmapi",
            "trtllm_version": recipe.get("trtllm_version"), "upstream_model": str(upstream), "upstream_source": source,
            "config_differences_from_upstream_tree": diffs,
            "changed": {"tensorrt_llm/1/tensorrt_llm/": "added: the stand-in for the tensorrt_llm LLM API "
                                                       "(specbuild.engines.trtllm.llmapi_standin)"},
            "upstream_python_files": sorted(p.name for p in (upstream / "1").glob("*.py"))}
    (root / "rehearsal.json").write_text(json.dumps(info, indent=2) + "\n")
    repo = root / "triton"
    shutil.rmtree(repo, ignore_errors=True)
    tmp.rename(repo)
    if diffs:
        say(f"note: upstream's llmapi config.pbtxt in {upstream} differs from the deployed TensorRT-LLM "
            f"{recipe.get('trtllm_version')} one ({len(diffs)}: {diffs[:3]}...): that tree is another release's "
            "(the newest readable here); its model.py runs against the deployed config")
    say(f"rehearsal repository: {repo} (upstream's llmapi model.py from {upstream}, the tensorrt_llm stand-in on the "
        "embedded engine)")
    return repo


def sys_stdlib() -> set[str]:
    import sys
    return set(getattr(sys, "stdlib_module_names", ()))


def _pip_name(module: str) -> str:
    return {"yaml": "pyyaml", "mpi4py": "mpi4py mpich", "PIL": "pillow"}.get(module, module)


def _copy_resource_tree(src, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name == "__pycache__":
            continue
        if item.is_dir():
            _copy_resource_tree(item, dst / item.name)
        else:
            (dst / item.name).write_text(item.read_text())


def prepare(workdir: str | Path, backend_models_dir: str | Path | None, *, slots: int = 4,
            progress: Callable[[str], None] | None = None) -> Path:
    """Assemble `<workdir>/rehearsal/triton/` and return it (refusing with the reason when it cannot)."""
    say = progress or (lambda m: None)
    workdir = Path(workdir).resolve()
    deploy_dir, manifest = _deployment(workdir)
    if ((manifest.get("extra") or {}).get("recipe") or {}).get("generation") == "llmapi":
        return prepare_llmapi(workdir, deploy_dir, manifest, backend_models_dir, say=say)
    family = ((manifest.get("extra") or {}).get("recipe") or {}).get("backend_family")
    deployed = deploy_dir / "triton"
    upstream, older = _engine_path_upstream(backend_models_dir, manifest, deployed, family, say)
    missing = missing_modules()
    if missing:
        raise ToolNotAvailable(f"upstream's Python models import modules this Python lacks: {missing}; install them "
                               "(CPU builds are enough: torch is used for dlpack only) and retry.")
    sources = _sources(workdir, manifest)
    opts = (manifest.get("extra") or {}).get("trtllm_options") or {}
    root = rehearsal_root(workdir)
    repo = root / "triton"
    tmp = root / "triton.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for model_dir in sorted(p for p in deployed.iterdir() if (p / "config.pbtxt").is_file()):
        _rehearsal_model(model_dir, tmp / model_dir.name, upstream, sources, slots=slots,
                         max_seq_len=int(opts.get("max_seq_len") or 2048))
    info = {"deployment": str(deployed), "backend_family": family, "upstream_models": str(upstream),
            "upstream_family": older["family"] if older else family,
            "changes_not_in_upstream_models": older["changes"] if older else [],
            "sources": {k: str(v) for k, v in sources.items()},
            "changed": {m: 'backend: "tensorrtllm" -> backend: "python" (stand-in)' for m in ENGINE_MODELS},
            "upstream_python_models": list(UPSTREAM_PYTHON_MODELS)}
    (tmp / ".." / "rehearsal.json").resolve().write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(repo, ignore_errors=True)
    tmp.rename(repo)
    say(f"rehearsal repository: {repo} (upstream models from {upstream}, backend family {family}; "
        f"stand-in weights from {sources['target']} and {sources['draft']})")
    return repo


def _engine_path_upstream(backend_models_dir, manifest: dict[str, Any], deployed: Path, family: str | None,
                          say: Callable[[str], None]) -> tuple[Path, dict | None]:
    """Upstream's inflight_batcher_llm models for the deployed family -> (their dir, the older family of the same
    lineage they are, or None when they are the deployed one's); refused with the reason otherwise."""
    from specbuild.core.upstream_facts import models_dir

    if not backend_models_dir:
        raise UsageError("--rehearse needs --backend-models-dir: a checkout of tensorrtllm_backend at the tag of the "
                         f"deployed release (family {family}: "
                         f"git clone -b v{manifest['extra']['recipe']['trtllm_version']} "
                         "https://github.com/triton-inference-server/tensorrtllm_backend), its "
                         "all_models/inflight_batcher_llm, or a TensorRT-LLM container's /app/all_models.")
    try:
        upstream = models_dir(backend_models_dir)
    except FileNotFoundError as e:
        raise UsageError(f"--backend-models-dir: {e}.") from None
    for model in UPSTREAM_PYTHON_MODELS:
        if not (upstream / model / "1" / "model.py").is_file():
            raise UsageError(f"--backend-models-dir: {upstream / model / '1' / 'model.py'} is missing.")
    problems = check_upstream(upstream, deployed)
    if not problems:
        return upstream, None
    older = older_family_of_the_lineage(upstream, family)
    if older is None:
        raise CheckFailed(f"the upstream models in {upstream} are not the release this repository was deployed "
                          f"for (backend family {family}); check out the matching tag. Differences: "
                          f"{problems[:8]}" + (f" ... ({len(problems)} in all)" if len(problems) > 8 else ""))
    say(f"upstream's Python models in {upstream} are family {older['family']}'s, not {family}'s (the newest "
        f"full tree read here); the deployed {family} configs add {', '.join(older['changes'])}: optional "
        f"tensors those models neither read nor fill. With a {family} tree (scripts/gather_trtllm_upstream.py "
        "--trtllm-checkout) the rehearsal is exact.")
    return upstream, older


def _rehearsal_model(model_dir: Path, dst: Path, upstream: Path, sources: dict[str, Path], *, slots: int,
                     max_seq_len: int) -> None:
    """One model of the rehearsal repository: the deployed config; upstream's Python model, or for an engine model
    (`backend: "tensorrtllm"`) the stand-in on the Hugging Face weights."""
    name = model_dir.name
    (dst / "1").mkdir(parents=True)
    config = (model_dir / "config.pbtxt").read_text()
    if name in ENGINE_MODELS:
        new, n = _BACKEND_LINE.subn('backend: "python"', config)
        if n != 1:
            raise CheckFailed(f"{model_dir / 'config.pbtxt'} has no `backend: \"tensorrtllm\"` line to replace.")
        config = new
        standin = (resources.files("specbuild.model_repository") / "rehearsal" / "tensorrt_llm_standin"
                   / "model.py").read_text()
        (dst / "1" / "model.py").write_text(standin)
        (dst / "1" / "rehearsal.json").write_text(json.dumps(
            {"role": ROLE[name], "hf_dir": str(sources[ROLE[name]]), "slots": slots, "max_seq_len": max_seq_len,
             "dtype": "float32"}, indent=2) + "\n")
    elif name in UPSTREAM_PYTHON_MODELS:
        shutil.rmtree(dst / "1")
        shutil.copytree(upstream / name / "1", dst / "1", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (dst / "config.pbtxt").write_text(config)


def start(workdir: str | Path, opts=None, *, backend_models_dir: str | Path | None = None, slots: int = 4,
          progress: Callable[[str], None] | None = None):
    """prepare() then start the CPU tritonserver on it (pipeline.serve.start); returns its ServerInfo."""
    from specbuild.pipeline import serve
    repo = prepare(workdir, backend_models_dir, slots=slots, progress=progress)
    return serve.start(workdir, opts or serve.ServeOptions(), repository=repo, progress=progress)


def serve_foreground(workdir: str | Path, opts=None, *, backend_models_dir: str | Path | None = None,
                     progress: Callable[[str], None] | None = None):
    from specbuild.pipeline import serve
    repo = prepare(workdir, backend_models_dir, progress=progress)
    return serve.serve_foreground(workdir, opts or serve.ServeOptions(), repository=repo, progress=progress)


def engine_stats(workdir: str | Path) -> dict[str, dict[str, int]]:
    """The stand-ins' counters (requests, reused_tokens, computed_tokens, draft/accepted tokens) per model (an
    llmapi rehearsal: the LLM stand-in's requests, draft_tokens, accepted_tokens under "tensorrt_llm")."""
    out = {}
    for model in ENGINE_MODELS:
        f = rehearsal_root(workdir) / "triton" / model / "1" / "stats.json"
        if f.is_file():
            out[model] = json.loads(f.read_text())
    return out
