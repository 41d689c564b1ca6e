"""The version table: what each supported `tensorrtllm_backend` release declares in
`all_models/inflight_batcher_llm/*/config.pbtxt`, read from the release tag itself.

The data lives in `upstream_facts.json` beside this module, one entry per backend release *family*
(tags whose `all_models/inflight_batcher_llm` trees are identical share one entry, e.g. v0.18.0,
v0.18.1 and v0.18.2). Each entry names the tags and commits it was read from and holds, per model:
backend/platform, the placeholder of every non-string field, inputs (name, data type, dims, optional,
reshape, allow_ragged_batch), outputs, parameter keys with their template value, instance groups,
dynamic batching and (ensemble) the scheduling steps. Facts only: no upstream code or file is kept.

The project's template families (`model_repository/trtllm/backend-<family>/inflight_batcher_llm/`)
are written from this table by `template_text`; tests check that they agree with it, and, given a
checkout of a release tag (SPECBUILD_TRTLLM_BACKEND_DIR), that the table agrees with the tag.

Refresh or add a release (on any machine with a checkout of the tag)::

    python -m specbuild.core.upstream_facts extract --family 0.20 --tag v0.20.0 \
        --commit <sha> <checkout>/all_models/inflight_batcher_llm      # updates upstream_facts.json
    python -m specbuild.core.upstream_facts templates        # rewrites the template families
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

FACTS_FILE = Path(__file__).with_name("upstream_facts.json")
MODELS = ("ensemble", "preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_bls")
PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# Upstream placeholders in non-string positions, and a parseable stand-in for each kind of field.
_STAND_IN = {"data_type": "TYPE_FP32", "decoupled": "false"}


def _neutralize(text: str) -> tuple[str, dict[str, str]]:
    """Replace every unquoted ${x} by a parseable value; return the text and {field path: placeholder}.

    Paths: `max_batch_size`, `model_transaction_policy.decoupled`, `dynamic_batching.<field>`,
    `instance_group.count`, `input.<tensor>.data_type`, `output.<tensor>.data_type`.
    """
    out, found = [], {}
    section, tensor, block = None, None, []
    for line in text.splitlines():
        stripped = line.split("#", 1)[0]
        m_sec = re.match(r"^\s*(input|output)\s*\[", stripped)
        if m_sec:
            section = m_sec.group(1)
        elif re.match(r"^\s*(instance_group|parameters|ensemble_scheduling|dynamic_batching|"
                      r"model_transaction_policy)\b", stripped) and not line.startswith(" "):
            section = None
        names = re.findall(r'\bname\s*:\s*"([^"]+)"', stripped)
        if names and section:
            tensor = names[-1]
        m_block = re.match(r"^(\w+)\s*[{:\[]", stripped)
        if m_block and not line.startswith(" "):
            block = [m_block.group(1)]
        for m in list(re.finditer(r"(\w+)\s*:\s*\[?\s*\$\{(\w+)\}", stripped)):
            field, name = m.group(1), m.group(2)
            if field == "data_type" and section and tensor:
                path = f"{section}.{tensor}.data_type"
            elif field in ("max_batch_size",) or not block or block[0] == field:
                path = field
            else:
                path = f"{block[0]}.{field}"
            found[path] = name
            line = line.replace(m.group(0), m.group(0).replace("${" + name + "}", _STAND_IN.get(field, "1")))
        out.append(line)
    return "\n".join(out) + "\n", found


def _parse(text: str):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def _dtype(value: int) -> str:
    from tritonclient.grpc import model_config_pb2
    return model_config_pb2.DataType.Name(value)


def extract_model(text: str) -> dict[str, Any]:
    """The facts of one upstream config.pbtxt (placeholders kept by name)."""
    neutral, ph = _neutralize(text)
    cfg = _parse(neutral)

    def dt(kind: str, t) -> str:
        return "${" + ph[f"{kind}.{t.name}.data_type"] + "}" if f"{kind}.{t.name}.data_type" in ph \
            else _dtype(t.data_type)

    inputs = []
    for t in cfg.input:
        item: dict[str, Any] = {"name": t.name, "data_type": dt("input", t), "dims": list(t.dims),
                                "optional": bool(t.optional)}
        if t.HasField("reshape"):
            item["reshape"] = list(t.reshape.shape)
        if t.allow_ragged_batch:
            item["allow_ragged_batch"] = True
        inputs.append(item)
    outputs = [{"name": t.name, "data_type": dt("output", t), "dims": list(t.dims)} for t in cfg.output]
    facts: dict[str, Any] = {
        "name": cfg.name, "backend": cfg.backend or None, "platform": cfg.platform or None,
        "placeholders": {k: v for k, v in sorted(ph.items()) if not k.startswith(("input.", "output."))},
        "inputs": inputs, "outputs": outputs,
        "parameters": {k: v.string_value for k, v in cfg.parameters.items()},
        "instance_group": [{"count": "${" + ph["instance_group.count"] + "}" if "instance_group.count" in ph
                            else g.count, "kind": model_config_pb2_kind(g.kind)} for g in cfg.instance_group],
        "dynamic_batching": cfg.HasField("dynamic_batching"),
        "decoupled_policy": cfg.HasField("model_transaction_policy"),
    }
    if cfg.HasField("ensemble_scheduling"):
        facts["ensemble_steps"] = [{"model_name": s.model_name, "model_version": s.model_version,
                                    "input_map": dict(s.input_map), "output_map": dict(s.output_map)}
                                   for s in cfg.ensemble_scheduling.step]
    return facts


def model_config_pb2_kind(kind: int) -> str:
    from tritonclient.grpc import model_config_pb2
    return model_config_pb2.ModelInstanceGroup.Kind.Name(kind)


def models_dir(path: str | Path) -> Path:
    """`path` itself if it holds the upstream model dirs, else `<path>/all_models/inflight_batcher_llm`
    (a checkout root) or `<path>/inflight_batcher_llm` (an `all_models` dir)."""
    p = Path(path).expanduser()
    for cand in (p, p / "all_models" / "inflight_batcher_llm", p / "inflight_batcher_llm",
                 p / "triton_backend" / "all_models" / "inflight_batcher_llm"):
        if (cand / "tensorrt_llm_bls" / "config.pbtxt").is_file():
            return cand.resolve()
    raise FileNotFoundError(f"{p} holds no inflight_batcher_llm model tree (looked for tensorrt_llm_bls/config.pbtxt "
                            "in it, in all_models/inflight_batcher_llm/ and in inflight_batcher_llm/)")


def extract_tree(path: str | Path) -> dict[str, dict[str, Any]]:
    root = models_dir(path)
    return {m: extract_model((root / m / "config.pbtxt").read_text()) for m in MODELS}


@functools.lru_cache(maxsize=1)
def table() -> dict[str, Any]:
    return json.loads(FACTS_FILE.read_text())


def families() -> dict[str, dict[str, Any]]:
    return table()["families"]


def family_versions(fam: dict[str, Any]) -> list[str]:
    """The TensorRT-LLM versions a family covers: its `versions` (families read from TensorRT-LLM's
    triton_backend), else its backend tags (backend tag vX.Y.Z pairs with TensorRT-LLM X.Y.Z: the tag's
    tensorrt_llm submodule)."""
    return list(fam.get("versions") or [t.removeprefix("v") for t in fam["tags"]])


def supported_versions() -> list[str]:
    """TensorRT-LLM versions whose Triton models are in the table."""
    return [v for fam in families().values() for v in family_versions(fam)]


def family_of(trtllm_version: str) -> str | None:
    """The table family of a TensorRT-LLM version (0.18.1 -> '0.18', 1.2.1 -> '1.2'), None when not in the table."""
    try:
        v = Version(str(trtllm_version))
    except InvalidVersion:
        return None
    for name, fam in families().items():
        if any(Version(t) == Version(v.base_version) for t in family_versions(fam)):
            return name
    return None


def inferred_facts(family: str) -> list[dict[str, Any]]:
    """The facts behind a family that were not read at its release's own commit (exactness != "exact"), each with
    its id, source and exactness: the family's own provenance, the dated changes along its derivation chain and
    the inferred provenance of the family it derives from. What `deploy` says once and the docs list."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    name: str | None = family
    while name:
        fam = families()[name]
        for f in fam.get("provenance", []):
            if f.get("exactness") != "exact" and f.get("id") not in seen and (name == family or f.get("id") in
                                                                                ("release-configs",)):
                out.append(f)
                seen.add(f.get("id", ""))
        for change in (fam.get("derived") or {}).get("changes", []):
            if change.get("exactness") != "exact":
                out.append({k: change[k] for k in ("id", "fact", "exactness", "source", "release") if k in change})
        name = (fam.get("derived") or {}).get("from")
    return out


