"""Option decorators shared by the commands (one place for names, defaults and help text).

    @click.command()
    @workdir_option
    @backend_option
    @dry_run_option
    @force_option
    def build_command(workdir, backend, dry_run, force): ...

`--workdir` reads, in order: the flag, `SPECBUILD_<COMMAND>_WORKDIR`, the shared `SPECBUILD_WORKDIR`,
`specbuild.toml`, then the default `specbuild-work`.
"""

from __future__ import annotations

import os

import click

from specbuild.pipeline.config import DEFAULT_WORKDIR
from specbuild.pipeline.stage import BACKENDS


class _SharedEnvOption(click.Option):
    """An option whose command-specific auto env var (SPECBUILD_<CMD>_<OPT>) wins over a shared one."""

    def resolve_envvar_value(self, ctx: click.Context) -> str | None:
        if self.allow_from_autoenv and ctx.auto_envvar_prefix and self.name:
            rv = os.environ.get(f"{ctx.auto_envvar_prefix}_{self.name.upper()}")
            if rv:
                return rv
        return super().resolve_envvar_value(ctx)


workdir_option = click.option(
    "--workdir", type=click.Path(resolve_path=True, file_okay=False), default=DEFAULT_WORKDIR, show_default=True,
    cls=_SharedEnvOption, envvar="SPECBUILD_WORKDIR",
    help="Workspace holding every stage's output (checkpoints/, engines/, model_repository/, ...).")

backend_option = click.option(
    "--backend", type=click.Choice(BACKENDS), default="embedded", show_default=True,
    help="embedded: the pure-PyTorch engine (any CPU/GPU); trtllm: TensorRT-LLM (NVIDIA GPU).")

dry_run_option = click.option(
    "--dry-run", is_flag=True, default=False,
    help="Print the commands and files the stage would produce, and change nothing.")

force_option = click.option(
    "--force", is_flag=True, default=False,
    help="Proceed despite refusable check failures (e.g. a draft larger than the target) and redo the "
         "stage even when it is up to date.")

trtllm_generation_option = click.option(
    "--trtllm-generation", type=click.Choice(["engine", "llmapi"]), default=None,
    help="TensorRT-LLM path (trtllm only): engine = trtllm-build engines + Triton inflight_batcher_llm with the BLS "
         "draft-target model (TensorRT-LLM <= 1.2.x); llmapi = PyTorch backend, speculative_config for Triton's "
         "llmapi model and trtllm-serve (1.0-1.2.x). Default: llmapi from 1.0, engine before.")

rehearse_option = click.option(
    "--rehearse", is_flag=True, default=False,
    help="trtllm only, on a machine without TensorRT-LLM: record the exact plan (argv, files) as --dry-run does, "
         "keep what the CPU stand-in needs (the Hugging Face checkpoints) and write the real model repository, for "
         "`specbuild serve --rehearse`. The manifests say it is a rehearsal; a GPU deploy refuses its engines.")

# --- load-test traffic (loadtest; tune can reuse them) -------------------------------------------------------

api_option = click.option(
    "--api", type=click.Choice(["kserve", "openai-completions", "openai-chat"]), default="kserve",
    show_default=True,
    help="kserve: Triton's /v2/models/<m>/generate(_stream) (or gRPC); openai-completions / openai-chat: any "
         "OpenAI-compatible server's /v1/completions or /v1/chat/completions (vLLM, SGLang, trtllm-serve, "
         "llama.cpp's llama-server), --url being its base URL.")

sweep_option = click.option(
    "--sweep", "sweep", multiple=True, metavar="[PROFILE:]users=1,2,4,8",
    help="Run every setting at every load point: users=... (closed loop) or request_rate=... (open loop, "
         "requests/s); PROFILE: limits it to one profile (repeat per profile). The report adds the gain by "
         "load, the crossover and the Pareto plot.")

request_rate_option = click.option(
    "--request-rate", type=float, default=None, metavar="REQ/S",
    help="Open loop: requests arrive as a Poisson process of this rate (per second), whatever is in flight, "
         "instead of --users closed-loop users.")

prompts_option = click.option(
    "--prompts", "prompts", type=click.Path(exists=True, dir_okay=False, resolve_path=True), default=None,
    help="Your own prompts: a JSONL file in GenAI-Perf / AIPerf's input-file shape ({\"text\": ..., "
         "\"output_length\": N} per line) or a ShareGPT JSON file, instead of the profile's prompt set.")

prompts_format_option = click.option(
    "--prompts-format", type=click.Choice(["auto", "jsonl", "sharegpt"]), default="auto", show_default=True,
    help="Format of --prompts (auto: ShareGPT when a record has \"conversations\").")

lengths_option = click.option(
    "--lengths", type=click.Choice(["profile", "data"]), default="profile", show_default=True,
    help="With --prompts: profile = the profile's max_tokens and max_input_tokens for every request; data = "
         "each record's output length (output_length, or the ShareGPT reply's tokens) and its prompt as is.")
