"""What each TensorRT-LLM LLM-API release accepts, read from the release's own documentation, and a checker.

`trtllm_schema.json` beside this module holds, per release (1.0.0, 1.1.0, 1.2.0, 1.2.1), facts read from
TensorRT-LLM's per-release documentation site (NVIDIA/TensorRT-LLM, branch gh-pages, folder `<release>/`): the
rendered source of `tensorrt_llm/llmapi/llm_args.py` (`_modules/tensorrt_llm/llmapi/llm_args.html`) and the CLI
references of `trtllm-serve` and `trtllm-build`. Each page's footer names the commit it was generated from; that
commit is the release's `commit`. Facts only, no upstream code:

- `classes`: per class its bases, whether its model_config forbids extra fields, its fields (name -> annotation
  as written) and validation aliases;
- `from_dict`: the keys `DecodingBaseConfig.from_dict` dispatches on (anything else raises
  `ValueError("Invalid decoding type: ...")`);
- `extra_dict_mapping`: which YAML keys `update_llm_args_with_extra_dict` turns into which config class;
- `cli`: the flags of `trtllm-serve serve` and `trtllm-build` (choices where the reference lists them);
- `inferred`: what was not read on that release's own page, and why.

Every trtllm-serve YAML, Triton llmapi `model.yaml` and command line the project writes for a release is checked
here (`yaml_problems`, `argv_problems`), in the tests and by build/deploy, and the llmapi stand-in refuses what
these facts refuse. Rebuild the JSON from gathered pages: `python scripts/extract_trtllm_schema.py --help`.
"""

from __future__ import annotations

import ast
import functools
import json
from pathlib import Path, PurePath
from typing import Any, Iterable, Mapping

from packaging.version import Version

SCHEMA_FILE = Path(__file__).with_name("trtllm_schema.json")


@functools.lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    return json.loads(SCHEMA_FILE.read_text())


def releases() -> list[str]:
    return sorted(schema()["releases"], key=Version)


def release_key(version: str) -> str | None:
    """The schema release for a TensorRT-LLM version: itself when read, else None."""
    v = Version(str(version))
    key = v.base_version
    return key if key in schema()["releases"] else None


def facts(version: str) -> dict[str, Any]:
    key = release_key(version)
    if key is None:
        raise KeyError(f"TensorRT-LLM {version}: no release-source facts (read: {', '.join(releases())})")
    return schema()["releases"][key]


def describe(version: str) -> str:
    """`TensorRT-LLM 1.2.1 (commit 376f7e1, NVIDIA/TensorRT-LLM gh-pages 1.2.1/...)` for messages."""
    f = facts(version)
    page = f["pages"]["llm_args"]
    return f"TensorRT-LLM {release_key(version)} (commit {f['commit'][:7]}, {page['repo']} {page['branch']} {page['path']})"


def _short(version: str) -> str:
    return f"TensorRT-LLM {release_key(version)} (commit {facts(version)['commit'][:7]})"


# ---- classes -----------------------------------------------------------------------------------------------------
def class_fields(version: str, cls: str) -> dict[str, str]:
    """The fields of `cls` and its bases (those in the schema), base fields first."""
    classes = facts(version)["classes"]
    if cls not in classes:
        raise KeyError(f"{_short(version)}: class {cls} was not read")
    out: dict[str, str] = {}
    for base in classes[cls].get("bases", []):
        if base in classes:
            out.update(class_fields(version, base))
    out.update(classes[cls].get("fields", {}))
    return out


def class_aliases(version: str, cls: str) -> dict[str, str]:
    """{accepted input name: field} for the validation aliases of `cls` and its bases."""
    classes = facts(version)["classes"]
    out: dict[str, str] = {}
    for base in classes.get(cls, {}).get("bases", []):
        if base in classes:
            out.update(class_aliases(version, base))
    for field_name, names in classes.get(cls, {}).get("aliases", {}).items():
        out.update({n: field_name for n in names})
    return out