# ---------------------------------------------------------------------------------------------------------
# Derived families: a release whose configs could not be read at its own commit is its predecessor's facts
# plus dated changes, each change carrying the exact content it was read from and how its release was dated.

def _tensor_index(items: list[dict[str, Any]], name: str) -> int:
    for i, t in enumerate(items):
        if t["name"] == name:
            return i
    raise KeyError(name)


def apply_change(models: dict[str, dict[str, Any]], op: dict[str, Any]) -> None:
    """Apply one operation of a change to `models` (in place). Operations:

    - {"op": "add_input"|"add_output", "model", "tensor": {...}, "after": name | None}
    - {"op": "set_input"|"set_output", "model", "name", "fields": {...}}
    - {"op": "add_step_map", "model": "ensemble", "step": step model name, "kind": "input_map"|"output_map",
       "key", "value", "after": key | None}
    """
    kind = op["op"]
    m = models[op["model"]]
    if kind in ("add_input", "add_output"):
        items = m["inputs" if kind == "add_input" else "outputs"]
        if any(t["name"] == op["tensor"]["name"] for t in items):
            raise ValueError(f"{op['model']}: {op['tensor']['name']} is declared already")
        at = _tensor_index(items, op["after"]) + 1 if op.get("after") else len(items)
        items.insert(at, dict(op["tensor"]))
    elif kind in ("set_input", "set_output"):
        items = m["inputs" if kind == "set_input" else "outputs"]
        items[_tensor_index(items, op["name"])].update(op["fields"])
    elif kind == "add_step_map":
        step = next(s for s in m["ensemble_steps"] if s["model_name"] == op["step"])
        pairs = list(step[op["kind"]].items())
        at = [k for k, _ in pairs].index(op["after"]) + 1 if op.get("after") else len(pairs)
        pairs.insert(at, (op["key"], op["value"]))
        step[op["kind"]] = dict(pairs)
    else:
        raise ValueError(f"unknown change operation {kind!r}")


