"""`specbuild verify`: prove a running deployment is lossless (thin wrapper over `specbuild.pipeline.verify`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from specbuild.core import contract
from specbuild.cli.options import api_option, workdir_option
from specbuild.core.errors import UsageError


def _endpoint(workdir: Path, url: str | None) -> str:
    from specbuild.pipeline.serve import endpoints

    where = endpoints(workdir, url)
    if not url and not where.recorded:
        raise UsageError(f"no server recorded in {workdir}/server/; start one with `specbuild serve --background "
                         f"--workdir {workdir}` or pass --url of a running deployment.")
    return where.http


def _tokenizer(workdir: Path, tokenizer: str | None):
    from specbuild.pipeline.loadtest import resolve_tokenizer
    from specbuild.loadtests.tokens import TokenCounter

    return TokenCounter(resolve_tokenizer(tokenizer, workdir))


@click.command("verify")
@workdir_option
@api_option
@click.option("--url", default=None,
              help="HTTP endpoint (with --api openai-*: the speculative server's base URL). Default: the server "
                   "started by `specbuild serve` in --workdir.")
@click.option("--reference-url", default=None,
              help="HTTP endpoint of the same target served without speculation: the K = 0 side goes there and no "
                   "request carries num_draft_tokens (for deployments whose speculation is fixed when deployed: "
                   "TensorRT-LLM's llmapi path, and every OpenAI-compatible server, where it is required). "
                   "Default: K = 0 on --url.")
@click.option("--model", default=None,
              help=f"KServe: the client-facing model that takes num_draft_tokens (default {contract.SPECULATIVE_MODEL}); "
                   "--api openai-*: the request's model field (default: each server's first of /v1/models).")
@click.option("--prompt", "prompts", multiple=True, help="A prompt to check (repeatable). Default: a built-in set.")
@click.option("--prompts", "prompts_file", type=click.Path(resolve_path=True, dir_okay=False), default=None,
              help="File of prompts: JSON list, JSONL with a 'prompt' field, or one per line.")
@click.option("--num-draft-tokens", "-k", type=click.IntRange(min=1), default=None,
              help="K for the speculative side; compared against K = 0 (KServe only; with --reference-url or an "
                   "OpenAI server the speculative side runs as deployed). [default: 4]")
@click.option("--max-tokens", type=click.IntRange(min=1), default=32, show_default=True,
              help="Tokens per greedy comparison.")
@click.option("--seeds", type=click.IntRange(min=0), default=200, show_default=True,
              help="Samples per side for the distribution test (0 = greedy check only).")
@click.option("--positions", type=click.IntRange(min=1), default=4, show_default=True,
              help="Output positions tested under sampling.")
@click.option("--temperature", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Sampling temperature for the distribution test.")
@click.option("--alpha", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=1e-3, show_default=True,
              help="Family-wise false-alarm rate of the distribution test (Bonferroni over positions).")
@click.option("--concurrency", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests in flight.")
@click.option("--tokenizer", default=None, help="Tokenizer dir for re-tokenizing outputs. Default: from --workdir.")
@click.option("--chat-template/--raw", "chat", default=True, show_default=True,
              help="Send each prompt as a user turn in the target's chat template (instruct models), or raw "
                   "(--api openai-chat: always a user message, templated by the server).")
@click.option("--timeout", type=float, default=300.0, show_default=True,
              help="Seconds to wait for one answer (--api openai-*).")
@click.option("--out", type=click.Path(resolve_path=True, dir_okay=False), default=None,
              help="Where to write the JSON report. Default: <workdir>/verify/report.json.")
def verify_command(workdir, api, url, reference_url, model, prompts, prompts_file, num_draft_tokens, max_tokens,
                   seeds, positions, temperature, alpha, concurrency, tokenizer, chat, timeout, out):
    """Check that speculation changes nothing: greedy outputs identical with K and without (or against a
    reference server without speculation), and the sampled distribution of the first positions unchanged.
    Exits 1 on any drift, saying where a text diverges.

    \b
    Example:
      specbuild verify                               # the server of ./specbuild-work
      specbuild verify --url http://gpu-box:8000 --tokenizer ./llama-3.1-8b -k 4 --seeds 400
      specbuild verify --prompt "def fib(n):" --seeds 0
      specbuild verify --reference-url http://127.0.0.1:8010 --seeds 0   # llmapi: off is another server
      specbuild verify --api openai-completions --url http://127.0.0.1:8081 \\
          --reference-url http://127.0.0.1:8080 --tokenizer ./target --concurrency 1   # trtllm-serve, vLLM, ...
    """
    from specbuild.core import wire
    from specbuild.pipeline.loadtest import resolve_tokenizer
    from specbuild.pipeline.verify import (DEFAULT_PROMPTS, OPENAI_NEEDS_REFERENCE, kserve_generate_fn, load_prompts,
                                           openai_generate_fn, verify)

    workdir = Path(workdir)
    if wire.is_openai(api):
        if not reference_url:
            raise UsageError(OPENAI_NEEDS_REFERENCE.format(api=api))
        if num_draft_tokens is not None:
            raise UsageError(f"--num-draft-tokens: an OpenAI-compatible server's K is fixed when it starts "
                             f"(llama-server --spec-draft-n-max, trtllm-serve's speculative_config); with --api {api} "
                             "verify compares the server as deployed against --reference-url.")
        if not url:
            raise UsageError(f"--api {api} needs --url: the speculative server's base URL (e.g. http://127.0.0.1:8081).")
    endpoint = url.rstrip("/") if wire.is_openai(api) else _endpoint(workdir, url)
    tok = _tokenizer(workdir, tokenizer)
    chosen = list(prompts) + (load_prompts(Path(prompts_file)) if prompts_file else [])
    template = tok.chat if chat else (lambda p: p)
    if wire.is_openai(api):
        k = None
        generate = openai_generate_fn(api, endpoint, reference_url.rstrip("/"), model, template, timeout)
    else:
        k = None if reference_url else (num_draft_tokens or 4)
        generate = kserve_generate_fn(workdir, endpoint, reference_url, model or contract.SPECULATIVE_MODEL,
                                      resolve_tokenizer(tokenizer, workdir), template)

    report = verify(generate, tok.ids, prompts=chosen or list(DEFAULT_PROMPTS), num_draft_tokens=k,
                    max_tokens=max_tokens, sampling_seeds=seeds, positions=positions, temperature=temperature,
                    alpha=alpha, concurrency=concurrency, out=Path(out) if out else workdir / "verify" / "report.json",
                    progress=_progress_bars(seeds), api=api, url=endpoint, reference_url=reference_url)
    _print_report(report)
    if not report.ok:
        what = ("the speculative server's output differs from the reference's" if report.reference_url
                else "speculation changed the output")
        raise click.ClickException(f"{what}; see the report above ({out or workdir / 'verify' / 'report.json'}).")
    click.echo("verify: OK — speculation is lossless on these prompts.")


def _progress_bars(seeds: int):
    """progress(phase, done, total): one bar per phase on stderr (verify sends hundreds of requests)."""
    bars = {}

    def progress(phase, done, total):
        from tqdm import tqdm

        if phase not in bars:
            label = {"greedy": "greedy K vs 0", "sampling": f"sampling {seeds} seeds x 2"}.get(phase, phase)
            bars[phase] = tqdm(total=total, desc=label, unit="req", leave=True, file=sys.stderr,
                               disable=None, dynamic_ncols=True)
        bar = bars[phase]
        bar.update(done - bar.n)
        if done == total:
            bar.close()
    return progress


def _print_report(report) -> None:
    if report.reference_url:
        click.echo(f"speculative {report.url} vs reference {report.reference_url} ({report.api})")
    spec, plain = ("speculative", "reference") if report.num_draft_tokens is None else \
        (f"with K={report.num_draft_tokens}", "without")
    width = max(len(spec), len(plain))
    for case in report.greedy:
        mark = "identical" if case.identical else f"DIVERGES at token {case.first_divergence}"
        click.echo(f"greedy  {report.sides}  {mark:<24} {case.tokens_plain:>4} tok  {case.prompt[:50]!r}")
        if not case.identical:
            click.echo(f"        at character {case.first_divergence_char}, after ...{case.common_tail!r}")
            click.echo(f"        {spec:<{width}}: {case.spec_continuation!r}")
            click.echo(f"        {plain:<{width}}: {case.plain_continuation!r}")
    if report.sampling:
        s = report.sampling
        worst = min(s.positions, key=lambda t: t.p_value)
        verdict = "DRIFT" if s.drift else "no drift"
        click.echo(f"sampling T={s.temperature} {s.seeds} seeds x 2, {len(s.positions)} positions: {verdict} "
                   f"(min p = {worst.p_value:.3g} at position {worst.position}; threshold {s.threshold:.2g} = "
                   f"alpha {s.alpha:g} / {len(s.positions)})")
