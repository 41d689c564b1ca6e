"""Every repository file a doc names exists, and so does every `specbuild.<module>` it names.

The docs are README.md, docs/*.md and bench/README.md, and every docstring of the repository's Python files
(modules, classes, functions; read with ast, nothing imported). What counts as a repository path (pragmatic, so
it finds names rather than prose): a backticked token, a markdown link target, or a bare word with a `/`, that
starts with a top-level folder of the repository (`pipeline/...`, `docs/...`); and any backticked name of a
markdown file (the docs cite docs by name). It is looked up from the repository root and from
the naming file's own folder. Paths relative to something else (`1/model.py` inside a rendered model,
upstream's `lib/decode.py`) do not start with a repository folder and are not checked.

Not repository files, and allowed (the one rule, kept narrow):
- a token with a placeholder or pattern in it (`<workdir>`, `{a,b}`, `*`, `$VAR`, `...`, an upper-case
  `WORKDIR/` or `OUT/`), a URL, an absolute or home path, and `owner/repo#123`-style upstream references;
- a path inside a workdir's stage output that starts like a repository folder: `engines/engine_config.json`,
  `model_repository/tensorrt_llm/config.pbtxt` (the stages' output folders, `core.stage.STAGE_DIRS`) and
  `bench/results/engine.json` (what the benchmarks write), `report/report.md` (loadtest's; and `report.md`,
  `tune.md` named bare), when the part after that folder is not itself in
  the repository (so `engines/embedded/<missing>.py` is checked, `engines/engine_config.json` is an output).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from specbuild.core.stage import STAGE_DIRS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "bench/README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
SUFFIXES = (".py", ".md", ".json", ".jsonl", ".toml", ".sh", ".pbtxt", ".txt", ".yaml", ".yml", ".csv", ".png",
            ".cfg", ".ini")
TOP = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))
# folders the stages (and `loadtest`: report/) write into a workdir, and what the benchmarks write under bench/
WRITTEN = {*STAGE_DIRS.values(), "report", "bench/results"}
REPORTS = {"report.md", "tune.md"}      # the markdown reports `loadtest` and `tune` write, named bare

BACKTICK = re.compile(r"`([^`\s]+)`")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
BARE = re.compile(r"(?<![\w/.<{$~-])((?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_.-]*)(?![<{*\w/-])")
MODULE = re.compile(r"(?<![\w.])specbuild(?:\.[A-Za-z_]\w*)+(?![\w-])")
NOT_MODULES = {"specbuild.toml"}        # the config file's name


def _is_placeholder(tok: str) -> bool:
    return (re.match(r"[A-Z_]+/", tok) is not None or any(c in tok for c in "<>{}*$[]|") or "..." in tok or "://" in tok or tok.startswith(("/", "~", "."))
            or re.search(r"#\d+$", tok) is not None or re.fullmatch(r"[\w.-]+/[\w.-]+@[\w.]+", tok) is not None)


def _looks_like_path(tok: str, *, backticked: bool = False, link: bool = False) -> bool:
    if _is_placeholder(tok):
        return False
    if link or (backticked and tok.endswith(".md") and tok not in REPORTS):
        return True
    return "/" in tok and tok.split("/")[0] in TOP


def _is_output(path: str) -> bool:
    parts = path.strip("/").split("/")
    for n in (2, 1):                      # "bench/results/x.json", then "engines/engine_config.json"
        head = "/".join(parts[:n])
        if head in WRITTEN and len(parts) > n:
            rest = parts[n]
            return not (ROOT / head / rest).is_dir() and not (ROOT / head / rest).is_file()
        if head in WRITTEN:
            return not (ROOT / head).exists()          # the output folder itself, e.g. `report/`
    return False


def _exists(path: str, base: Path) -> bool:
    path = path.rstrip("/")
    return any((d / path).exists() for d in (ROOT, base))


def _module_exists(dotted: str) -> bool:
    """A dotted `specbuild.` name is a module or package of the repository, or a name defined in one."""
    parts = dotted.split(".")[1:]
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        src = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if src.is_file():
            rest = parts[cut:]
            if not rest:
                return True
            text = src.read_text()
            return len(rest) <= 2 and re.search(rf"(?m)^\s*(?:def|class)\s+{rest[0]}\b|^\s*{rest[0]}\s*[:=]|"
                                                rf"import .*\b{rest[0]}\b", text) is not None
    return False


def _texts():
    """(where, folder it is relative to, text, markdown?) of every doc and docstring."""
    for rel in DOCS:
        yield rel, (ROOT / rel).parent, (ROOT / rel).read_text(), True
    for py in sorted(ROOT.rglob("*.py")):
        rel = py.relative_to(ROOT)
        if rel.parts[0].startswith(".") or "__pycache__" in rel.parts or rel.parts[0] in ("build", "dist"):
            continue
        try:
            tree = ast.parse(py.read_text())
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    yield f"{rel}:{getattr(node, 'lineno', 1)}", py.parent, doc, False


def missing(where: str, base: Path, text: str, markdown: bool) -> list[str]:
    """What `text` names that is not there: paths, then modules."""
    ticked = {t.rstrip(".,:;)") for t in BACKTICK.findall(text)}
    links = {t for t in LINK.findall(text) if not t.startswith(("http:", "https:", "mailto:"))} if markdown else set()
    # a bare path that ends a line in "-" is one that help text wrapped at a hyphen (click), not a name
    bare = {m.group(1).rstrip(".,:;)") for m in BARE.finditer(text)
            if not (m.group(1).endswith("-") and text[m.end():m.end() + 1] in ("\n", ""))}
    out = []
    for tok in sorted(ticked | links | bare):
        if tok.startswith("specbuild.") or _is_output(tok) or not _looks_like_path(
                tok, backticked=tok in ticked, link=tok in links):
            continue
        path = tok.split(":")[0] if tok.count(":") == 1 and tok.split(":")[1].strip("0-9-") == "" else tok
        if not _exists(path, base):
            out.append(f"{where}: path {tok!r}")
    for mod in sorted(set(MODULE.findall(text)) - NOT_MODULES):
        if not _module_exists(mod):
            out.append(f"{where}: module {mod!r}")
    return out


def test_every_path_and_module_a_doc_or_docstring_names_exists():
    problems = [p for args in _texts() for p in missing(*args)]
    assert not problems, "docs name what the repository does not hold:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("line, bad", [
    ("see `pipeline/no_such_stage.py` for the details", "pipeline/no_such_stage.py"),
    ("the [guide](docs/missing-guide.md)", "docs/missing-guide.md"),
    ("run `specbuild.pipeline.no_such_module`", "specbuild.pipeline.no_such_module"),
    ("`specbuild.pipeline.tune.NoSuchThing` does it", "specbuild.pipeline.tune.NoSuchThing"),
    ("`engines/embedded/gone.py` (a repository folder: checked, not an output)", "engines/embedded/gone.py"),
])
def test_a_doc_naming_a_missing_file_fails(tmp_path, line, bad):
    doc = tmp_path / "doc.md"
    doc.write_text(f"# A doc\n\nSee `pipeline/tune.py` and [serving](docs/serving.md).\n\n{line}\n")
    found = missing("doc.md", tmp_path, doc.read_text(), True)
    assert len(found) == 1 and bad in found[0], found


def test_outputs_and_placeholders_are_not_repository_files(tmp_path):
    text = ("`engines/engine_config.json`, `model_repository/tensorrt_llm/config.pbtxt`, `report/report.md`, "
            "`<workdir>/engines/`, `bench/results/{engine,served}.json`, `~/.cache/specbuild`, "
            "`triton-inference-server/server#7077`, `specbuild.pipeline.tune.TuneConfig`")
    assert missing("doc.md", tmp_path, text, True) == []
