"""The server command lines for a TensorRT-LLM deployment (what `launch_triton_server.py` would run).

Engine path, default (orchestrator mode): one `tritonserver` under `mpirun -n 1` with
TRTLLM_ORCHESTRATOR=1; the tensorrtllm backend spawns the engine workers itself (any TP), which is
how several TensorRT-LLM models (target + draft) share one server (`--multi-model`).

Engine path with fast logits: leader mode with spawning disabled, world size 1 + draft ranks +
target ranks; rank 0 orchestrates, ranks != 0 load only the two engine models; the configs'
`participant_ids` follow the same layout.

LLM-API path: `trtllm-serve serve <target> --extra_llm_api_options <yaml>` (`--config` on 1.2; OpenAI API),
or `tritonserver` on the llmapi repository (`trtllm-llmapi-launch` under MPI when TP*PP > 1).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any


from specbuild.engines.trtllm.repository import DRAFT_MODEL, TARGET_MODEL
from specbuild.engines.trtllm.settings import Settings


def _server_args(s: Settings, repo: Path) -> list[str]:
    return [s.tritonserver, f"--model-repository={repo}",
            f"--http-address={s.host}", f"--grpc-address={s.host}", f"--metrics-address={s.host}",
            f"--http-port={s.http_port}", f"--grpc-port={s.grpc_port}", f"--metrics-port={s.metrics_port}"]


def _tail(rank: int) -> list[str]:
    return ["--disable-auto-complete-config", f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"]


def engine_launch(s: Settings, repo: Path) -> dict[str, Any]:
    """argv + env for the inflight_batcher_llm repository at `repo`."""
    argv = ["mpirun", "--allow-run-as-root"]
    if not s.fast_logits:
        argv += ["-n", "1", *_server_args(s, repo),
                 "--pinned-memory-pool-byte-size=0", "--enable-peer-access=false",
                 *[f"--cuda-memory-pool-byte-size={gpu}:0" for gpu in range(s.num_gpus)],
                 *_tail(0), ":"]
        env = {"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1"}
        world = 1
    else:
        world = 1 + s.draft_world + s.target_world
        for rank in range(world):
            argv += ["-n", "1", *_server_args(s, repo)]
            if rank != 0:
                argv += ["--model-control-mode=explicit", f"--load-model={TARGET_MODEL}",
                         f"--load-model={DRAFT_MODEL}"]
            argv += [*_tail(rank), ":"]
        env = {"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "0"}
    return {"argv": argv, "env": env, "world_size": world, "container": s.recipe.container}


def llmapi_launch(s: Settings, repo: Path, target_dir: Path, options_yaml: Path) -> dict[str, Any]:
    """trtllm-serve (the primary server of the llmapi path) and the Triton llmapi alternative.

    All LLM() arguments (parallelism, limits, KV cache, speculative_config) live in the YAML, so the
    command line only names the model, the backend, the address and the YAML.
    """
    from specbuild.engines.trtllm.llmapi import check_argv, release
    flag = release(s.recipe.trtllm_version).serve_flag
    # `trtllm-serve serve MODEL [OPTIONS]`, the usage line of every release's CLI reference (1.0.0 .. 1.2.1).
    serve = ["trtllm-serve", "serve", str(target_dir), "--backend", "pytorch", "--host", s.host,
             "--port", str(s.http_port), flag, str(options_yaml)]
    check_argv(s.recipe.trtllm_version, "trtllm-serve serve", serve)
    triton = ["mpirun", "--allow-run-as-root", "-n", "1", "trtllm-llmapi-launch"] if s.target_world > 1 else []
    # No --disable-auto-complete-config here: upstream's llmapi model.py sets decoupled and max_batch_size from
    # model.yaml's triton_config in auto_complete_config() (read at TensorRT-LLM's triton_backend, tensorrtllm_backend
    # c2e65b8 llmapi/tensorrt_llm/1/model.py); config.pbtxt declares neither.
    triton += [*_server_args(s, repo), "--backend-config=python,shm-region-prefix-name=prefix0_"]
    return {"argv": serve, "env": {}, "world_size": 1, "container": s.recipe.container, "triton_argv": triton,
            "triton_container": _triton_container(s),
            "triton_note": "Triton's llmapi model runs in a tritonserver:<yy.mm>-trtllm-python-py3 image that ships "
                           f"TensorRT-LLM {s.recipe.trtllm_version}: {_triton_container(s) or 'pass it as --container-tag'}"
                           "; trtllm-serve runs in the container above."}


def _triton_container(s: Settings) -> str | None:
    from specbuild.engines.trtllm.versions import triton_container
    return triton_container(s.recipe.trtllm_version)


def launch_script(launch: dict[str, Any]) -> str:
    """A runnable shell script for the launch (to run inside the container)."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in launch["env"].items())
    lines = ["#!/usr/bin/env bash", "# Written by specbuild deploy --backend trtllm. Run inside:",
             f"#   {launch['container']}", "set -euo pipefail",
             (env + " " if env else "") + "exec " + shlex.join(launch["argv"])]
    if launch.get("triton_argv"):
        lines.insert(4, "# Triton (KServe v2) alternative: " + shlex.join(launch["triton_argv"]))
    return "\n".join(lines) + "\n"


def launch_json(launch: dict[str, Any]) -> str:
    return json.dumps(launch, indent=2) + "\n"
