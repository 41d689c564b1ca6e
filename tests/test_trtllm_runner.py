"""The subprocess runner: real child processes, streamed output, stderr carried into our error."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from specbuild.engines.trtllm.runner import CommandFailed, require_tensorrt_llm, run_command
from specbuild.core.errors import SpecbuildError, ToolNotAvailable

NO_TRTLLM = pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None,
                               reason="tensorrt_llm is installed here")


def test_failure_carries_stderr_and_exit_code(tmp_path):
    code = "import sys; print('building rank 0'); print('engine: out of memory', file=sys.stderr); sys.exit(3)"
    lines = []
    with pytest.raises(CommandFailed) as e:
        run_command([sys.executable, "-c", code], log_file=tmp_path / "build.log", progress=lines.append,
                    what="trtllm-build target")
    assert isinstance(e.value, SpecbuildError)
    assert e.value.returncode == 3
    assert "engine: out of memory" in str(e.value) and "exit code 3" in str(e.value)
    assert "trtllm-build target" in str(e.value) and str(tmp_path / "build.log") in str(e.value)
    assert "[trtllm-build target] building rank 0" in lines
    log = (tmp_path / "build.log").read_text()
    assert log.startswith("$ ") and "building rank 0" in log and "out of memory" in log


def test_success_streams_every_line(tmp_path):
    lines = []
    run_command([sys.executable, "-c", "for i in range(3): print('step', i)"], progress=lines.append, what="w")
    assert lines == ["[w] step 0", "[w] step 1", "[w] step 2"]


def test_missing_tool_is_tool_not_available():
    with pytest.raises(ToolNotAvailable, match="not installed or not on PATH"):
        run_command(["specbuild-no-such-tool-xyz"])


@NO_TRTLLM
def test_require_tensorrt_llm_names_dry_run_and_container():
    with pytest.raises(ToolNotAvailable, match=r"--dry-run.*tritonserver:25\.03"):
        require_tensorrt_llm("nvcr.io/nvidia/tritonserver:25.03-trtllm-python-py3")
