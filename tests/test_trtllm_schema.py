"""Upstream's rules decide: the release-source schema (core/trtllm_schema.json), its checker, the script that
rebuilds it from TensorRT-LLM's documentation pages, and every YAML / argv the trtllm backend writes for a release."""

from __future__ import annotations

import html
import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from trtllm_support import context, runs, written

from specbuild.core import trtllm_schema as ts
from specbuild.core.errors import CheckFailed
from specbuild.engines.trtllm import build, deploy, llmapi

ROOT = Path(__file__).resolve().parent.parent
RELEASES = ("1.0.0", "1.1.0", "1.2.0", "1.2.1")


def _extractor():
    spec = importlib.util.spec_from_file_location("extract_trtllm_schema", ROOT / "scripts" / "extract_trtllm_schema.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- the facts -----------------------------------------------------------------------------------------------------
def test_every_release_names_its_commit_and_pages():
    assert tuple(ts.releases()) == RELEASES
    commits = {"1.0.0": "ae8270b", "1.1.0": "48b7b5d", "1.2.0": "dbdb13b", "1.2.1": "376f7e1"}
    for r in RELEASES:
        f = ts.facts(r)
        assert f["commit"].startswith(commits[r]), r
        assert f["pages"]["llm_args"]["path"] == f"{r}/_modules/tensorrt_llm/llmapi/llm_args.html"
        assert f["pages"]["llm_args"]["repo"] == "NVIDIA/TensorRT-LLM" and f["pages"]["llm_args"]["branch"] == "gh-pages"


def test_draft_target_is_DraftTarget_on_every_release_and_Draft_Target_is_refused():
    for r in RELEASES:
        assert ts.decoding_key(r) == "DraftTarget"
        assert ts.decoding_class(r, "DraftTarget") == "DraftTargetDecodingConfig"
        with pytest.raises(ValueError, match="^Invalid decoding type: Draft_Target$"):
            ts.decoding_class(r, "Draft_Target")
        for cls in ("BaseLlmArgs", "TorchLlmArgs", "KvCacheConfig", "DecodingBaseConfig", "DraftTargetDecodingConfig"):
            assert ts.forbids_extra(r, cls), (r, cls)
    assert [ts.draft_path_field(r) for r in RELEASES] == ["speculative_model_dir"] * 2 + ["speculative_model"] * 2
    assert [ts.serve_yaml_flag(r) for r in RELEASES] == ["--extra_llm_api_options"] * 2 + ["--config"] * 2
    assert "SaveState" not in ts.facts("1.1.0")["from_dict"]["DecodingBaseConfig"]      # arrived in 1.2


def test_yaml_problems_name_the_field_the_release_and_the_commit():
    good = {"model": "/t", "backend": "pytorch", "max_batch_size": 8, "disable_overlap_scheduler": True,
            "kv_cache_config": {"enable_block_reuse": False, "free_gpu_memory_fraction": 0.9},
            "speculative_config": {"decoding_type": "DraftTarget", "max_draft_len": 4, "speculative_model": "/d"}}
    assert ts.yaml_problems("1.2.1", good) == []
    # 1.2's alias is accepted; 1.1 has only speculative_model_dir
    alias = {**good, "speculative_config": {**good["speculative_config"]}}
    alias["speculative_config"]["speculative_model_dir"] = alias["speculative_config"].pop("speculative_model")
    assert ts.yaml_problems("1.2.1", alias) == []
    [p] = ts.yaml_problems("1.1.0", good)
    assert "speculative_config.speculative_model" in p and "1.1.0" in p and "48b7b5d" in p and "Extra inputs" in p
    bad = {**good, "speculative_config": {**good["speculative_config"], "decoding_type": "Draft_Target"}}
    [p] = ts.yaml_problems("1.2.1", bad)
    assert "Invalid decoding type: Draft_Target" in p and "376f7e1" in p
    assert any("pytorch_backend_config" in p for p in ts.yaml_problems("1.0.0", {**good, "pytorch_backend_config": {}}))
    assert any("enable_block_reus" in p for p in ts.yaml_problems("1.2.1", {**good, "kv_cache_config": {
        "enable_block_reus": True}}))
    [p] = ts.yaml_problems("1.2.1", {**good, "kv_cache_config": {"free_gpu_memory_fraction": "most"}})
    assert "free_gpu_memory_fraction" in p and "float" in p
    [p] = ts.yaml_problems("1.2.1", {**good, "max_batch_size": "8"})
    assert "max_batch_size" in p and "int" in p


def test_argv_problems_follow_each_release_cli_reference():
    serve = ["trtllm-serve", "serve", "/t", "--backend", "pytorch", "--host", "127.0.0.1", "--port", "8000"]
    assert ts.argv_problems("1.2.1", "trtllm-serve serve", serve + ["--config", "/y"]) == []
    assert ts.argv_problems("1.2.1", "trtllm-serve serve", serve + ["--extra_llm_api_options", "/y"]) == []
    assert ts.argv_problems("1.1.0", "trtllm-serve serve", serve + ["--extra_llm_api_options", "/y"]) == []
    assert any("no option --config" in p for p in ts.argv_problems("1.1.0", "trtllm-serve serve",
                                                                     serve + ["--config", "/y"]))
    assert any("'tensorrt'" in p and "['pytorch', 'trt']" in p for p in ts.argv_problems(
        "1.0.0", "trtllm-serve serve", ["trtllm-serve", "serve", "/t", "--backend", "tensorrt"]))
    assert any("--speculative_decoding_mode 'draft_tokens'" in p for p in ts.argv_problems(
        "1.2.1", "trtllm-build", ["trtllm-build", "--speculative_decoding_mode", "draft_tokens"]))
    assert ts.argv_problems("1.0.0", "trtllm-build", ["trtllm-build", "--anything"]) == []   # not read: no check
    assert any("trtllm-build 1.0.0" in i["why"] or "1.0.0 trtllm-build" in i["why"] for i in ts.inferred("1.0.0"))


# ---- what the project writes ---------------------------------------------------------------------------------------
@pytest.fixture
def opts(tiny_llama, tiny_llama_draft):
    return {"target_dir": str(tiny_llama), "draft_dir": str(tiny_llama_draft)}


@pytest.mark.parametrize("version", RELEASES)
def test_llmapi_build_and_deploy_artefacts_pass_the_release_schema(tmp_path, opts, tiny_llama_draft, version):
    o = {**opts, "trtllm_version": version}
    body = written(build.plan(context("build", tmp_path, o)))[str(tmp_path / "engines" / "llm_api_options.yaml")]
    files = written(deploy.plan(context("deploy", tmp_path, o)))
    root = tmp_path / "model_repository"
    serve_yaml = yaml.safe_load(files[str(root / "trtllm_serve.yaml")])
    model_yaml = yaml.safe_load(files[str(root / "triton" / "tensorrt_llm" / "1" / "model.yaml")])
    assert yaml.safe_load(body) == serve_yaml
    assert serve_yaml["speculative_config"] == {"decoding_type": "DraftTarget", "max_draft_len": 4,
                                                ts.draft_path_field(version): str(tiny_llama_draft)}
    assert "enable_block_reuse" not in serve_yaml["kv_cache_config"]       # not a setting with a draft (PR #5448)
    assert ts.yaml_problems(version, serve_yaml) == []
    model_yaml.pop("triton_config")
    assert ts.yaml_problems(version, model_yaml) == []
    launch = json.loads(files[str(root / "launch.json")])
    assert launch["argv"][:2] == ["trtllm-serve", "serve"]
    assert ts.argv_problems(version, "trtllm-serve serve", launch["argv"]) == []


def test_engine_path_trtllm_build_argv_passes_1_2_1_reference(tmp_path, opts):
    for extra in ({"use_draft_logits": True}, {"quantization": "fp8"}):
        argvs = runs(build.plan(context("build", tmp_path, {**opts, **extra, "trtllm_version": "1.2.1",
                                                            "trtllm_generation": "engine"})))
        assert len(argvs) == 2 and all(ts.argv_problems("1.2.1", "trtllm-build", a) == [] for a in argvs)


def test_deploy_refuses_what_the_release_refuses_naming_field_release_and_commit(tmp_path, opts, monkeypatch):
    # as the project wrote it before: Draft_Target on 1.2 -> upstream's from_dict raises at start-up
    monkeypatch.setattr(llmapi, "speculative_config", lambda v, *, max_draft_len, draft_dir: {
        "decoding_type": "Draft_Target", "max_draft_len": max_draft_len, "speculative_model": draft_dir})
    with pytest.raises(CheckFailed) as e:
        deploy.plan(context("deploy", tmp_path, {**opts, "trtllm_version": "1.2.1"}))
    msg = str(e.value)
    assert "speculative_config.decoding_type" in msg and "TensorRT-LLM 1.2.1" in msg and "376f7e1" in msg
    assert "Invalid decoding type: Draft_Target" in msg
    assert not (tmp_path / "model_repository").exists()


def test_llmapi_facts_are_exact_with_their_commit():
    r = llmapi.release("1.2.1")
    assert (r.decoding_type, r.draft_key, r.serve_flag) == ("DraftTarget", "speculative_model", "--config")
    exact = {f["id"]: f for f in r.facts if f["exactness"] == "exact"}
    assert {"decoding-type", "draft-key", "serve-flag"} <= set(exact)
    assert all("376f7e1" in f["source"] for f in exact.values())
    assert any(f["id"] == "block-reuse-off" and f["exactness"] == "inferred" for f in llmapi.inferred_facts("1.2.1"))
    # a patch release that was not read gets the nearest read release's facts, marked inferred
    r = llmapi.release("1.2.2")
    assert r.version == "1.2.1" and all(f["exactness"] == "inferred" for f in r.facts)


# ---- the stand-in --------------------------------------------------------------------------------------------------
def test_llmapi_standin_refuses_exactly_what_the_release_refuses(monkeypatch):
    from specbuild.engines.trtllm import llmapi_standin as sa
    for version in RELEASES:
        monkeypatch.setattr(sa, "version", lambda v=version: v)
        key = ts.draft_path_field(version)
        cfg = sa.update_llm_args_with_extra_dict({}, {"speculative_config": {
            "decoding_type": "DraftTarget", "max_draft_len": 3, key: "/d"}, "kv_cache_config": {
            "enable_block_reuse": False, "free_gpu_memory_fraction": 0.5}})
        assert cfg["speculative_config"].draft_dir == "/d"
        # 1.2 maps kv_cache_config in update_llm_args_with_extra_dict; 1.0 / 1.1 leave it to LLM()
        assert isinstance(cfg["kv_cache_config"], sa.KvCacheConfig) == (version >= "1.2")
        with pytest.raises(ValueError, match="^Invalid decoding type: Draft_Target$"):
            sa.DecodingBaseConfig.from_dict({"decoding_type": "Draft_Target", "max_draft_len": 3, key: "/d"})
        with pytest.raises(ValueError, match="enable_block_reus: Extra inputs are not permitted"):
            sa.KvCacheConfig(enable_block_reus=True)
        with pytest.raises(ValueError, match="max_tokens"):
            sa.KvCacheConfig(max_tokens="many")
        with pytest.raises(ValueError, match="pytorch_backend_config: Extra inputs are not permitted"):
            sa.LLM(model="/x", pytorch_backend_config={})
        with pytest.raises(ValueError, match="kv_cache_confi: Extra inputs are not permitted"):
            sa.LLM(model="/x", kv_cache_confi={})
    monkeypatch.setattr(sa, "version", lambda: "1.0.0")
    with pytest.raises(ValueError, match="max_gpu_total_bytes: Extra inputs"):     # a 1.1 field, not in 1.0
        sa.KvCacheConfig(max_gpu_total_bytes=0)


# ---- the extractor -------------------------------------------------------------------------------------------------
_SOURCE = '''\
class StrictBaseModel(BaseModel):
    """A base model that forbids arbitrary fields."""

    class Config:
        extra = "forbid"


class DecodingBaseConfig(StrictBaseModel):
    max_draft_len: Optional[int] = None
    speculative_model: Optional[Union[str, Path]] = Field(
        default=None, validation_alias=AliasChoices("speculative_model", "speculative_model_dir"))
    _private: bool = PrivateAttr(default=False)

    @classmethod
    def from_dict(cls, data: dict):
        decoding_type = data.get("decoding_type")
        config_classes = {
            "DraftTarget": DraftTargetDecodingConfig,
            "NGram": NGramDecodingConfig,
        }
        config_class = config_classes.get(decoding_type)
        if config_class is None:
            raise ValueError(f"Invalid decoding type: {decoding_type}")
        data.pop("decoding_type")
        return config_class(**data)


class DraftTargetDecodingConfig(DecodingBaseConfig):
    decoding_type: ClassVar[str] = "Draft_Target"


class KvCacheConfig(StrictBaseModel, PybindMirror):
    enable_block_reuse: bool = Field(default=True, description="reuse <blocks> & more")
    free_gpu_memory_fraction: Optional[float] = 0.9


class BaseLlmArgs(StrictBaseModel):
    model_config = {"arbitrary_types_allowed": True, "extra": "forbid"}
    model: Union[str, Path] = Field(description="The model.")
    kv_cache_config: KvCacheConfig = Field(default_factory=KvCacheConfig)
    mpi_session: Optional[object] = Field(default=None, alias="_mpi_session")


class TorchLlmArgs(BaseLlmArgs):
    disable_overlap_scheduler: bool = False


LlmArgs = TorchLlmArgs


def update_llm_args_with_extra_dict(llm_args, llm_args_dict, extra_llm_api_options=None):
    field_mapping = {
        "speculative_config": DecodingBaseConfig,
        "kv_cache_config": KvCacheConfig,
    }
    return llm_args | llm_args_dict
'''


def _sphinx_module_page(source: str, commit: str) -> str:
    """A page shaped like Sphinx's `_modules/...` viewcode output: one highlighted <pre>, every token in a span,
    '[docs]' back-links before the documented classes, and the docs site's footer."""
    lines = []
    for line in source.splitlines():
        toks = html.escape(line, quote=True).split(" ")
        out = " ".join(f'<span class="n">{t}</span>' if t else "" for t in toks)
        if line.startswith("class "):
            out = '<a class="viewcode-back" href="../../llm-api/reference.html">[docs]</a>' + out
        lines.append(out)
    pre = "\n".join(lines)
    return (f'<html><body><h1>Source code for tensorrt_llm.llmapi.llm_args</h1><div class="highlight"><pre>'
            f'<span></span>{pre}\n</pre></div><footer><p>Last updated on April 16, 2026.</p>'
            f'<p>This page is generated by TensorRT-LLM commit <a href="#">{commit}</a>.</p></footer></body></html>')


def _click_page() -> str:
    def opt(cmd, name, aliases=(), metavar=True, choices=None):
        names = [name, *aliases]
        head = '<span class="sig-prename descclassname"><span class="pre">,</span> </span>'.join(
            f'<span class="sig-name descname"><span class="pre">{n}</span></span>' for n in names)
        if metavar:
            head += f'<span class="sig-prename descclassname"> <span class="pre">&lt;{name[2:]}&gt;</span></span>'
        body = "<p>help</p>"
        if choices:
            body += ('<dl class="field-list simple">\n<dt class="field-odd">Options<span class="colon">:</span></dt>\n'
                     f'<dd class="field-odd"><p>{" | ".join(choices)}</p>\n</dd>\n</dl>\n')
        return (f'<dl class="std option">\n<dt class="sig sig-object std" id="cmdoption-{cmd}-{name.lstrip("-")}">\n'
                f'{head}<a class="headerlink" href="#">#</a></dt>\n<dd>{body}</dd></dl>\n')
    return ("<html><body>" + opt("trtllm-serve-disaggregated", "--config_file") +
            opt("trtllm-serve-serve", "--backend", choices=["pytorch", "tensorrt", "_autodeploy"]) +
            opt("trtllm-serve-serve", "--config", aliases=["--extra_llm_api_options"]) +
            opt("trtllm-serve-serve", "--trust_remote_code", metavar=False) +
            '<dl class="std option">\n<dt class="sig sig-object std" id="cmdoption-trtllm-serve-serve-arg-MODEL">\n'
            '<span class="sig-name descname"><span class="pre">MODEL</span></span></dt>\n<dd><p>Required argument</p>'
            "\n</dd></dl>\n</body></html>")


def _argparse_page() -> str:
    return ('<dl class="option-list">\n<dt><kbd>--speculative_decoding_mode</kbd></dt>\n<dd><p>Possible choices: '
            'draft_tokens_external, medusa</p>\n<p>Mode.</p>\n</dd>\n<dt><kbd>--gather_generation_logits</kbd></dt>\n'
            '<dd><p>Gather.</p>\n<p>Default: <code class="docutils literal notranslate"><span class="pre">False</span>'
            '</code></p>\n</dd>\n<dt><kbd>--max_draft_len</kbd></dt>\n<dd><p>K.</p>\n<p>Default: <code>0</code></p>\n'
            '</dd>\n</dl>')


def test_extractor_reads_a_sphinx_modules_page_and_cli_references(tmp_path):
    x = _extractor()
    page = _sphinx_module_page(_SOURCE, "376f7e1")
    assert x.page_source(page).strip() == _SOURCE.strip()         # the Python text comes back exactly
    entry = x.release_entry("1.2.1", llm_args=page, serve=_click_page(), build=_argparse_page(),
                            old={"commit": "376f7e1bd8ed543f75014309e3fd4b237e9b0e73", "pages": {"p": 1},
                                 "inferred": [{"what": "classes.TorchLlmArgs", "why": "x"}]})
    assert entry["commit"] == "376f7e1bd8ed543f75014309e3fd4b237e9b0e73"      # the full sha the footer abbreviates
    assert entry["pages"] == {"p": 1} and entry["inferred"] == []
    c = entry["classes"]
    assert c["StrictBaseModel"]["extra"] == "forbid" and c["BaseLlmArgs"]["extra"] == "forbid"
    assert c["DecodingBaseConfig"]["fields"] == {"max_draft_len": "Optional[int]",
                                                 "speculative_model": "Optional[Union[str, Path]]"}
    assert c["DecodingBaseConfig"]["aliases"] == {"speculative_model": ["speculative_model_dir"]}
    assert c["DraftTargetDecodingConfig"] == {"bases": ["DecodingBaseConfig"], "fields": {},
                                              "classvars": {"decoding_type": "Draft_Target"}}
    assert c["KvCacheConfig"]["bases"] == ["StrictBaseModel", "PybindMirror"]
    assert c["KvCacheConfig"]["fields"] == {"enable_block_reuse": "bool", "free_gpu_memory_fraction": "Optional[float]"}
    assert c["BaseLlmArgs"]["required"] == ["model"] and c["BaseLlmArgs"]["aliases"] == {"mpi_session": ["_mpi_session"]}
    assert entry["from_dict"] == {"DecodingBaseConfig": {"DraftTarget": "DraftTargetDecodingConfig",
                                                         "NGram": "NGramDecodingConfig"}}
    assert entry["extra_dict_mapping"] == {"speculative_config": "DecodingBaseConfig", "kv_cache_config": "KvCacheConfig"}
    assert entry["llm_args_class"] == "TorchLlmArgs"
    assert entry["cli"]["trtllm-serve serve"] == {
        "flags": {"--backend": {"choices": ["pytorch", "tensorrt", "_autodeploy"]},
                  "--config": {"aliases": ["--extra_llm_api_options"]}, "--trust_remote_code": {"flag": True}},
        "positional": ["MODEL"]}
    assert entry["cli"]["trtllm-build"]["flags"] == {
        "--speculative_decoding_mode": {"choices": ["draft_tokens_external", "medusa"]},
        "--gather_generation_logits": {"flag": True}, "--max_draft_len": {}}
    # the checker reads what the extractor wrote
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"releases": {}}))
    (tmp_path / "p.html").write_text(page)
    assert x.main(["--release", "1.2.1", "--llm-args", str(tmp_path / "p.html"), "--schema", str(schema)]) == 0
    assert json.loads(schema.read_text())["releases"]["1.2.1"]["commit"] == "376f7e1"
    (tmp_path / "bad.html").write_text("<html>no source here</html>")
    assert x.main(["--release", "1.2.1", "--llm-args", str(tmp_path / "bad.html"), "--schema", str(schema)]) == 2