def forbids_extra(version: str, cls: str) -> bool:
    classes = facts(version)["classes"]
    c = classes.get(cls, {})
    return c.get("extra") == "forbid" or any(forbids_extra(version, b) for b in c.get("bases", []) if b in classes)


def decoding_class(version: str, decoding_type: Any) -> str:
    """The config class `DecodingBaseConfig.from_dict` picks for `decoding_type`; ValueError as upstream raises."""
    table = facts(version)["from_dict"]["DecodingBaseConfig"]
    if decoding_type not in table:
        raise ValueError(f"Invalid decoding type: {decoding_type}")
    return table[decoding_type]


def decoding_key(version: str, cls: str = "DraftTargetDecodingConfig") -> str:
    """The from_dict key that selects `cls` (draft-target: 'DraftTarget' on 1.0 .. 1.2.1)."""
    keys = [k for k, v in facts(version)["from_dict"]["DecodingBaseConfig"].items() if v == cls]
    if not keys:
        raise KeyError(f"{_short(version)}: DecodingBaseConfig.from_dict has no key for {cls}")
    return keys[0]


def draft_path_field(version: str) -> str:
    """The field that names the draft model: speculative_model (1.2) or speculative_model_dir (1.0, 1.1)."""
    fields = class_fields(version, "DraftTargetDecodingConfig")
    return "speculative_model" if "speculative_model" in fields else "speculative_model_dir"


def serve_yaml_flag(version: str) -> str:
    """trtllm-serve's option for the YAML: --config (1.2) or --extra_llm_api_options (1.0, 1.1)."""
    flags = facts(version)["cli"]["trtllm-serve serve"]["flags"]
    return "--config" if "--config" in flags else "--extra_llm_api_options"


def inferred(version: str) -> list[dict[str, str]]:
    return list(facts(version).get("inferred", []))


# ---- values ------------------------------------------------------------------------------------------------------
def _type_problem(version: str, node: ast.expr, value: Any, path: str, where: str) -> list[str]:
    """[] when `value` fits the annotation `node`, else one problem (nested config classes are checked fully)."""
    classes = facts(version)["classes"]
    if isinstance(node, ast.Constant) and node.value is None:
        return [] if value is None else [f"{path} must be None"]
    if isinstance(node, ast.Name):
        name = node.id
        simple = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
                  "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                  "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str),
                  "Path": lambda v: isinstance(v, (str, PurePath)), "dict": lambda v: isinstance(v, dict),
                  "list": lambda v: isinstance(v, list)}
        if name in simple:
            return [] if simple[name](value) else [f"{path} is {value!r}, the release declares {name}"]
        if name in classes and "fields" in classes[name]:
            if not isinstance(value, dict):
                return [f"{path} is {value!r}, the release declares {name} (a mapping)"]
            return class_problems(version, name, value, path=path, where=where)
        return []       # a type whose definition was not read (object, Any, LoraConfig, ...): not checked
    if isinstance(node, ast.Subscript):
        head = node.value.id if isinstance(node.value, ast.Name) else ""
        args = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
        if head == "Optional":
            return [] if value is None else _type_problem(version, args[0], value, path, where)
        if head == "Union":
            tries = [_type_problem(version, a, value, path, where) for a in args]
            return [] if any(not t for t in tries) else tries[0]
        if head == "Literal":
            allowed = [a.value for a in args if isinstance(a, ast.Constant)]
            return [] if value in allowed else [f"{path} is {value!r}, the release allows {allowed}"]
        if head in ("List", "list"):
            if not isinstance(value, list):
                return [f"{path} is {value!r}, the release declares a list"]
            return [p for i, v in enumerate(value) for p in _type_problem(version, args[0], v, f"{path}[{i}]", where)]
        if head in ("Dict", "dict"):
            return [] if isinstance(value, dict) else [f"{path} is {value!r}, the release declares a mapping"]
    return []


def _annotation(text: str) -> ast.expr:
    return ast.parse(text, mode="eval").body