def derive_models(data: dict[str, Any], family: str) -> dict[str, dict[str, Any]]:
    """The models of a family: read ones as stored, derived ones = their base's models + their changes."""
    import copy
    fam = data["families"][family]
    derived = fam.get("derived")
    if not derived:
        return fam["models"]
    models = copy.deepcopy(derive_models(data, derived["from"]))
    for change in derived.get("changes", []):
        for op in change["ops"]:
            apply_change(models, op)
    return models


def nearest_family(trtllm_version: str) -> str:
    """The newest table family not newer than the version (for --force with an untested version)."""
    v = Version(Version(str(trtllm_version)).base_version)
    older = [n for n in families() if Version(n) <= v]
    return max(older, key=Version) if older else min(families(), key=Version)


def model_facts(family: str, model: str) -> dict[str, Any]:
    return families()[family]["models"][model]


def input_names(family: str, model: str) -> set[str]:
    return {t["name"] for t in model_facts(family, model)["inputs"]}


# ---------------------------------------------------------------------------------------------------------
# Template families: our rendering of the facts (placeholders named as upstream's fill_template keys).

TEMPLATE_ROOT = "trtllm"


def template_dir(family: str) -> str:
    return f"backend-{family}/inflight_batcher_llm"


def template_text(family: str, model: str) -> str:
    """The config.pbtxt template of `model` in `family`, generated from the facts (header, scheduling, tensors,
    instances, parameters, ensemble steps)."""
    f = model_facts(family, model)
    lines = _template_header(family, model) + _template_scheduling(f, model)
    for kind, items in (("input", f["inputs"]), ("output", f["outputs"])):
        lines.append(f"{kind} [")
        lines += [_template_tensor(t, i == len(items) - 1) for i, t in enumerate(items)]
        lines.append("]")
    for g in f["instance_group"]:
        lines.append(f"instance_group [ {{ count: {g['count']} kind: {g['kind']} }} ]")
    for key, value in f["parameters"].items():
        lines.append(f'parameters: {{ key: "{key}" value: {{ string_value: "{value}" }} }}')
    if "ensemble_steps" in f:
        lines += _template_ensemble(f["ensemble_steps"])
    return "\n".join(lines) + "\n"


def _template_header(family: str, model: str) -> list[str]:
    fam = families()[family]
    if fam.get("trtllm"):      # read from (or derived for) TensorRT-LLM's triton_backend
        src = fam.get("read_from") or {}
        how = (f"facts read at {src['repo'].split('/', 1)[-1]} {src['commit'][:12]}" if src.get("commit")
               else f"facts derived from family {fam['derived']['from']} + dated changes")
        first = (f"# specbuild template: TensorRT-LLM {', '.join(family_versions(fam))} {model} ({how}; "
                 f"exactness {fam.get('exactness')}: see upstream_facts.json).")
    else:
        first = (f"# specbuild template: tensorrtllm_backend {', '.join(fam['tags'])} {model} "
                 f"(facts read from {fam['tags'][0]}, commit {fam['commits'][fam['tags'][0]][:12]}).")
    return [first, "# Generated from core/upstream_facts.json by "
                   "`python -m specbuild.core.upstream_facts templates`; do not edit by hand."]


