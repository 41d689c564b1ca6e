"""Which TensorRT-LLM generation a version belongs to, and the container that goes with it.

Two generations (each fact's upstream source is in the version table, core/upstream_facts.json):

- **engine**: `convert_checkpoint` / `from_hugging_face(...).save_checkpoint` -> `trtllm-build` ->
  Triton `inflight_batcher_llm` (draft-target through the BLS model). Exists up to TensorRT-LLM 1.2.1
  (legacy since 1.0) and was deleted on TensorRT-LLM main after it (PRs #15763, #15907, #15918, #16369),
  so >= 1.3 is refused for it with the LLM-API alternative. The Triton models of each release are the
  version-table families of upstream_facts.json (0.18, 0.19, 0.20, 0.21, 1.0, 1.1, 1.2).
- **llmapi**: TensorRT-LLM 1.0 .. 1.2.x, PyTorch backend, no engines: `speculative_config` (DraftTarget) in
  Triton's llmapi model.yaml and in a `trtllm-serve` YAML; field names per release in `llmapi.py`.

The default pin is the newest stable release, 1.2.1 (PyPI, 2026-04), in its Triton container.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from specbuild.core.errors import UsageError

ENGINE = "engine"
LLMAPI = "llmapi"
GENERATIONS = (ENGINE, LLMAPI)

DEFAULT_VERSION = "1.2.1"

# [lo, hi): the engine path from the BLS draft-target model (0.10) to its last release (1.2.x); the LLM-API
# DraftTarget path from the PyTorch default (1.0) to the newest release whose field names are in llmapi.py.
ENGINE_RANGE = (Version("0.10.0"), Version("1.3.0"))
LLMAPI_RANGE = (Version("1.0.0"), Version("1.3.0"))
FAST_LOGITS_SINCE = Version("0.15.0")
ENGINE_REMOVED = Version("1.3.0")
ENGINE_REMOVED_REASON = (
    "the TensorRT engine path (trtllm-build, convert_checkpoint.py, Triton's inflight_batcher_llm C++ backend and "
    "its BLS draft-target model) ends with TensorRT-LLM 1.2.1: it was deleted on TensorRT-LLM main after it "
    "(NVIDIA/TensorRT-LLM PRs #15763, #15907, #15918, #16369)")

# Pinned Triton containers per version-table family (major.minor -> tag); sources and exactness in
# upstream_facts.json (each family's `container` and its provenance).
ENGINE_CONTAINERS = {
    "0.18": "nvcr.io/nvidia/tritonserver:25.03-trtllm-python-py3",
    "0.20": "nvcr.io/nvidia/tritonserver:25.06-trtllm-python-py3",
    "0.21": "nvcr.io/nvidia/tritonserver:25.08-trtllm-python-py3",
    "1.0": "nvcr.io/nvidia/tritonserver:25.09-trtllm-python-py3",
    "1.1": "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3",
    "1.2": "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3",
}
LLMAPI_CONTAINER = "nvcr.io/nvidia/tensorrt-llm/release:{version}"
# The one release a family's pinned container carries, where the family has several: 26.04 carries 1.2.1, and no
# tritonserver container carries 1.2.0 (r26.03 carries 1.2.0rc8, r26.04 .. r26.07 carry 1.2.1: the backend's
# release-branch Dockerfiles, TENSORRTLLM_VER; inferred, the compatibility matrix read stops at 25.12).
CONTAINER_CARRIES = {"1.2": "1.2.1"}
NO_CONTAINER = {"1.2.0": "no tritonserver:<yy.mm>-trtllm-python-py3 container carries TensorRT-LLM 1.2.0: 26.03 carries "
                         "1.2.0rc8 and 26.04 .. 26.07 carry 1.2.1 (the backend's release-branch Dockerfiles r26.03 .. "
                         "r26.07, TENSORRTLLM_VER; inferred: the compatibility matrix read stops at 25.12)"}


def triton_container(version: str) -> str | None:
    """The pinned tritonserver container that carries exactly this TensorRT-LLM release, or None."""
    v = Version(str(version))
    family = f"{v.major}.{v.minor}"
    carried = CONTAINER_CARRIES.get(family)
    if carried is not None and v.base_version != carried:
        return None
    return ENGINE_CONTAINERS.get(family)


@dataclass(frozen=True)
class Recipe:
    """The resolved toolchain: TensorRT-LLM version, generation, container tag."""

    trtllm_version: str
    generation: str
    container: str
    detected: bool          # True when the version came from an importable tensorrt_llm
    backend_family: str | None = None   # engine path: the version-table family (upstream_facts), e.g. "0.18"
    untested: bool = False  # engine path: the version is not in the table and was accepted with --force

    def to_dict(self) -> dict[str, object]:
        return {"trtllm_version": self.trtllm_version, "generation": self.generation,
                "container": self.container, "detected": self.detected,
                "backend_family": self.backend_family, "untested": self.untested}


def table_versions() -> list[str]:
    """Engine-path TensorRT-LLM versions whose tensorrtllm_backend release is in the version table."""
    from specbuild.core.upstream_facts import supported_versions
    return supported_versions()


def supported_matrix() -> str:
    """A human-readable table of what is supported (used in refusals and docs)."""
    lines = [
        "supported TensorRT-LLM combinations:",
        f"  engine path (trtllm-build + Triton inflight_batcher_llm BLS): TensorRT-LLM "
        f"{', '.join(table_versions())} (the releases in the version table, core/upstream_facts.json); "
        f"containers: " + ", ".join(f"{CONTAINER_CARRIES.get(fam, fam + '.x')} -> {tag.split(':')[-1]}"
                                    for fam, tag in ENGINE_CONTAINERS.items())
        + "; others need --container-tag; a version outside the table only with --force (its templates are then "
        "the nearest older family's, unverified); none from 1.3 on (the engine path was removed after 1.2.1)",
        f"  llmapi path (PyTorch backend, speculative_config DraftTarget): {LLMAPI_RANGE[0]} <= version < "
        f"{LLMAPI_RANGE[1]}; container {LLMAPI_CONTAINER.format(version='<version>')} (trtllm-serve) or the "
        "tritonserver:<yy.mm>-trtllm-python-py3 of the release (Triton llmapi model)",
        f"  default: TensorRT-LLM {DEFAULT_VERSION}; 1.0-1.2.x offer both paths: --trtllm-generation engine|llmapi "
        "(default llmapi).",
    ]
    return "\n".join(lines)


def parse_version(text: str) -> Version:
    try:
        return Version(str(text).strip())
    except InvalidVersion as e:
        raise UsageError(f"--trtllm-version {text!r} is not a version number (e.g. 0.18.0).\n"
                         f"{supported_matrix()}") from e


def detect_installed() -> str | None:
    """`tensorrt_llm.__version__` when the package imports here, else None."""
    try:
        import tensorrt_llm  # noqa: F401  (heavy; only on GPU machines)
    except Exception:
        return None
    return str(getattr(tensorrt_llm, "__version__", "")) or None


def default_generation(version: Version) -> str:
    return LLMAPI if version >= LLMAPI_RANGE[0] else ENGINE


def resolve(requested: str | None = None, generation: str | None = None,
            container_tag: str | None = None, installed: str | None = None, force: bool = False) -> Recipe:
    """Pick the recipe for a requested version (or the installed one, or the pinned default).

    Raises UsageError, with the supported matrix in the message, for an unknown or unsupported
    combination, and when the requested version differs from the installed tensorrt_llm.
    """
    if requested and installed and parse_version(requested).base_version != parse_version(installed).base_version:
        raise UsageError(f"--trtllm-version {requested} was requested but tensorrt_llm {installed} is installed "
                         "here; drop --trtllm-version to use the installed one, or run in the container of "
                         f"{requested}.\n{supported_matrix()}")
    text = requested or installed or DEFAULT_VERSION
    version = parse_version(text)
    gen = generation or default_generation(version)
    if gen not in GENERATIONS:
        raise UsageError(f"unknown TensorRT-LLM generation {gen!r}; choose engine or llmapi.\n{supported_matrix()}")
    lo, hi = ENGINE_RANGE if gen == ENGINE else LLMAPI_RANGE
    if gen == ENGINE and Version(version.base_version) >= ENGINE_REMOVED:
        raise UsageError(f"TensorRT-LLM {text} has no engine path: {ENGINE_REMOVED_REASON}. Use the LLM-API path "
                         f"instead: --trtllm-generation llmapi (PyTorch backend, speculative_config DraftTarget; "
                         f"specbuild writes it for {LLMAPI_RANGE[0]}..{LLMAPI_RANGE[1]} exclusive, e.g. "
                         f"--trtllm-version {DEFAULT_VERSION}), or pin --trtllm-version 1.2.1 for engines.\n"
                         f"{supported_matrix()}")
    if not lo <= Version(version.base_version) < hi:
        raise UsageError(f"TensorRT-LLM {text} does not support the {gen} path for draft-target speculative "
                         f"decoding.\n{supported_matrix()}")
    family, untested = None, False
    if gen == ENGINE:
        from specbuild.core.upstream_facts import family_of, nearest_family
        family = family_of(str(version))
        if family is None:
            if not force:
                raise UsageError(f"TensorRT-LLM {text}: its tensorrtllm_backend release is not in the version table, "
                                 f"so specbuild cannot write a repository known to match its Triton models. "
                                 f"Supported: {', '.join(table_versions())}. Pass --force to use the nearest older "
                                 f"family's templates unverified, or add the release to the table "
                                 f"(python -m specbuild.core.upstream_facts extract ...).\n"
                                 f"{supported_matrix()}")
            family, untested = nearest_family(str(version)), True
    if container_tag:
        container = container_tag
    elif gen == LLMAPI:
        container = LLMAPI_CONTAINER.format(version=version.base_version)
    else:
        container = triton_container(str(version)) or ""
        if not container and version.base_version in NO_CONTAINER:
            raise UsageError(f"TensorRT-LLM {text}: {NO_CONTAINER[version.base_version]}. Pass --container-tag (an "
                             f"image you built with {version.base_version}), or use --trtllm-version "
                             f"{CONTAINER_CARRIES[f'{version.major}.{version.minor}']}.\n{supported_matrix()}")
        if not container:
            raise UsageError(f"no pinned Triton container is known for TensorRT-LLM {text}; pass --container-tag "
                             f"(the tritonserver:<yy.mm>-trtllm-python-py3 image that ships it) or use "
                             f"--trtllm-version {DEFAULT_VERSION}.\n{supported_matrix()}")
    return Recipe(trtllm_version=str(version), generation=gen, container=container,
                  detected=installed is not None, backend_family=family, untested=untested)


def supports_fast_logits(recipe: Recipe) -> bool:
    return recipe.generation == ENGINE and Version(recipe.trtllm_version) >= FAST_LOGITS_SINCE
