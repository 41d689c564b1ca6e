"""The TensorRT-LLM 0.20 .. 1.2.x families of the version table: every fact carries its source and exactness,
derived families are their base plus their dated changes, the generated configs are the table's, every stage's
--dry-run works per family, the LLM-API names are the release's, and --rehearse runs the chain without
TensorRT-LLM (the rehearsal servers themselves: test_trtllm_rehearsal_cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from trtllm_support import context, gathered_trees, runs, written

from specbuild.cli.main import cli
from specbuild.core import upstream_facts
from specbuild.engines.trtllm import build, convert, deploy
from specbuild.engines.trtllm.repository import upstream_mismatches
from specbuild.engines.trtllm.versions import ENGINE_CONTAINERS, resolve

NEW = {"0.20": "0.20.0", "0.21": "0.21.0", "1.0": "1.0.0", "1.1": "1.1.0", "1.2": "1.2.1"}
EXACTNESS = {"exact", "inferred", "unknown"}


@pytest.fixture
def opts(tiny_llama, tiny_llama_draft):
    return {"target_dir": str(tiny_llama), "draft_dir": str(tiny_llama_draft)}


def test_every_new_family_names_its_upstream_commit_container_and_exactness():
    fams = upstream_facts.families()
    for family in NEW:
        fam = fams[family]
        assert fam["trtllm"]["commit"] and len(fam["trtllm"]["commit"]) == 40, family
        assert fam["container"] == ENGINE_CONTAINERS[family]
        assert fam["exactness"] in EXACTNESS
        assert fam["read_from"].get("commit") or fam.get("derived"), family
        facts = fam["provenance"] + fam.get("derived", {}).get("changes", [])
        assert facts
        for f in facts:
            assert f["exactness"] in EXACTNESS and f["source"] and f["fact"] and f["id"], (family, f)
    assert fams["0.20"]["read_from"]["commit"] == "c2e65b88d85255be30cf50440a91662abeb497dd"
    assert fams["1.2"]["trtllm"]["commit"] == "376f7e1bd8ed543f75014309e3fd4b237e9b0e73"   # 1.2.1's submodule
    assert upstream_facts.family_of("1.2.1") == upstream_facts.family_of("1.2.0") == "1.2"


def test_derived_families_are_their_base_plus_their_changes():
    data = json.loads(upstream_facts.FACTS_FILE.read_text())
    for family in ("0.21", "1.0", "1.1", "1.2"):
        assert data["families"][family]["derived"]["from"]
        assert upstream_facts.derive_models(data, family) == data["families"][family]["models"], family
    with pytest.raises(ValueError, match="declared already"):
        upstream_facts.apply_change(json.loads(json.dumps(data["families"]["1.0"]["models"])),
                                    {"op": "add_input", "model": "tensorrt_llm",
                                     "tensor": {"name": "return_num_input_tokens"}})


def names(family, model, kind="inputs"):
    return {t["name"] for t in upstream_facts.model_facts(family, model)[kind]}


def test_release_differences_are_where_the_table_says():
    for family in NEW:
        for model in ("ensemble", "tensorrt_llm", "tensorrt_llm_bls"):
            assert {"seed", "min_tokens"} <= names(family, model), (family, model)       # renamed in 0.20
            assert not {"random_seed", "min_length"} & names(family, model)
        counts = {"return_num_input_tokens", "return_num_output_tokens"} <= names(family, "tensorrt_llm_bls")
        assert counts == (family not in ("0.20", "0.21")), family                         # #5445: 1.0 on
        assert ("num_output_tokens" in names(family, "ensemble", "outputs")) == counts
        assert ("IMAGE_SIZES" in names(family, "preprocessing")) == (family in ("1.1", "1.2"))   # #6714
        pet = [t for t in upstream_facts.model_facts(family, "tensorrt_llm")["inputs"]
               if t["name"] == "prompt_embedding_table"][0]
        assert (pet["data_type"] == "${prompt_embedding_table_data_type}") == (family == "1.2")
    for old in ("0.18", "0.19"):
        assert {"random_seed", "min_length"} <= names(old, "tensorrt_llm_bls")
    assert [f["id"] for f in upstream_facts.inferred_facts("1.2")] == [
        "bls-loop", "container", "no-container-1.2.0", "bls-token-counts", "length-penalty-ignored", "prompt-embedding-table-data-type",
        "pixtral-image-sizes", "token-counts", "release-configs"]
    assert upstream_facts.inferred_facts("0.18") == []


@pytest.mark.parametrize("family", sorted(NEW))
def test_every_stage_dry_run_per_family(tmp_path, opts, family):
    o = {**opts, "trtllm_version": NEW[family], "trtllm_generation": "engine"}
    conv = convert.plan(context("convert", tmp_path, o))
    assert f"container {ENGINE_CONTAINERS[family]}" in conv[0].note
    assert len(runs(conv)) == 2 and all("specbuild.engines.trtllm.convert_rank" in a for a in runs(conv))
    draft, target = runs(build.plan(context("build", tmp_path, o)))
    assert target[target.index("--speculative_decoding_mode") + 1] == "draft_tokens_external"
    steps = deploy.plan(context("deploy", tmp_path, o))
    notes = [s.note for s in steps if s.kind == "note"]
    assert sum("not read at the release's own commit" in n for n in notes) == 1      # said once
    files = written(steps)
    for path, text in files.items():
        if path.endswith("config.pbtxt"):
            model = Path(path).parent.name
            table_model = "tensorrt_llm" if model == "tensorrt_llm_draft" else model
            assert upstream_mismatches(text, upstream_facts.template_text(family, table_model)) == [], model
            assert "${" not in "".join(ln for ln in text.splitlines() if not ln.startswith("parameters:"))
    launch = json.loads(files[str(tmp_path / "model_repository" / "launch.json")])
    assert launch["container"] == ENGINE_CONTAINERS[family]


@pytest.mark.parametrize("version,decoding,key,flag", [
    ("1.0.0", "DraftTarget", "speculative_model_dir", "--extra_llm_api_options"),
    ("1.1.0", "DraftTarget", "speculative_model_dir", "--extra_llm_api_options"),
    ("1.2.0", "DraftTarget", "speculative_model", "--config"),
    ("1.2.1", "DraftTarget", "speculative_model", "--config")])
def test_llmapi_names_per_release(tmp_path, opts, tiny_llama_draft, version, decoding, key, flag):
    o = {**opts, "trtllm_version": version}
    files = written(deploy.plan(context("deploy", tmp_path, o)))
    root = tmp_path / "model_repository"
    model_yaml = files[str(root / "triton" / "tensorrt_llm" / "1" / "model.yaml")]
    assert f'speculative_config:\n  decoding_type: "{decoding}"\n  max_draft_len: 4\n  {key}: "{tiny_llama_draft}"' \
        in model_yaml
    assert "pytorch_backend_config" not in model_yaml         # StrictBaseModel on 1.x rejects it
    assert files[str(root / "trtllm_serve.yaml")] in model_yaml
    launch = json.loads(files[str(root / "launch.json")])
    assert launch["argv"][-2:] == [flag, str(root.resolve() / "trtllm_serve.yaml")]
    assert launch["container"] == f"nvcr.io/nvidia/tensorrt-llm/release:{version}"
    # no tritonserver container carries 1.2.0 (26.03 has 1.2.0rc8, 26.04 .. 26.07 have 1.2.1)
    assert launch["triton_container"] == (None if version == "1.2.0" else ENGINE_CONTAINERS[version.rsplit(".", 1)[0]])
    # upstream's llmapi model.py sets decoupled / max_batch_size from model.yaml in auto_complete_config()
    assert "--disable-auto-complete-config" not in launch["triton_argv"]


def test_engine_path_past_1_2_is_refused_from_the_cli_and_nothing_is_written(tmp_path, tiny_llama, tiny_llama_draft):
    w = tmp_path / "w"
    r = CliRunner().invoke(cli, ["convert", "--backend", "trtllm", "--trtllm-version", "1.3.0", "--trtllm-generation",
                                 "engine", "--target", str(tiny_llama), "--draft", str(tiny_llama_draft),
                                 "--workdir", str(w)])
    assert r.exit_code != 0
    assert "has no engine path" in r.output and "#15907" in r.output and "--trtllm-generation llmapi" in r.output
    assert not w.exists()
    assert resolve("1.2.1", generation="engine").backend_family == "1.2"


def test_rehearse_chain_from_the_cli_records_the_plan_and_a_gpu_deploy_refuses_it(tmp_path, tiny_llama,
                                                                                 tiny_llama_draft):
    w = tmp_path / "w"

    def run(*args):
        return CliRunner().invoke(cli, [*args, "--backend", "trtllm", "--workdir", str(w)])

    r = run("convert", "--target", str(tiny_llama), "--draft", str(tiny_llama_draft), "--trtllm-generation", "engine",
            "--rehearse")
    assert r.exit_code == 0, r.output
    plan = json.loads((w / "checkpoints" / "rehearsal_plan.json").read_text())
    argvs = [s["run"] for s in plan["steps"] if "run" in s]
    assert [a[a.index("--output-dir") + 1] for a in argvs] == [str(w / "checkpoints" / "target"),
                                                               str(w / "checkpoints" / "draft")]
    assert plan["recipe"]["trtllm_version"] == "1.2.1" and plan["recipe"]["backend_family"] == "1.2"
    for role, src in (("target", tiny_llama), ("draft", tiny_llama_draft)):      # the stand-in's weights, kept
        kept = w / "checkpoints" / "hf" / role
        assert sorted(p.name for p in kept.iterdir()) == sorted(p.name for p in Path(src).iterdir())
    assert not (w / "checkpoints" / "target").exists()                            # no TensorRT-LLM checkpoint
    r = run("build", "--max-seq-len", "256", "--max-batch-size", "2")            # for real: refused with the reason
    assert r.exit_code != 0 and "rehearsal's checkpoints" in r.output and not (w / "engines").exists()
    assert run("build", "--max-seq-len", "256", "--max-batch-size", "2", "--rehearse").exit_code == 0
    marker = json.loads((w / "engines" / "target" / "REHEARSAL.json").read_text())
    assert marker["engine"] is None and "--speculative_decoding_mode" in marker["would_run"]
    assert not list((w / "engines").glob("*/rank*.engine"))
    r = run("deploy", "--rehearse")
    assert r.exit_code == 0, r.output
    assert r.output.count("not read at the release's own commit") == 1
    m = json.loads((w / "model_repository" / "manifest.json").read_text())
    assert m["extra"]["rehearsal"] is True and m["extra"]["recipe"]["backend_family"] == "1.2"
    for stage in ("checkpoints", "engines"):
        assert json.loads((w / stage / "manifest.json").read_text())["extra"]["rehearsal"] is True
    cfg = (w / "model_repository" / "triton" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert f'string_value: "{(w / "engines" / "target").resolve()}"' in cfg
    r = run("deploy", "--force")                                                 # a GPU deploy of rehearsal engines
    assert r.exit_code != 0 and "rehearsal's engines" in r.output and "without --rehearse" in r.output


def test_gathered_trees_are_the_families_they_claim():
    trees = gathered_trees()
    if not trees:
        pytest.skip("no gathered upstream trees (scripts/gather_trtllm_upstream.py; ../shared/upstream/trtllm-backend)")
    for family, tree in trees.items():
        assert upstream_facts.extract_tree(tree) == upstream_facts.families()[family]["models"], family


def test_rehearsals_use_upstreams_trees_beside_the_repository_by_default(monkeypatch):
    from trtllm_support import SHARED_UPSTREAM, UPSTREAM_ENV, gathered_root
    monkeypatch.delenv(UPSTREAM_ENV, raising=False)
    if not SHARED_UPSTREAM.is_dir():
        pytest.skip(f"no {SHARED_UPSTREAM} beside this checkout")
    assert gathered_root() == SHARED_UPSTREAM
    assert {"0.18", "0.19", "0.20"} <= set(gathered_trees())
    monkeypatch.setenv(UPSTREAM_ENV, "/nowhere")            # the variable still wins
    assert gathered_root() == Path("/nowhere") and gathered_trees() == {}


def test_llmapi_standin_keeps_the_release_rules(monkeypatch):
    from specbuild.engines.trtllm import llmapi_standin as sa
    monkeypatch.setattr(sa, "version", lambda: "1.1.0")
    cfg = sa.update_llm_args_with_extra_dict({}, {"speculative_config": {
        "decoding_type": "DraftTarget", "max_draft_len": 3, "speculative_model_dir": "/d"},
        "kv_cache_config": {"enable_block_reuse": True}})
    # 1.1.0's update_llm_args_with_extra_dict does not map kv_cache_config: it stays a mapping for LLM() to validate
    assert cfg["speculative_config"].draft_dir == "/d" and cfg["kv_cache_config"] == {"enable_block_reuse": True}
    with pytest.raises(ValueError, match="Invalid decoding type: Draft_Target"):
        sa.DecodingBaseConfig.from_dict({"decoding_type": "Draft_Target", "max_draft_len": 3,
                                         "speculative_model_dir": "/d"})
    with pytest.raises(ValueError, match="speculative_model: Extra inputs are not permitted"):
        sa.DecodingBaseConfig.from_dict({"decoding_type": "DraftTarget", "max_draft_len": 3,
                                         "speculative_model": "/d"})
    with pytest.raises(ValueError, match="pytorch_backend_config: Extra inputs are not permitted"):
        sa.LLM(model="/x", pytorch_backend_config={"use_cuda_graph": False})
    monkeypatch.setattr(sa, "version", lambda: "1.2.1")
    # 1.2.1's DecodingBaseConfig.from_dict knows DraftTarget, not Draft_Target (the ClassVar spelling); the draft
    # field is speculative_model, with speculative_model_dir accepted as its alias
    for key in ("speculative_model", "speculative_model_dir"):
        c = sa.DecodingBaseConfig.from_dict({"decoding_type": "DraftTarget", "max_draft_len": 2, key: "/d"})
        assert c.draft_dir == "/d"
    with pytest.raises(ValueError, match="^Invalid decoding type: Draft_Target$"):
        sa.DecodingBaseConfig.from_dict({"decoding_type": "Draft_Target", "max_draft_len": 2,
                                         "speculative_model": "/d"})
    with pytest.raises(ValueError, match="max_draft_len must be > 0"):
        sa.DecodingBaseConfig.from_dict({"decoding_type": "DraftTarget", "max_draft_len": 0,
                                         "speculative_model": "/d"})
    with pytest.raises(TypeError, match="unexpected keyword argument 'beam'"):
        sa.SamplingParams(beam=2)


def _dims(family: str, model: str, kind: str, name: str) -> list[int]:
    return next(t["dims"] for t in upstream_facts.model_facts(family, model)[kind] if t["name"] == name)


def test_the_1_1_and_1_2_preprocessing_declares_image_sizes_as_upstream_does(tmp_path, opts):
    """TensorRT-LLM PR #6714 (pixtral) made preprocessing's output IMAGE_SIZES one row per image: both stored versions
    of triton_backend/all_models/inflight_batcher_llm/preprocessing/config.pbtxt after it (808059da, 08dc37e3)
    declare dims [ -1, 2 ]; the 0.20 tree (tensorrtllm_backend c2e65b8) and the families before the PR keep [ 2 ]."""
    for family in ("1.1", "1.2"):
        assert _dims(family, "preprocessing", "outputs", "IMAGE_SIZES") == [-1, 2], family
        assert _dims(family, "preprocessing", "inputs", "IMAGE_SIZES") == [-1, 2], family
    for family in ("0.18", "0.19", "0.20", "0.21", "1.0"):
        assert _dims(family, "preprocessing", "outputs", "IMAGE_SIZES") == [2], family
    files = written(deploy.plan(context("deploy", tmp_path, {**opts, "trtllm_version": "1.2.1",
                                                             "trtllm_generation": "engine"})))
    ours = next(t for p, t in files.items() if p.endswith("preprocessing/config.pbtxt"))
    assert '{ name: "IMAGE_SIZES" data_type: TYPE_INT64 dims: [ -1, 2 ] },' in ours


def test_serve_rehearse_accepts_upstreams_1x_preprocessing(tmp_path, opts):
    """Upstream's 1.x preprocessing config, made from the 0.20 tree by PR #6714's edits (as 808059da holds them),
    matches what deploy writes for 1.2.1 (the rehearsal compares them and refused a mismatch)."""
    import re
    from trtllm_support import upstream_tree
    tree, _ = upstream_tree("0.20")
    text = (tree / "inflight_batcher_llm" / "preprocessing" / "config.pbtxt").read_text()
    url = re.compile(r'(name: "IMAGE_URL"\s+data_type: TYPE_STRING\s+dims: \[ )1( \]\s+optional: true\s+\},)')
    text, n = url.subn(r'\g<1>-1\g<2>\n    {\n        name: "IMAGE_SIZES"\n        data_type: TYPE_INT64\n'
                       r'        dims: [ -1, 2 ]\n        optional: true\n    },', text)
    out = re.compile(r'(name: "IMAGE_SIZES"\s+data_type: TYPE_INT64\s+dims: \[ )2( \]\s+\},)')
    text, m = out.subn(r"\g<1>-1, 2\g<2>", text)
    assert n == 1 and m == 1
    files = written(deploy.plan(context("deploy", tmp_path, {**opts, "trtllm_version": "1.2.1",
                                                             "trtllm_generation": "engine"})))
    ours = next(t for p, t in files.items() if p.endswith("preprocessing/config.pbtxt"))
    assert upstream_mismatches(ours, text) == []
