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

import itertools
import json
import logging
import os
import random
import sys
import time

import gevent
from locust import events, task

from specbuild.loadtests.runspec import ENV_VAR, GATE_EXIT_CODE, SERVER_GONE_EXIT_CODE, RunSpec
from specbuild.loadtests.stopping import SERVER_GONE, SERVER_GONE_MESSAGE, RunMonitor
from specbuild.loadtests.triton_user import TritonUser

log = logging.getLogger(__name__)


_user_numbers = itertools.count()      # this process's users, in the order Locust starts them


class SpecbuildUser(TritonUser):
    """Closed loop (one request in flight, then think time), or with `spec.request_rate` an open loop: this
    user sends its share of a Poisson arrival process, each request on its own greenlet and connection
    (connections are reused once free), whatever is still in flight."""

    spec: RunSpec   # set by _configure

    def wait_time(self):
        if self.spec.request_rate:
            return 0.0   # the open loop's task sleeps its exponential gaps itself
        lo, hi = self.spec.wait_time
        return getattr(self, "_think", random).uniform(lo, hi) if hi > 0 else 0.0

    def on_start(self):
        # The same prompts in the same order for the same user in every run of a session: the settings compared
        # at one load then answer the same requests (a paired comparison). Seeded by the process's worker index
        # and the user's number in it, not by id(self): that differed from run to run, and the demo compared
        # chat TTFT at 1 user over 78- and 130-token prompts with the policy against 38-42 without.
        worker = getattr(self.environment.runner, "worker_index", 0) or 0
        self.user_key = f"{worker}-{next(_user_numbers)}"
        self._rng = random.Random(f"{self.spec.seed}-{self.user_key}")
        self._think = random.Random(f"{self.spec.seed}-{self.user_key}-think")
        self._idle_clients: list = []
        self._in_flight: set = set()
        super().on_start()

    def on_stop(self):
        if self._in_flight:   # the open loop's requests still running get the stop timeout to finish
            gevent.joinall(list(self._in_flight), timeout=self.spec.request_timeout_s)
        for client in self._idle_clients:
            client.close()
        super().on_stop()

    def _draw(self):
        """(prompt, its input tokens, its output tokens, its index in the run's prompts)."""
        i = self._rng.randrange(len(self.spec.prompts))
        counts, outs = self.spec.prompt_tokens, self.spec.prompt_output_tokens
        return self.spec.prompts[i], counts[i] if i < len(counts) else None, outs[i] if i < len(outs) else None, i

    @task
    def generate_text(self):
        if not self.spec.request_rate:
            prompt, input_tokens, output_tokens, index = self._draw()
            self.generate(prompt, input_tokens, output_tokens, prompt_index=index)
            return
        rate = self.spec.request_rate / max(1, self.spec.open_loop_users)
        gevent.sleep(self._rng.expovariate(rate))
        g = gevent.spawn(self._one_open_loop_request, *self._draw())
        self._in_flight.add(g)
        g.link(self._in_flight.discard)

    def _one_open_loop_request(self, prompt, input_tokens, output_tokens, index):
        client = self._idle_clients.pop() if self._idle_clients else self.new_client()
        try:
            self.generate(prompt, input_tokens, output_tokens, client=client, prompt_index=index)
        finally:
            self._idle_clients.append(client)


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
def _own_cpu(environment, **_kw):
    """This process's CPU (user + system) and lifetime -> `<samples_dir>/process-<pid>.json`, so the report can
    give each worker's client CPU: a worker near one core is a client-bound measurement."""
    spec = getattr(SpecbuildUser, "spec", None)
    if spec is None:
        return
    import psutil
    from locust.runners import MasterRunner, WorkerRunner

    me = psutil.Process()
    cpu = me.cpu_times()
    role = ("master" if isinstance(environment.runner, MasterRunner)
            else "worker" if isinstance(environment.runner, WorkerRunner) else "local")
    record = {"role": role, "pid": os.getpid(), "cpu_s": round(cpu.user + cpu.system, 3),
              "wall_s": round(time.time() - me.create_time(), 3)}
    path = os.path.join(spec.samples_dir, f"process-{os.getpid()}.json")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    except OSError as e:   # the run's numbers stand without it
        log.warning("could not write %s: %s", path, e)


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