def class_problems(version: str, cls: str, data: Mapping[str, Any], *, path: str = "", where: str = "") -> list[str]:
    """What `cls(**data)` of the release refuses: fields it does not have (extra='forbid') and wrong types."""
    fields = class_fields(version, cls)
    aliases = class_aliases(version, cls)
    partial = facts(version)["classes"][cls].get("exactness") == "inferred"
    problems = []
    for key, value in data.items():
        at = f"{path}.{key}" if path else key
        name = key if key in fields else aliases.get(key)
        if name is None:
            if forbids_extra(version, cls):
                problems.append(f"{at}: {cls} of {_short(version)} has no field {key!r} and forbids extra fields "
                                f"('Extra inputs are not permitted')" + (" (its field list is inferred)" if partial
                                                                         else ""))
            continue
        if name == "speculative_config" and isinstance(value, dict):
            problems += speculative_problems(version, value, path=at, where=where)
            continue
        problems += [f"{p} ({cls}.{name} of {_short(version)})" for p in
                     _type_problem(version, _annotation(fields[name]), value, at, where)]
    return problems


def speculative_problems(version: str, data: Mapping[str, Any], *, path: str = "speculative_config",
                         where: str = "") -> list[str]:
    """`DecodingBaseConfig.from_dict(data)` of the release: the decoding_type key, then the chosen class."""
    data = dict(data)
    decoding_type = data.pop("decoding_type", None)
    try:
        cls = decoding_class(version, decoding_type)
    except ValueError:
        keys = ", ".join(facts(version)["from_dict"]["DecodingBaseConfig"])
        return [f"{path}.decoding_type: {decoding_type!r} is not a key of DecodingBaseConfig.from_dict in "
                f"{_short(version)}: it raises ValueError('Invalid decoding type: {decoding_type}'); keys: {keys}"]
    if cls not in facts(version)["classes"]:
        return []
    return class_problems(version, cls, data, path=path, where=where)


def yaml_problems(version: str, data: Mapping[str, Any], *, where: str = "the LLM-API YAML") -> list[str]:
    """What the release refuses in a trtllm-serve YAML / Triton llmapi model.yaml (without its triton_config):
    update_llm_args_with_extra_dict, then the LLM args class (TorchLlmArgs), all StrictBaseModels."""
    f = facts(version)
    problems = class_problems(version, f["llm_args_class"], data, where=where)
    return [f"{where}: {p}" for p in problems]


# ---- command lines -----------------------------------------------------------------------------------------------
def argv_problems(version: str, tool: str, argv: Iterable[str]) -> list[str]:
    """What the release's CLI reference does not allow in `argv` (tool: 'trtllm-serve serve' or 'trtllm-build').

    Returns [] with no check when the release's reference for that tool was not read (see `inferred`)."""
    cli = facts(version)["cli"]
    if tool not in cli:
        return []
    spec = cli[tool]
    flags: dict[str, dict[str, Any]] = {}
    for name, opt in spec["flags"].items():
        for n in (name, *opt.get("aliases", [])):
            flags[n] = opt
    words = list(argv)
    prog = tool.split()
    if words[:len(prog)] != prog:
        return [f"{tool}: the command line starts {words[:len(prog)]}, not {prog}"]
    words = words[len(prog):]
    problems, positional, i = [], [], 0
    while i < len(words):
        w = words[i]
        if w.startswith("--"):
            name, eq, value = w.partition("=")
            opt = flags.get(name)
            if opt is None:
                problems.append(f"{tool} of {_short(version)} has no option {name}")
                i += 1
                continue
            if not opt.get("flag"):
                if not eq:
                    i += 1
                    value = words[i] if i < len(words) else None
                if value is None:
                    problems.append(f"{tool} {name} needs a value")
                elif opt.get("choices") and value not in opt["choices"]:
                    problems.append(f"{tool} {name} {value!r}: {_short(version)} allows {opt['choices']}")
        else:
            positional.append(w)
        i += 1
    want = len(spec.get("positional", []))
    if len(positional) != want:
        problems.append(f"{tool} of {_short(version)} takes {want} argument(s) {spec.get('positional', [])}, "
                        f"got {positional}")
    return problems