def _template_scheduling(f: dict[str, Any], model: str) -> list[str]:
    ph = f["placeholders"]
    lines = ['name: "${model_name}"' if model == "tensorrt_llm" else f'name: "{f["name"]}"']
    if f["platform"]:
        lines.append(f'platform: "{f["platform"]}"')
    if f["backend"]:
        lines.append(f'backend: "{f["backend"]}"')
    lines.append(f"max_batch_size: ${{{ph['max_batch_size']}}}")
    if f["decoupled_policy"]:
        lines.append(f"model_transaction_policy {{ decoupled: ${{{ph['model_transaction_policy.decoupled']}}} }}")
    if f["dynamic_batching"]:
        body = []
        if "dynamic_batching.preferred_batch_size" in ph:
            body.append(f"  preferred_batch_size: [ ${{{ph['dynamic_batching.preferred_batch_size']}}} ]")
        if "dynamic_batching.max_queue_delay_microseconds" in ph:
            body.append(f"  max_queue_delay_microseconds: ${{{ph['dynamic_batching.max_queue_delay_microseconds']}}}")
        if "dynamic_batching.max_queue_size" in ph:
            body.append(f"  default_queue_policy: {{ max_queue_size: ${{{ph['dynamic_batching.max_queue_size']}}} }}")
        lines += ["dynamic_batching {", *body, "}"] if body else ["dynamic_batching { }"]
    return lines


def _template_tensor(t: dict[str, Any], last: bool) -> str:
    parts = [f'name: "{t["name"]}"', f"data_type: {t['data_type']}", f"dims: [ {', '.join(map(str, t['dims']))} ]"]
    if "reshape" in t:
        parts.append(f"reshape: {{ shape: [ {', '.join(map(str, t['reshape']))} ] }}")
    if t.get("optional"):
        parts.append("optional: true")
    if t.get("allow_ragged_batch"):
        parts.append("allow_ragged_batch: true")
    return "  { " + " ".join(parts) + (" }" if last else " },")


def _template_ensemble(steps: list[dict[str, Any]]) -> list[str]:
    lines = ["ensemble_scheduling {", "  step ["]
    for i, s in enumerate(steps):
        lines += ["    {", f'      model_name: "{s["model_name"]}"', f"      model_version: {s['model_version']}"]
        for kind in ("input_map", "output_map"):
            for k, v in s[kind].items():
                lines.append(f'      {kind} {{ key: "{k}" value: "{v}" }}')
        lines.append("    }" + ("," if i < len(steps) - 1 else ""))
    return lines + ["  ]", "}"]


def template_path(family: str, model: str) -> str:
    return f"{template_dir(family)}/{model}/config.pbtxt"


def packaged_template(family: str, model: str) -> str:
    return template(template_path(family, model))


def template(relpath: str) -> str:
    """A packaged TensorRT-LLM template's text (`model_repository/trtllm/<relpath>`), read as package data."""
    return (resources.files("specbuild.model_repository") / TEMPLATE_ROOT / relpath).read_text()


def write_templates(root: Path) -> list[Path]:
    written = []
    for family in families():
        for model in MODELS:
            path = root / template_path(family, model)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(template_text(family, model))
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specbuild.core.upstream_facts")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("extract", help="read a release tag's model tree into the table")
    ex.add_argument("--family", required=True)
    ex.add_argument("--tag", action="append", required=True, help="tag(s) whose tree is this one (repeatable)")
    ex.add_argument("--commit", action="append", required=True, help="commit of each --tag, same order")
    ex.add_argument("--source", default="github.com/triton-inference-server/tensorrtllm_backend")
    ex.add_argument("dir")
    sub.add_parser("templates", help="rewrite model_repository/trtllm/backend-*/ from the table")
    sub.add_parser("derive", help="recompute the models of derived families (base + changes) in the table")
    args = ap.parse_args(argv)
    if args.cmd == "extract":
        data = json.loads(FACTS_FILE.read_text()) if FACTS_FILE.is_file() else {"families": {}}
        data["families"][args.family] = {
            "source": args.source, "tags": args.tag, "commits": dict(zip(args.tag, args.commit)),
            "path": "all_models/inflight_batcher_llm/<model>/config.pbtxt", "models": extract_tree(args.dir)}
        data["families"] = dict(sorted(data["families"].items(), key=lambda kv: Version(kv[0])))
        FACTS_FILE.write_text(json.dumps(data, indent=1) + "\n")
        table.cache_clear()
        print(f"wrote family {args.family} ({', '.join(args.tag)}) to {FACTS_FILE}")
    elif args.cmd == "derive":
        data = json.loads(FACTS_FILE.read_text())
        for name, fam in data["families"].items():
            if fam.get("derived"):
                fam["models"] = derive_models(data, name)
                print(f"derived family {name} from {fam['derived']['from']} "
                      f"({len(fam['derived'].get('changes', []))} changes)")
        FACTS_FILE.write_text(json.dumps(data, indent=1) + "\n")
        table.cache_clear()
    else:
        # the templates' folder by path: the ground floor imports no other folder of the project
        for p in write_templates(Path(__file__).resolve().parents[1] / "model_repository" / TEMPLATE_ROOT):
            print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