def test_the_shipped_schema_agrees_with_what_the_extractor_reads_from_its_own_rendering():
    """Round trip: render the shipped facts of 1.2.1 as a module page, extract, compare (guards the JSON shape)."""
    x = _extractor()
    f = ts.facts("1.2.1")
    lines = []
    for name in ("StrictBaseModel", "DecodingBaseConfig", "DraftTargetDecodingConfig", "KvCacheConfig"):
        c = f["classes"][name]
        lines.append(f"class {name}({', '.join(c['bases'])}):")
        if c.get("extra") and name == "StrictBaseModel":
            lines += ["    class Config:", f"        extra = \"{c['extra']}\""]
        for field, ann in c["fields"].items():
            al = c.get("aliases", {}).get(field)
            lines.append(f"    {field}: {ann} = " + (f"Field(default=None, validation_alias=AliasChoices("
                                                     f"{', '.join(repr(a) for a in [field, *al])}))" if al else "None"))
        lines.append("    pass\n")
    got = x.release_entry("1.2.1", llm_args=_sphinx_module_page("\n".join(lines), "376f7e1"), old=f)
    for name in ("DecodingBaseConfig", "KvCacheConfig"):
        assert got["classes"][name]["fields"] == f["classes"][name]["fields"], name
    assert got["classes"]["DecodingBaseConfig"]["aliases"] == f["classes"]["DecodingBaseConfig"]["aliases"]


