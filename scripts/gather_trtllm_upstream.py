#!/usr/bin/env python3
"""Gather upstream's own Triton models (TensorRT-LLM's triton_backend) into a directory outside the project,
for `specbuild serve --rehearse --backend-models-dir DIR` and the rehearsal tests, which read
`../shared/upstream/trtllm-backend/` beside the repository (the default --out) unless SPECBUILD_TRTLLM_UPSTREAM
names another folder.

Nothing gathered is copied into the project: the output is one tree per source, laid out as the container's
/app/all_models (`<out>/<label>/inflight_batcher_llm/<model>/{config.pbtxt,1/...}`, `<label>/llmapi/...`),
with `<label>/SOURCE.json` naming the repository, ref, commit, date and the version-table family it matches.

Sources (any number; each gives one tree):

  --backend-git DIR --ref REF   a git dir or clone of triton-inference-server/tensorrtllm_backend: its
                                all_models/ at REF (tags v0.18.0 .. v0.19.0; commit c2e65b8 = the tree that
                                moved into TensorRT-LLM for 0.20). Default refs: v0.18.0 v0.19.0 c2e65b8.
  --trtllm-checkout DIR         a TensorRT-LLM checkout (e.g. `git clone --depth 1 -b v1.2.1
                                https://github.com/NVIDIA/TensorRT-LLM`): its triton_backend/all_models/.
  --container-models DIR        a container's /app/all_models (docker cp out of the release image).

Example:
  python scripts/gather_trtllm_upstream.py --backend-git /path/to/tensorrtllm_backend.git   # -> ../shared/...
  pytest tests/test_rehearsal.py
  python scripts/gather_trtllm_upstream.py --out ~/elsewhere --backend-git /path/to/tensorrtllm_backend.git
  SPECBUILD_TRTLLM_UPSTREAM=~/elsewhere pytest tests/test_rehearsal.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

DEFAULT_REFS = ("v0.18.0", "v0.19.0", "c2e65b88d85255be30cf50440a91662abeb497dd")
TREES = ("inflight_batcher_llm", "llmapi")
# beside the repository, where the rehearsal tests look when SPECBUILD_TRTLLM_UPSTREAM is unset
SHARED_OUT = Path(__file__).resolve().parents[1].parent / "shared" / "upstream" / "trtllm-backend"


def _git(git_dir: Path, *args: str) -> str:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True,
                          text=True).stdout


def _git_dir(path: Path) -> Path:
    return path / ".git" if (path / ".git").exists() else path


def _family(tree: Path) -> str | None:
    try:
        from specbuild.core.upstream_facts import extract_tree, families
    except ImportError:
        return None
    try:
        facts = extract_tree(tree / "inflight_batcher_llm")
    except FileNotFoundError:
        return None
    return next((name for name, fam in families().items() if fam["models"] == facts), None)


def _finish(dst: Path, source: dict) -> Path:
    source["family"] = _family(dst)
    (dst / "SOURCE.json").write_text(json.dumps(source, indent=2) + "\n")
    print(f"{dst}: {source.get('repo')} {source.get('ref', '')} {source.get('commit', '')[:12]} "
          f"-> family {source['family']}")
    return dst


def from_backend_git(git_dir: Path, ref: str, out: Path) -> Path:
    git_dir = _git_dir(git_dir)
    commit = _git(git_dir, "rev-parse", f"{ref}^{{commit}}").strip()
    date = _git(git_dir, "log", "-1", "--format=%cs", commit).strip()
    names = _git(git_dir, "ls-tree", "--name-only", commit, "all_models/").split()
    if "all_models/inflight_batcher_llm" not in names:
        raise SystemExit(f"{ref} ({commit[:12]}) has no all_models/inflight_batcher_llm: from v0.20.0 the models "
                         "live in TensorRT-LLM's triton_backend/ (use --trtllm-checkout, or ref c2e65b8 for 0.20)")
    label = ref if not ref.startswith(commit[:7]) else f"backend-{commit[:7]}"
    dst = out / label
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "t.tar"
        subprocess.run(["git", f"--git-dir={git_dir}", "archive", "-o", str(archive), commit,
                        *[f"all_models/{t}" for t in TREES if f"all_models/{t}" in names]], check=True)
        with tarfile.open(archive) as tf:
            tf.extractall(tmp, filter="data") if sys.version_info >= (3, 12) else tf.extractall(tmp)  # noqa: S202
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(Path(tmp) / "all_models", dst)
    return _finish(dst, {"repo": "github.com/triton-inference-server/tensorrtllm_backend", "ref": ref,
                         "commit": commit, "date": date, "path": "all_models/"})


def from_tree(root: Path, out: Path, label: str, repo: str) -> Path:
    for cand in (root / "triton_backend" / "all_models", root / "all_models", root):
        if (cand / "inflight_batcher_llm").is_dir() or (cand / "llmapi").is_dir():
            break
    else:
        raise SystemExit(f"{root} holds no all_models/ (inflight_batcher_llm or llmapi)")
    dst = out / label
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for t in TREES:
        if (cand / t).is_dir():
            shutil.copytree(cand / t, dst / t, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    source = {"repo": repo, "path": str(cand)}
    try:
        source["commit"] = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True,
                                          capture_output=True, text=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        pass
    return _finish(dst, source)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", type=Path, default=SHARED_OUT,
                    help=f"directory to gather into, outside the project (default {SHARED_OUT})")
    ap.add_argument("--backend-git", type=Path, help="tensorrtllm_backend git dir or clone")
    ap.add_argument("--ref", action="append", help=f"refs of --backend-git (default {' '.join(DEFAULT_REFS)})")
    ap.add_argument("--trtllm-checkout", type=Path, action="append", default=[])
    ap.add_argument("--container-models", type=Path, action="append", default=[])
    a = ap.parse_args(argv)
    project = Path(__file__).resolve().parents[1]
    out = a.out.expanduser().resolve()
    if out == project or project in out.parents:
        raise SystemExit(f"--out {out} is inside the project: upstream files must stay outside it")
    if not (a.backend_git or a.trtllm_checkout or a.container_models):
        raise SystemExit("name at least one source: --backend-git, --trtllm-checkout or --container-models")
    out.mkdir(parents=True, exist_ok=True)
    if a.backend_git:
        for ref in a.ref or DEFAULT_REFS:
            from_backend_git(a.backend_git, ref, out)
    for i, root in enumerate(a.trtllm_checkout):
        from_tree(root, out, f"trtllm-checkout-{i}" if len(a.trtllm_checkout) > 1 else "trtllm-checkout",
                  "github.com/NVIDIA/TensorRT-LLM")
    for i, root in enumerate(a.container_models):
        from_tree(root, out, f"container-{i}" if len(a.container_models) > 1 else "container", "container")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
