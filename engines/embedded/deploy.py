"""`deploy` stage, embedded backend: render the Triton model repository from the templates.

Output (`<workdir>/model_repository/`)::

    tensorrt_llm/config.pbtxt, 1/model.py       Python backend, decoupled, ONE instance: starts the engine process
    ensemble/config.pbtxt, 1/model.py           client-facing (upstream name + tensors) -> the engine process
    tensorrt_llm_bls/config.pbtxt, 1/model.py   client-facing, + num_draft_tokens -> the engine process

Every model talks to the one engine process (`engines/embedded/service.py`) over its own Unix-socket
connection and answers its own clients. The client-facing models are Python forwarders rather than a Triton
ensemble because Triton 2.51 does not propagate a client's cancellation into ensemble steps, and they do not
forward through `tensorrt_llm` (BLS) because a stub-to-stub response waits on the receiving stub: one dead
stub hung them all (see model_repository/embedded/triton_models.py).

The tensors of the client-facing models come from `specbuild.core.contract`, so the embedded and the
TensorRT-LLM deployments declare the same names, dtypes and dims. Every rendered config is parsed
with Triton's `ModelConfig` protobuf and checked against the contract before the stage is accepted.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from string import Template

from specbuild.core import contract, pbtxt
from specbuild.core.errors import ManifestError, UsageError
from specbuild.core.stage import PlanStep, StageContext, StageResult

ENGINE_MODEL = "tensorrt_llm"
MODELS = (ENGINE_MODEL, contract.ENSEMBLE_MODEL, contract.SPECULATIVE_MODEL)
DEFAULTS = {"max_batch_size": 64, "device": "", "threads": 0,  # device "": as built
            # admission limits of the engine ("" = the build's engine_config.json: 4 x the engine's
            # max_batch_size waiting, 300 s in the queue, 600 s per request); 0 s = no limit
            "max_queue_size": "", "queue_timeout_s": "", "request_timeout_s": ""}
# Accepted besides the contract: GenAI-Perf and older upstream clients send `min_length` (the
# contract's `min_tokens` under its pre-rename name); Triton refuses undeclared inputs.
# `proposer` ("draft" | "ngram") is an embedded-only extension: it picks the proposer per request, so one
# deployment can compare speculation off / draft model / n-gram (`loadtest --setting`, `tune`).
EXTRA_INPUTS = (contract.TensorSpec("min_length", "TYPE_INT32", (1,)),
                contract.TensorSpec("proposer", "TYPE_STRING", (1,)))


def _tensor(t: contract.TensorSpec, *, optional: bool | None = None) -> str:
    opt = t.optional if optional is None else optional
    dims = ", ".join(str(d) for d in t.dims)
    return (f'  {{ name: "{t.name}" data_type: {t.data_type} dims: [ {dims} ]'
            f'{" optional: true" if opt else ""} }}')


def _block(kind: str, tensors, **kw) -> str:
    return f"{kind} [\n" + ",\n".join(_tensor(t, **kw) for t in tensors) + "\n]"


def _template(name: str) -> str:
    return (resources.files("specbuild.model_repository") / "embedded" / name).read_text()


def _options(ctx: StageContext) -> dict:
    opts = {k: ctx.options.get(k, v) if ctx.options.get(k) is not None else v for k, v in DEFAULTS.items()}
    if int(opts["max_batch_size"]) < 1:
        raise UsageError(f"--max-batch-size must be >= 1 (got {opts['max_batch_size']}).")
    if opts["device"] not in ("", "cpu", "cuda") and not str(opts["device"]).startswith("cuda:"):
        raise UsageError(f"--device must be cpu, cuda or cuda:N (got {opts['device']!r}).")
    if int(opts["threads"]) < 0:
        raise UsageError(f"--threads must be >= 0 (0 = torch default), got {opts['threads']}.")
    if opts["max_queue_size"] != "" and int(opts["max_queue_size"]) < 0:
        raise UsageError(f"--max-queue-size must be >= 0 (got {opts['max_queue_size']}).")
    for key, flag in (("queue_timeout_s", "--queue-timeout"), ("request_timeout_s", "--request-timeout")):
        if opts[key] != "" and not float(opts[key]) >= 0:
            raise UsageError(f"{flag} must be >= 0 seconds (0 = no limit), got {opts[key]}.")
    return opts


def render(engine_dir: Path, options: dict) -> dict[str, str]:
    """Relative path -> file content of the whole repository."""
    engine_inputs = contract.CLIENT_INPUTS + EXTRA_INPUTS
    common = {"max_batch_size": int(options["max_batch_size"]),
              "outputs": _block("output", contract.CLIENT_OUTPUTS, optional=False)}
    files = {
        f"{ENGINE_MODEL}/config.pbtxt": Template(_template(f"{ENGINE_MODEL}/config.pbtxt")).substitute(
            common, inputs=_block("input", engine_inputs, optional=True),
            engine_dir=pbtxt.escape(str(Path(engine_dir).resolve())),
            device=options["device"], threads=int(options["threads"]),
            max_queue_size=options.get("max_queue_size", ""), queue_timeout_s=options.get("queue_timeout_s", ""),
            request_timeout_s=options.get("request_timeout_s", "")),
        f"{ENGINE_MODEL}/1/model.py": _template(f"{ENGINE_MODEL}/1/model.py"),
    }
    for model in (contract.ENSEMBLE_MODEL, contract.SPECULATIVE_MODEL):
        inputs = contract.inputs_for(model) + EXTRA_INPUTS
        files[f"{model}/config.pbtxt"] = Template(_template(f"{model}/config.pbtxt")).substitute(
            common, inputs=_block("input", inputs))
        files[f"{model}/1/model.py"] = _template("forward/model.py")
    return files


def validate(files: dict[str, str]) -> list[dict]:
    """Parse every config.pbtxt with Triton's protobuf and check the client models against the contract."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    checks = []
    for path, text in files.items():
        if not path.endswith("config.pbtxt"):
            continue
        cfg = model_config_pb2.ModelConfig()
        try:
            text_format.Parse(text, cfg)
        except text_format.ParseError as e:
            raise ManifestError(f"internal error: rendered {path} is not a valid Triton config: {e}") from e
        problems = (contract.contract_mismatches(cfg.name, cfg.input, cfg.output)
                    if cfg.name in contract.CLIENT_MODELS else [])
        if problems:
            raise ManifestError("internal error: rendered configs break the client contract: "
                                + "; ".join(problems))
        checks.append({"name": f"config:{cfg.name}", "ok": True})
    return checks


def _engine_dir(ctx: StageContext) -> Path:
    if ctx.upstream_dir is None:
        raise ManifestError("deploy needs the build stage's output; run `specbuild build` first.")
    return Path(ctx.upstream_dir).resolve()


def plan(ctx: StageContext) -> list[PlanStep]:
    files = render(_engine_dir(ctx), _options(ctx))
    return [PlanStep("write", path=str(Path(ctx.out_dir) / rel), content=text) for rel, text in files.items()]


def run(ctx: StageContext) -> StageResult:
    engine_dir = _engine_dir(ctx)
    files = render(engine_dir, _options(ctx))
    checks = validate(files)
    for rel, text in files.items():
        path = Path(ctx.out_dir) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        ctx.progress(f"wrote {rel}")
    return StageResult(outputs={"models": list(MODELS), "client_models": list(contract.CLIENT_MODELS),
                                "engine_dir": str(engine_dir)},
                       checks=checks)
