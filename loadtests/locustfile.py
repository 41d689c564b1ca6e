"""Locustfile for specbuild load tests: one user class, configured by the run spec that
`specbuild loadtest` writes (`--specbuild-spec PATH` or env `SPECBUILD_LOADTEST_SPEC`). Run it through
the command:

    specbuild loadtest --profile chat --url http://127.0.0.1:8000 --tokenizer ./target

or by hand with a spec the command wrote (it names the prompts, payload, tokenizer and gates):

    locust -f loadtests/locustfile.py --specbuild-spec report/runs/chat/default/runspec.json \
        --headless -u 4 -t 30s --host http://127.0.0.1:8000 --csv out/chat

Nothing is read at import time: the spec is loaded by the `init` listener, which also initialises
gRPC's gevent support (needed before any channel exists) when the spec asks for gRPC. The run's end
(enough measured, the hard ceiling, or a dead server) is decided by `stopping.RunMonitor` on the master
or the only process; `-t` is only a backstop.
"""

from __future__ import annotations

import logging
import os
import random
import sys

from locust import events, task

from specbuild.loadtests.runspec import ENV_VAR, GATE_EXIT_CODE, SERVER_GONE_EXIT_CODE, RunSpec
from specbuild.loadtests.stopping import SERVER_GONE, SERVER_GONE_MESSAGE, RunMonitor
from specbuild.loadtests.triton_user import TritonUser

log = logging.getLogger(__name__)


class SpecbuildUser(TritonUser):
    spec: RunSpec   # set by _configure

    def wait_time(self):
        lo, hi = self.spec.wait_time
        return random.uniform(lo, hi) if hi > 0 else 0.0

    def on_start(self):
        self._rng = random.Random(f"{self.spec.seed}-{id(self)}")
        super().on_start()

    @task
    def generate_text(self):
        i = self._rng.randrange(len(self.spec.prompts))
        counts = self.spec.prompt_tokens
        self.generate(self.spec.prompts[i], counts[i] if i < len(counts) else None)


@events.init_command_line_parser.add_listener
def _arguments(parser):
    parser.add_argument("--specbuild-spec", default="", help=f"Run spec JSON written by `specbuild loadtest` "
                        f"(default: ${ENV_VAR}).")


@events.init.add_listener
def _configure(environment, **_kw):
    options = environment.parsed_options
    path = (getattr(options, "specbuild_spec", "") if options else "") or os.environ.get(ENV_VAR, "")
    if not path:
        log.error("no run spec: pass --specbuild-spec PATH (or set %s); `specbuild loadtest` writes one "
                  "per run under <out>/runs/<profile>/<setting>/runspec.json.", ENV_VAR)
        sys.exit(2)
    spec = RunSpec.read(path)
    if spec.protocol == "grpc":
        # tritonclient's gRPC stream hangs under gevent without this.
        import grpc.experimental.gevent as grpc_gevent

        grpc_gevent.init_gevent()
    SpecbuildUser.spec = spec
    SpecbuildUser.host = spec.url
    from locust.runners import WorkerRunner

    if not isinstance(environment.runner, WorkerRunner):
        monitor = RunMonitor(environment, spec)
        environment.specbuild_monitor = monitor
        if environment.runner is not None and hasattr(environment.runner, "register_message"):
            environment.runner.register_message(SERVER_GONE_MESSAGE,
                                                lambda msg, **_: monitor.server_gone(msg.data["message"]))


@events.test_start.add_listener
def _start_monitor(environment, **_kw):
    monitor = getattr(environment, "specbuild_monitor", None)
    if monitor is not None and monitor.started is None:
        monitor.start()


@events.quitting.add_listener
def _slo_gates(environment, **_kw):
    """SLO gates on the aggregated stats (the master's in distributed mode) -> Locust's exit code."""
    spec = getattr(SpecbuildUser, "spec", None)
    monitor = getattr(environment, "specbuild_monitor", None)
    if monitor is not None and monitor.reason == SERVER_GONE:
        environment.process_exit_code = SERVER_GONE_EXIT_CODE
        print(f"server gone: {monitor.gone}", flush=True)
        return
    if spec is None or not spec.gates.active:
        return
    stats = environment.stats

    def p95(kind):
        entry = stats.entries.get((spec.label, kind))
        return entry.get_response_time_percentile(0.95) if entry and entry.num_requests else None

    e2e = stats.entries.get((spec.label, "E2E"))
    error_rate = e2e.num_failures / max(1, e2e.num_requests) if e2e else 1.0  # num_requests counts failures
    problems = spec.gates.violations(p95_ttft_ms=p95("TTFT"), p95_tpot_ms=p95("TPOT"), p95_e2e_ms=p95("E2E"),
                                     error_rate=error_rate)
    environment.process_exit_code = GATE_EXIT_CODE if problems else 0
    for p in problems:
        print(f"SLO gate failed: {p}", flush=True)
