"""Load tests end to end: `specbuild loadtest` against real tritonservers, each Locust run a real
subprocess under a hard deadline.

- `embedded`: the real embedded deployment (tiny Llama target + draft through convert -> build ->
  deploy, `tests/servers.py`), served by its own tritonserver for this module, so a crash under load
  cannot take down the session-wide server other modules share.
- `calibrated`: a tritonserver with a fixed-timing Python model honouring the client contract
  (`token_ms` per step; with num_draft_tokens=K each step emits up to `accept+1` tokens). Its timing
  is known, so it is the reference for the measurement check (Locust vs the independent client, and
  both vs the truth).
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import threading
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from servers import reaped

from specbuild.cli.main import cli

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]

MODEL_PY = textwrap.dedent('''
    import json, threading, time
    import numpy as np
    import triton_python_backend_utils as pb_utils

    WORDS = [" the", " quick", " brown", " fox", " jumps", " over", " lazy", " dog", ".", " Paris",
             " is", " capital", " of", " France", " model", " server"]

    def _opt(request, name, default):
        t = pb_utils.get_input_tensor_by_name(request, name)
        return default if t is None else t.as_numpy().flatten()[0]

    class TritonPythonModel:
        def initialize(self, args):
            params = json.loads(args["model_config"]).get("parameters", {})
            self.token_ms = float(params["token_ms"]["string_value"])
            self.accept = int(params["accept"]["string_value"])

        def execute(self, requests):
            for request in requests:
                threading.Thread(target=self._serve, args=(request,), daemon=True).start()
            return None

        def _serve(self, request):
            sender = request.get_response_sender()
            try:
                prompt = _opt(request, "text_input", b"").decode()
                n = int(_opt(request, "max_tokens", 16))
                stream = bool(_opt(request, "stream", False))
                k = int(_opt(request, "num_draft_tokens", 0))
                perf = bool(_opt(request, "return_perf_metrics", False))
                if not prompt or n <= 0:
                    raise ValueError("text_input must be non-empty and max_tokens > 0")
                start = sum(prompt.encode()) % len(WORDS)
                words = [WORDS[(start + i) % len(WORDS)] for i in range(n)]
                step = min(k, self.accept) + 1 if k > 0 else 1
                drafted = accepted = 0
                out = []
                for i in range(0, n, step):
                    time.sleep(self.token_ms / 1000.0)
                    group = words[i:i + step]
                    if k > 0:
                        drafted += k
                        accepted += len(group) - 1
                    if stream:
                        sender.send(self._response(group, drafted, accepted, perf))
                    else:
                        out += group
                if stream:
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                else:
                    sender.send(self._response(out, drafted, accepted, perf),
                                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as e:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

        def _response(self, words, drafted, accepted, perf):
            tensors = [pb_utils.Tensor("text_output", np.array(["".join(words).encode()], dtype=object))]
            if perf:
                rate = accepted / drafted if drafted else 0.0
                tensors += [pb_utils.Tensor("acceptance_rate", np.array([rate], dtype=np.float32)),
                            pb_utils.Tensor("total_accepted_draft_tokens", np.array([accepted], dtype=np.int32)),
                            pb_utils.Tensor("total_draft_tokens", np.array([drafted], dtype=np.int32))]
            return pb_utils.InferenceResponse(output_tensors=tensors)
''')


def _config(name: str, speculative: bool, token_ms: float, accept: int) -> str:
    inputs = [("text_input", "TYPE_STRING", False), ("max_tokens", "TYPE_INT32", False),
              ("stream", "TYPE_BOOL", True), ("temperature", "TYPE_FP32", True),
              ("exclude_input_in_output", "TYPE_BOOL", True), ("return_perf_metrics", "TYPE_BOOL", True)]
    if speculative:
        inputs.append(("num_draft_tokens", "TYPE_INT32", True))
    ins = ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: [ 1 ] optional: {str(o).lower()} }}'
                     for n, t, o in inputs)
    return textwrap.dedent(f'''\
        name: "{name}"
        backend: "python"
        max_batch_size: 8
        model_transaction_policy {{ decoupled: true }}
        input [
        {ins}
        ]
        output [
          {{ name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }},
          {{ name: "acceptance_rate" data_type: TYPE_FP32 dims: [ 1 ] }},
          {{ name: "total_accepted_draft_tokens" data_type: TYPE_INT32 dims: [ 1 ] }},
          {{ name: "total_draft_tokens" data_type: TYPE_INT32 dims: [ 1 ] }}
        ]
        instance_group [ {{ count: 1 kind: KIND_CPU }} ]
        parameters {{ key: "token_ms" value: {{ string_value: "{token_ms}" }} }}
        parameters {{ key: "accept" value: {{ string_value: "{accept}" }} }}
        ''')


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class TritonFixture:
    """A real tritonserver on loopback serving the fixture repository; stopped by its own PID."""

    def __init__(self, root: Path, token_ms: float = 20.0, accept: int = 2):
        from specbuild.pipeline.tritonbin import find_tritonserver, prepare_backend_dir, server_env

        repo = root / "repo"
        for name, spec in (("ensemble", False), ("tensorrt_llm_bls", True)):
            (repo / name / "1").mkdir(parents=True)
            (repo / name / "1" / "model.py").write_text(MODEL_PY)
            (repo / name / "config.pbtxt").write_text(_config(name, spec, token_ms, accept))
        binary = find_tritonserver()
        backends = prepare_backend_dir(binary, root / "backends")
        self.http_port, self.grpc_port, self.metrics_port = _free_ports(3)
        argv = [str(binary.path), "--model-repository", str(repo), "--backend-directory", str(backends),
                "--http-address", "127.0.0.1", "--http-port", str(self.http_port),
                "--grpc-address", "127.0.0.1", "--grpc-port", str(self.grpc_port),
                "--metrics-address", "127.0.0.1", "--metrics-port", str(self.metrics_port),
                "--allow-gpu-metrics", "false", "--exit-timeout-secs", "3"]
        self.log = root / "server.log"
        self.proc = subprocess.Popen(argv, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     env=server_env(binary), start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/v2/health/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"tritonserver not ready in 60 s: {self.log.read_text()[-2000:]}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        # The Python-backend stubs are in the server's own session (process group = its PID): a test that killed the
        # server left one behind, orphaned, for an hour (2026-12-07, under slowbox). Whatever of the group is left goes.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    server = TritonFixture(tmp_path_factory.mktemp("triton"), token_ms=20.0, accept=2)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, server_workdir):
    """The session's tiny embedded deployment, served by a tritonserver owned by this module."""
    from servers import ServerHandle, serve_options

    from specbuild.pipeline import serve

    state = tmp_path_factory.mktemp("loadtest-serve")
    opts = serve_options()
    info = serve.start(state, opts, repository=server_workdir / "model_repository")
    handle = ServerHandle(state, opts, info)
    handle.deployment = server_workdir   # tokenizer and max_seq_len are found through it
    yield handle
    handle.stop()