def test_standin_loads_our_model_yaml_as_upstream_model_py_does(tmp_path, opts, tiny_llama_draft, monkeypatch):
    """model.py: yaml -> drop triton_config -> update_llm_args_with_extra_dict({}, cfg) -> LLM(**args), on the
    default release (the per-release argument rules are test_llmapi_standin_refuses_exactly_what_the_release_refuses)."""
    version = "1.2.1"
    from specbuild.engines.trtllm import llmapi_standin as sa
    monkeypatch.setattr(sa, "version", lambda: version)
    monkeypatch.setattr(sa, "rehearsal_config", lambda: {"max_batch_size": 1, "max_seq_len": 64})
    files = written(deploy.plan(context("deploy", tmp_path, {**opts, "trtllm_version": version})))
    cfg = yaml.safe_load(files[str(tmp_path / "model_repository" / "triton" / "tensorrt_llm" / "1" / "model.yaml")])
    cfg.pop("triton_config")
    llm = sa.LLM(**sa.update_llm_args_with_extra_dict({}, cfg))
    try:
        assert llm.max_draft_len == 4 and llm.args["speculative_config"].draft_dir == str(tiny_llama_draft)
        assert llm.generate("Hello", sa.SamplingParams(max_tokens=4, temperature=0.0)).outputs[0].token_ids
    finally:
        llm.shutdown()
    # what the project wrote before on 1.2: refused at start-up, as by the release
    cfg["speculative_config"]["decoding_type"] = "Draft_Target"
    with pytest.raises(ValueError, match="^Invalid decoding type: Draft_Target$"):
        sa.update_llm_args_with_extra_dict({}, cfg)
