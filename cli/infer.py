"""`specbuild infer`: one prompt against a running deployment (thin wrapper over `specbuild.pipeline.client`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from specbuild.core import contract
from specbuild.cli.options import api_option, workdir_option
from specbuild.pipeline.client import DEFAULT_GRPC, DEFAULT_HTTP


@click.command("infer")
@click.option("--prompt", required=True, help="The prompt text.")
@click.option("--stream/--no-stream", default=None,
              help="Print pieces as they arrive (generate_stream / gRPC stream) or wait for one response. Default: "
                   "stream, except on a TensorRT-LLM llmapi deployment (non-decoupled, as upstream deploys it).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Tokens to generate at most.")
@click.option("--min-tokens", type=click.IntRange(min=0), default=None,
              help="Generate at least this many tokens (EOS is ignored until then). Default: 0.")
@click.option("--num-draft-tokens", type=click.IntRange(min=-1), default=None,
              help="Draft tokens per step (0 = speculation off, -1 = adaptive K on embedded). "
                   "Default: the engine's K. Implies --model tensorrt_llm_bls.")
@click.option("--proposer", type=click.Choice(["draft", "ngram"]), default=None,
              help="Embedded deployments only: the draft model or n-gram prompt lookup (default: the engine's).")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="0 = greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=None, help="Top-k (0/unset = off).")
@click.option("--top-p", type=click.FloatRange(0, 1), default=None, help="Top-p (unset = off).")
@click.option("--seed", type=click.IntRange(min=0), default=None, help="Sampling seed (reproducible).")
@click.option("--protocol", type=click.Choice(["http", "grpc"]), default="http", show_default=True,
              help="HTTP (/generate, /generate_stream SSE) or gRPC streaming.")
@api_option
@click.option("--model", default=None,
              help=f"KServe: the client-facing model ({', '.join(contract.CLIENT_MODELS)}). Default: ensemble, or "
                   "tensorrt_llm_bls with --num-draft-tokens. --api openai-*: the request's model field (default: "
                   "the first of the server's /v1/models).")
@click.option("--url", default=None,
              help=f"HTTP endpoint (with --api openai-*: the server's base URL, required). Default: the server "
                   f"`specbuild serve` started in --workdir, else {DEFAULT_HTTP}.")
@click.option("--grpc-url", default=None,
              help=f"gRPC endpoint. Default: the server `specbuild serve` started in --workdir, else {DEFAULT_GRPC}.")
@workdir_option
@click.option("--chat", is_flag=True, default=False,
              help="Wrap the prompt as a user turn in the target's chat template (tokenizer from --workdir, "
                   "or --tokenizer). --api openai-chat sends it as a user message anyway (the server templates).")
@click.option("--tokenizer", default=None, help="Tokenizer dir for --chat. Default: the deployment's in --workdir.")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds to wait for the answer.")
def infer_command(prompt, stream, max_tokens, min_tokens, num_draft_tokens, proposer, temperature, top_k, top_p,
                  seed, protocol, api, model, url, grpc_url, workdir, chat, tokenizer, timeout):
    """Send one prompt, print the tokens as they arrive, then the acceptance stats.

    \b
    Example:
      specbuild infer --prompt "The capital of France is" --max-tokens 32
      specbuild infer --prompt "def fib(n):" --num-draft-tokens 4 --protocol grpc
      specbuild infer --prompt "Hello" --no-stream --num-draft-tokens 0
      specbuild infer --chat --prompt "What is the capital of France?" --proposer ngram --num-draft-tokens 4
      specbuild infer --api openai-chat --url http://127.0.0.1:8080 --prompt "Hello"   # trtllm-serve, vLLM, ...
    """
    from specbuild.core import wire

    if wire.is_openai(api):
        return _infer_openai(api, prompt, stream, url, model, chat, tokenizer, workdir, timeout, protocol=protocol,
                             num_draft_tokens=num_draft_tokens, proposer=proposer, grpc_url=grpc_url,
                             params=dict(max_tokens=max_tokens, min_tokens=min_tokens, temperature=temperature,
                                         top_k=top_k, top_p=top_p, seed=seed))
    if model is not None and model not in contract.CLIENT_MODELS:
        raise click.BadParameter(f"{model!r} is not one of {', '.join(contract.CLIENT_MODELS)} (a model name of an "
                                 "OpenAI-compatible server goes with --api openai-*).", param_hint="'--model'")
    model = model or (contract.SPECULATIVE_MODEL if num_draft_tokens is not None else contract.ENSEMBLE_MODEL)
    if num_draft_tokens is not None and model != contract.SPECULATIVE_MODEL:
        raise click.UsageError(f"--num-draft-tokens needs --model {contract.SPECULATIVE_MODEL} "
                               f"({model} uses the engine's default K).")
    from specbuild.pipeline.serve import endpoints

    from specbuild.pipeline.client import client_for, deployment_target
    from specbuild.pipeline.loadtest import resolve_tokenizer

    where = endpoints(workdir, url, grpc_url)
    tok_dir = resolve_tokenizer(tokenizer, Path(workdir)) if chat or deployment_target(workdir) != "embedded" else None
    client = client_for(workdir, where.http, where.grpc, model=model, timeout=timeout, tokenizer_dir=tok_dir)
    if client.target == contract.LLMAPI_TARGET:
        if stream:
            raise click.UsageError("this TensorRT-LLM llmapi deployment is non-decoupled (model.yaml's "
                                   "triton_config, upstream's default), so it cannot stream: use --no-stream.")
        stream = False
    stream = True if stream is None else stream
    params = dict(max_tokens=max_tokens, min_tokens=min_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                  seed=seed, num_draft_tokens=num_draft_tokens, return_perf_metrics=True, proposer=proposer)
    if chat:
        from specbuild.loadtests.tokens import TokenCounter

        prompt = TokenCounter(tok_dir).chat(prompt)

    if protocol == "grpc":
        gen = client.grpc_stream(prompt, on_chunk=_show if stream else None, stream=stream, **params)
    elif stream:
        gen = client.generate_stream(prompt, on_chunk=_show, **params)
    else:
        gen = client.generate(prompt, **params)
    if not stream:
        _show(gen.text)
    click.echo("")
    _stats(gen, f"{client.model} via {protocol}")


def _show(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def _stats(gen, via: str) -> None:
    drafted, accepted = gen.total_draft_tokens, gen.total_accepted_draft_tokens
    rate = f"{gen.acceptance_rate:.1%}" if gen.acceptance_rate is not None and drafted else "n/a (no drafts)"
    ttft = f"{gen.ttft * 1000:.0f} ms" if gen.ttft is not None else "n/a"
    tokens = f", {gen.usage['completion_tokens']} tokens (server's count)" if "completion_tokens" in gen.usage else ""
    click.echo(f"-- {via}: {len(gen.chunks)} pieces in {gen.seconds:.2f}s, TTFT {ttft}; "
               f"drafted {drafted if drafted is not None else 'n/a'}, accepted "
               f"{accepted if accepted is not None else 'n/a'}, acceptance rate {rate}{tokens}", err=True)


def _infer_openai(api, prompt, stream, url, model, chat, tokenizer, workdir, timeout, *, protocol, num_draft_tokens,
                  proposer, grpc_url, params) -> None:
    """One request to an OpenAI-compatible server (a smoke test of trtllm-serve, vLLM, SGLang, llama-server)."""
    refused = [flag for flag, given in (("--protocol grpc", protocol == "grpc"),
                                        ("--num-draft-tokens", num_draft_tokens is not None),
                                        ("--proposer", proposer is not None), ("--grpc-url", grpc_url is not None))
               if given]
    if refused:
        raise click.UsageError(f"{', '.join(refused)}: not with --api {api} (an OpenAI-compatible server is reached "
                               "over HTTP and its speculation is fixed when it starts).")
    if not url:
        raise click.UsageError(f"--api {api} needs --url: the server's base URL (e.g. http://127.0.0.1:8080).")
    from specbuild.pipeline.client import OpenAIClient

    client = OpenAIClient.connect(url, api, model, timeout)
    if chat and api != "openai-chat":
        from specbuild.loadtests.tokens import TokenCounter
        from specbuild.pipeline.loadtest import resolve_tokenizer

        prompt = TokenCounter(resolve_tokenizer(tokenizer, Path(workdir))).chat(prompt)
    stream = True if stream is None else stream
    gen = client.generate_stream(prompt, on_chunk=_show, **params) if stream else client.generate(prompt, **params)
    if not stream:
        _show(gen.text)
    click.echo("")
    _stats(gen, f"{client.model} at {client.url} via {api}{' (stream)' if stream else ''}")