def _invoke(args: list[str]):
    """`specbuild loadtest ...` in-process (Locust itself runs in subprocesses)."""
    result = CliRunner().invoke(cli, ["loadtest", *args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def _embedded_args(server, out: Path, *extra: str) -> list[str]:
    return ["--workdir", str(server.deployment), "--url", server.http_url, "--grpc-url", server.grpc_url,
            "--metrics-url", server.metrics_url, "--out", str(out), *extra]


def _alive(server) -> bool:
    return httpx.get(f"{server.http_url}/v2/health/ready", timeout=5).status_code == 200


def _metric(metrics_url: str, name: str, model: str) -> float:
    from specbuild.core.metrics import metric_sum, parse_prometheus

    return metric_sum(parse_prometheus(httpx.get(metrics_url, timeout=5).text), name, model=model)


def test_chat_and_batch_speculation_on_vs_off_report(embedded, tmp_path):
    out = tmp_path / "report"
    r = _invoke(_embedded_args(embedded, out, "--profile", "chat", "--profile", "batch",
                               "--compare", "num_draft_tokens=0,4", "--users", "2", "--duration", "3",
                               "--min-requests", "4", "--max-tokens", "16"))
    assert r.exit_code == 0, r.output
    assert _alive(embedded)
    data = json.loads((out / "report.json").read_text())
    from specbuild.pipeline.loadtest import deployment_max_seq_len

    max_seq_len = deployment_max_seq_len(embedded.deployment)
    assert data["status"] == "ok" and data["model"] == "tensorrt_llm_bls" and data["max_seq_len"] == max_seq_len
    # prompt budget = max_seq_len - max_tokens - 8, minus 64 for the chat template both profiles apply
    assert data["max_input_tokens"] == {"chat": min(256, max_seq_len - 16 - 8 - 64),
                                        "batch": min(1024, max_seq_len - 16 - 8 - 64)}
    cells = {(c["profile"], c["setting"]): c for c in data["cells"]}
    assert set(cells) == {(p, f"num_draft_tokens={k}") for p in ("chat", "batch") for k in (0, 4)}
    for (profile, setting), c in cells.items():
        assert c["status"] == "ok" and c["stop"]["reason"] == "complete" and c["requests"] >= 4
        assert c["requests"] > 0 and c["failures"] == 0, c["errors"]
        assert c["e2e_ms"]["p50"] > 0 and c["output_tokens"] > 0 and c["tokens_per_s"] > 0
        assert c["locust"]["E2E"]["count"] > 0 and ("TTFT" in c["locust"]) == (profile == "chat")
        assert (c["ttft_ms"] is not None) == (profile == "chat") and (c["itl_ms"] is not None) == (profile == "chat")
        assert c["harness"]["overhead_ms"]["p50"] < 50 and c["harness"]["zero_work_probe_ms"]["count"] > 0
        run = out / "runs" / profile / setting.replace("=", "-")
        assert (run / "locust_stats.csv").is_file() and list((run / "samples").glob("samples-*.jsonl"))
        acc = c["acceptance"]
        if setting.endswith("=0"):
            assert acc["responses"]["drafted"] == 0 and acc["responses"]["acceptance_rate"] is None
        else:   # perf metrics from the responses agree with the server's custom counters
            assert acc["responses"]["drafted"] > 0 and 0 <= acc["responses"]["acceptance_rate"] <= 1
            sm = acc["server_metrics"]
            assert "specbuild_draft_tokens_total" in sm["counters"] and sm["drafted"] >= acc["responses"]["drafted"]
            assert sm["mean_accepted_length"] >= 1
    # a paired comparison: each user sends the same prompts in the same order under both settings
    for profile in ("chat", "batch"):
        sent = {}
        for k in (0, 4):
            rows = [json.loads(ln) for p in (out / "runs" / profile / f"num_draft_tokens-{k}" / "samples").glob(
                "samples-*.jsonl") for ln in p.read_text().splitlines()]
            by_user: dict = {}
            for row in sorted((r for r in rows if r["kind"] == "request"), key=lambda r: r["start"]):
                by_user.setdefault(row["user"], []).append(row["prompt"])
            sent[k] = by_user
        assert set(sent[0]) == set(sent[4]) and len(sent[0]) == 2, sent
        for user, prompts in sent[0].items():
            n = min(len(prompts), len(sent[4][user]))
            assert n >= 1 and prompts[:n] == sent[4][user][:n], (profile, user, sent)
    assert cells[("batch", "num_draft_tokens=0")]["tpot_definition"] == "e2e / tokens (non-streaming)"
    gains = {g["profile"]: g for g in data["gains"]}
    assert set(gains) == {"chat", "batch"}
    assert gains["chat"]["ttft_speedup"] > 0 and gains["batch"]["ttft_speedup"] is None
    assert all(gains[p][k] > 0 for p in gains for k in ("tpot_speedup", "e2e_speedup", "throughput_gain"))
    md = (out / "report.md").read_text()
    assert "## Batch vs interactive" in md and "| batch | num_draft_tokens=4 vs num_draft_tokens=0 |" in md
    for name in ("ttft_cdf.png", "itl_cdf.png", "e2e_cdf.png", "throughput.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "manifest.json").read_text())["stage"] == "loadtest"
    # the conventions users know: a summary CSV and GenAI-Perf's export, next to report.json
    rows = list(csv.DictReader(open(out / "summary.csv")))
    assert {(r["profile"], r["setting"]) for r in rows} == set(cells) and all(r["status"] == "ok" for r in rows)
    genai = json.loads((out / "profile_export_genai_perf.json").read_text())["runs"]
    chat_on, batch_on = genai["chat/num_draft_tokens=4"], genai["batch/num_draft_tokens=4"]
    assert chat_on["request_count"]["avg"] == cells[("chat", "num_draft_tokens=4")]["requests"]
    assert chat_on["time_to_first_token"]["unit"] == "ms" and "inter_token_latency" in chat_on
    assert "time_to_first_token" not in batch_on and batch_on["input_sequence_length"]["min"] > 0
    assert chat_on["request_latency"]["p50"] == pytest.approx(cells[("chat", "num_draft_tokens=4")]["e2e_ms"]["p50"])
    per_run = out / "runs" / "chat" / "num_draft_tokens-4" / "profile_export_genai_perf.json"
    assert json.loads(per_run.read_text()) == chat_on


def test_slo_gate_failure_exits_nonzero_and_keeps_the_report(embedded, tmp_path):
    out = tmp_path / "report"
    r = _invoke(_embedded_args(embedded, out, "--profile", "chat", "--users", "1", "--duration", "3",
                               "--min-requests", "2", "--max-tokens", "8", "--max-p95-ttft-ms", "0.001",
                               "--max-error-rate", "0.5"))
    assert r.exit_code == 3, r.output
    assert "SLO gate(s) failed" in r.output and "p95 TTFT" in r.output
    data = json.loads((out / "report.json").read_text())
    cell = data["cells"][0]
    assert data["status"] == "gates failed" and cell["gates"]["passed"] is False
    assert cell["locust_exit_code"] == 3   # Locust's quitting listener set process_exit_code too


def test_grpc_streaming_with_distributed_locust(embedded, tmp_path):
    out = tmp_path / "report"
    r = _invoke(_embedded_args(embedded, out, "--profile", "chat", "--protocol", "grpc", "--workers", "2",
                               "--users", "2", "--duration", "4", "--min-requests", "2", "--max-tokens", "8"))
    assert r.exit_code == 0, r.output
    cell = json.loads((out / "report.json").read_text())["cells"][0]
    assert cell["status"] == "ok" and cell["stop"]["reason"] == "complete"   # the master's monitor ended it
    assert cell["requests"] > 0 and cell["failures"] == 0 and cell["ttft_ms"]["count"] == cell["requests"]
    run = out / "runs" / "chat" / "default"
    assert (run / "locust-worker0.log").is_file() and (run / "locust-worker1.log").is_file()
    types = json.loads((run / "runspec.json").read_text())["datatypes"]   # the wire module's, as declared
    assert types["text_input"] == "BYTES" and types["max_tokens"] == "INT32" and types["stream"] == "BOOL"
    assert types["temperature"] == "FP32" and types["min_tokens"] == "INT32"
    assert len(list((run / "samples").glob("samples-*.jsonl"))) == 2   # one file per worker process
    procs = cell["client_cpu"]["by_process"]                         # each Locust process's own CPU
    assert [p["role"] for p in procs] == ["master", "worker", "worker"], procs
    assert all(p["cpu_s"] > 0 and p["cores"] is not None and p["wall_s"] > 0 for p in procs)
    assert sum(p["cpu_s"] for p in procs) <= cell["client_cpu"]["cpu_s"] + 0.5   # within the children's total
    assert "(m " in (out / "report.md").read_text() and " w " in (out / "report.md").read_text()


def test_bad_inputs_fail_before_any_load(embedded, tmp_path, monkeypatch):
    out = tmp_path / "report"
    before = _metric(embedded.metrics_url, "nv_inference_request_success", "tensorrt_llm_bls")
    r = _invoke(_embedded_args(embedded, out, "--model", "nope"))     # the server is another workdir's: no token
    assert r.exit_code == 2 and "model 'nope' does not exist" in r.output and "tensorrt_llm_bls" not in r.output
    assert "needs the server's admin token" in r.output and "SPECBUILD_ADMIN_TOKEN" in r.output
    monkeypatch.setenv("SPECBUILD_ADMIN_TOKEN", embedded.info.admin_token)
    r = _invoke(_embedded_args(embedded, out, "--model", "nope"))     # with its token: the models it serves
    assert r.exit_code == 2 and "model 'nope' does not exist" in r.output and "tensorrt_llm_bls" in r.output
    monkeypatch.delenv("SPECBUILD_ADMIN_TOKEN")
    r = _invoke(_embedded_args(embedded, out, "--model", "ensemble", "--compare", "num_draft_tokens=0,4"))
    assert r.exit_code == 2 and "has no input(s) ['num_draft_tokens']" in r.output
    assert "--model tensorrt_llm_bls" in r.output
    assert _metric(embedded.metrics_url, "nv_inference_request_success", "tensorrt_llm_bls") == before
    # a value the deployment refuses (above the built max draft length): caught by the smoke requests
    r = _invoke(_embedded_args(embedded, out, "--compare", "num_draft_tokens=0,99"))
    assert r.exit_code == 2 and "refused a request with this run's parameters" in r.output
    assert not out.exists()


def _loadtest_in_background(server, out: Path, *args: str) -> subprocess.Popen:
    """`specbuild loadtest` as a user's process (its own session, so signals reach it alone)."""
    argv = [sys.executable, "-m", "specbuild.cli.main", "loadtest", *_embedded_args(server, out, *args)]
    from servers import interruptible

    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=interruptible)


def _wait_for_chat_samples(out: Path, timeout: float) -> None:
    """Until the first chat run has written a sample (the load is on), or `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not any(
            p.stat().st_size > 0 for p in out.parent.glob(".tmp-report-*/runs/chat/default/samples/*.jsonl")):
        time.sleep(0.2)


def test_ctrl_c_still_writes_what_was_measured(embedded, tmp_path):
    out = tmp_path / "report"
    proc = _loadtest_in_background(embedded, out, "--profile", "chat", "--profile", "batch", "--users", "1",
                                   "--duration", "60", "--max-tokens", "8")
    with reaped(proc):
        _wait_for_chat_samples(out, 90)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        # "within a few seconds": Locust gets runner.INTERRUPT_GRACE_S, then is killed; the report follows.
        # 60 s holds on a machine 3x slower (here it takes a few seconds).
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    data = json.loads((out / "report.json").read_text())
    assert data["status"] == "interrupted" and [c["profile"] for c in data["cells"]] == ["chat"]
    assert data["cells"][0]["interrupted"] and data["cells"][0]["requests"] > 0
    assert data["cells"][0]["status"] == "interrupted" and (out / "summary.csv").is_file()
    assert not list(out.parent.glob(".tmp-report-*"))


def test_a_paused_server_is_reported_as_a_stall_and_the_run_recovers(embedded, tmp_path):
    """SIGSTOP the server mid-run, SIGCONT it: nothing fails, and the report names the silence (its length at
    least the pause, when it happened) instead of hiding it in the latency percentiles."""
    import os

    out = tmp_path / "report"
    pause_s = 8.0
    proc = _loadtest_in_background(embedded, out, "--profile", "chat", "--users", "2", "--duration", "24",
                                   "--max-tokens", "8")
    with reaped(proc):
        _wait_for_chat_samples(out, 120)
        time.sleep(2.0)
        os.killpg(embedded.info.pid, signal.SIGSTOP)
        try:
            time.sleep(pause_s)
        finally:
            os.killpg(embedded.info.pid, signal.SIGCONT)
        output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    cell = json.loads((out / "report.json").read_text())["cells"][0]
    assert cell["status"] == "ok" and cell["failures"] == 0 and cell["requests"] > 0
    quiet = cell["silence"]
    # A chat user thinks up to 2.0 s between requests (its profile's wait_time): when none was in flight at the
    # SIGSTOP, the silence starts with the next request, up to 2.0 s into the pause.
    assert quiet["longest_s"] >= pause_s - 2.0 - 0.5, quiet
    assert quiet["stalls"] and max(s["s"] for s in quiet["stalls"]) == quiet["longest_s"], (quiet, cell["requests"])
    assert "the server sent nothing for" in output
    assert "Stalls (requests in flight" in (out / "report.md").read_text()


def test_measurement_cross_check_against_known_timing(calibrated, tiny_tokenizer, tmp_path):
    """Locust and the independent asyncio+httpx client, side by side on the same request, both measure it,
    and neither reads less than the server's fixed work (20 ms per step: TTFT >= one step, e2e >= ten).
    How close the two agree depends on the machine: that claim is a benchmark's (`make bench`), not a
    test's; here the ratios only have to be sane, which holds on a machine 3x slower."""
    out = tmp_path / "report"
    r = _invoke(["--tokenizer", str(tiny_tokenizer), "--url", calibrated.url, "--metrics-url", "",
                 "--model", "ensemble", "--profile", "chat", "--users", "1", "--duration", "6",
                 "--min-requests", "3", "--max-tokens", "10", "--cross-check", "--out", str(out)])
    assert r.exit_code == 0, r.output
    cell = json.loads((out / "report.json").read_text())["cells"][0]
    cc = cell["cross_check"]
    assert "error" not in cc, cc
    assert cc["requests"] >= 3 and cc["locust_requests"] >= 3
    assert cc["locust_ttft_p50_ms"] >= 20 and cc["locust_e2e_p50_ms"] >= 200     # lower bounds: the server's sleeps
    assert cc["ttft_p50_ms"] >= 20 and cc["e2e_p50_ms"] >= 200
    assert 0.5 <= cc["ttft_ratio"] <= 2 and 0.5 <= cc["e2e_ratio"] <= 2, cc
    assert "within_10pct" in cc and cc["locust_harness_overhead_p50_ms"] >= 0


def test_one_setting_measures_one_configuration(calibrated, tiny_tokenizer, tmp_path):
    out = tmp_path / "report"
    r = _invoke(["--tokenizer", str(tiny_tokenizer), "--url", calibrated.url, "--metrics-url", "",
                 "--profile", "chat", "--setting", "k4:num_draft_tokens=4", "--users", "2", "--duration", "2",
                 "--min-requests", "3", "--max-tokens", "6", "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads((out / "report.json").read_text())
    assert data["model"] == "tensorrt_llm_bls" and data["baseline"] == "k4" and data["gains"] == []
    assert [(c["setting"], c["status"]) for c in data["cells"]] == [("k4", "ok")]
    assert data["cells"][0]["acceptance"]["responses"]["drafted"] > 0


def test_a_setting_too_slow_to_measure_is_reported_with_what_it_saw(calibrated, tiny_tokenizer, tmp_path):
    """Fewer requests than --min-requests by the ceiling: the run ends there, and the report (exit 0) says
    "too slow to measure here" with what it measured."""
    out = tmp_path / "report"
    r = _invoke(["--tokenizer", str(tiny_tokenizer), "--url", calibrated.url, "--metrics-url", "",
                 "--model", "ensemble", "--profile", "batch", "--users", "2", "--duration", "1",
                 "--min-requests", "100000", "--max-duration", "4", "--max-tokens", "5", "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads((out / "report.json").read_text())
    cell = data["cells"][0]
    assert data["status"] == "too slow to measure here" and cell["status"] == "too slow to measure here"
    assert cell["stop"]["reason"] == "too slow to measure here" and cell["stop"]["max_duration_s"] == 4
    assert cell["requests"] > 0 and cell["e2e_ms"]["p50"] >= 100   # what it saw: 5 steps of 20 ms at least
    md = (out / "report.md").read_text()
    assert "**too slow to measure here**" in md and "wanted 100000" in md


def test_server_death_mid_load_stops_the_run_and_exits_nonzero(tiny_tokenizer, tmp_path):
    """A server killed under batch load (closed loop, no think time): the run stops after a few
    consecutive connection errors (users back off, no tight retry loop), the report says so, exit 4,
    and the runs after it are not started (listed as not run)."""
    server = TritonFixture(tmp_path / "triton", token_ms=20.0, accept=2)
    out = tmp_path / "report"

    def kill_when_loaded():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(   # a completed request (not only the start-up probes)
                '"kind": "request"' in p.read_text() for p in tmp_path.glob(".tmp-report-*/runs/batch/off/samples/*")):
            time.sleep(0.2)
        server.proc.kill()   # our own tritonserver, by its PID
        server.proc.wait(timeout=30)

    killer = threading.Thread(target=kill_when_loaded, daemon=True)
    killer.start()
    try:
        r = _invoke(["--tokenizer", str(tiny_tokenizer), "--url", server.url, "--metrics-url", "",
                     "--profile", "batch", "--setting", "off:num_draft_tokens=0",
                     "--setting", "on:num_draft_tokens=2", "--users", "4", "--duration", "600",
                     "--max-tokens", "5", "--out", str(out)])
    finally:
        killer.join(timeout=60)
        server.stop()
    assert r.exit_code == 4, r.output
    assert "stopped answering" in r.output
    data = json.loads((out / "report.json").read_text())
    cell = data["cells"][0]
    assert data["status"] == "server gone" and cell["status"] == "server gone" and len(data["cells"]) == 1
    assert cell["stop"]["reason"] == "server gone" and "consecutive connection errors" in cell["stop"]["server_gone"]
    assert cell["requests"] > 0                     # what was measured before the death is kept
    assert cell["failures"] < 100                   # backed off: no tight loop of refused connections
    assert data["not_run"] == ["batch/on"] and "not run" in (out / "report.md").read_text()
