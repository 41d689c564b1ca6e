"""`specbuild verify`: prove a running deployment is lossless (thin wrapper over `specbuild.pipeline.verify`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from specbuild.core import contract
from specbuild.cli.options import workdir_option
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
@click.option("--url", default=None,
              help="HTTP endpoint. Default: the server started by `specbuild serve` in --workdir.")
@click.option("--reference-url", default=None,
              help="HTTP endpoint of the same target served without speculation: the K = 0 side goes there and no "
                   "request carries num_draft_tokens (for deployments whose speculation is fixed when deployed: "
                   "TensorRT-LLM's llmapi path). Default: K = 0 on --url.")
@click.option("--model", default=contract.SPECULATIVE_MODEL, show_default=True,
              help="Client-facing model that takes num_draft_tokens.")
@click.option("--prompt", "prompts", multiple=True, help="A prompt to check (repeatable). Default: a built-in set.")
@click.option("--prompts", "prompts_file", type=click.Path(resolve_path=True, dir_okay=False), default=None,
              help="File of prompts: JSON list, JSONL with a 'prompt' field, or one per line.")
@click.option("--num-draft-tokens", "-k", type=click.IntRange(min=1), default=4, show_default=True,
              help="K for the speculative side; compared against K = 0.")
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
              help="Send each prompt as a user turn in the target's chat template (instruct models), or raw.")
@click.option("--out", type=click.Path(resolve_path=True, dir_okay=False), default=None,
              help="Where to write the JSON report. Default: <workdir>/verify/report.json.")
def verify_command(workdir, url, reference_url, model, prompts, prompts_file, num_draft_tokens, max_tokens, seeds,
                   positions, temperature, alpha, concurrency, tokenizer, chat, out):
    """Check that speculation changes nothing: greedy outputs token-identical with K and without, and the
    sampled distribution of the first positions unchanged. Exits 1 on any drift.

    \b
    Example:
      specbuild verify                               # the server of ./specbuild-work
      specbuild verify --url http://gpu-box:8000 --tokenizer ./llama-3.1-8b -k 4 --seeds 400
      specbuild verify --prompt "def fib(n):" --seeds 0
      specbuild verify --reference-url http://127.0.0.1:8010 --seeds 0   # llmapi: off is another server
    """
    from specbuild.pipeline.verify import DEFAULT_PROMPTS, load_prompts, verify

    workdir = Path(workdir)
    endpoint = _endpoint(workdir, url)
    tok = _tokenizer(workdir, tokenizer)
    chosen = list(prompts) + (load_prompts(Path(prompts_file)) if prompts_file else [])
    from specbuild.pipeline.client import client_for
    from specbuild.pipeline.loadtest import resolve_tokenizer

    generate = _generate_fn(workdir, endpoint, reference_url, model, resolve_tokenizer(tokenizer, workdir),
                            tok.chat if chat else (lambda p: p))

    report = verify(generate, tok.ids, prompts=chosen or list(DEFAULT_PROMPTS), num_draft_tokens=num_draft_tokens,
                    max_tokens=max_tokens, sampling_seeds=seeds, positions=positions, temperature=temperature,
                    alpha=alpha, concurrency=concurrency, out=Path(out) if out else workdir / "verify" / "report.json",
                    progress=_progress_bars(seeds))
    _print_report(report, num_draft_tokens)
    if not report.ok:
        raise click.ClickException("speculation changed the output; see the report above "
                                   f"({out or workdir / 'verify' / 'report.json'}).")
    click.echo("verify: OK — speculation is lossless on these prompts.")


def _generate_fn(workdir: Path, endpoint: str, reference_url: str | None, model: str, tokenizer_dir, template):
    """generate(prompt, num_draft_tokens=K, ...) -> text: K > 0 on `endpoint`, K = 0 there too, or on
    `reference_url` (then num_draft_tokens is never sent: both servers run their deployed policy; the reference
    is taken to be the same kind of deployment, with the same client model)."""
    from specbuild.pipeline.client import Client, client_for

    client = client_for(workdir, endpoint, model=model, tokenizer_dir=tokenizer_dir)
    if reference_url is None and client.target == contract.LLMAPI_TARGET:
        raise UsageError("this deployment is TensorRT-LLM's llmapi path: its speculation is fixed by model.yaml's "
                         "speculative_config, so K = 0 cannot be asked per request. Serve the target a second time "
                         "without speculative_config and pass it as --reference-url.")
    reference = None if reference_url is None else \
        Client(url=reference_url, model=client.model, target=client.target, echo=client.echo)

    def generate(prompt, *, num_draft_tokens, max_tokens, temperature, top_k, top_p, seed):
        params = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k or None,
                      top_p=top_p if top_p < 1 else None, seed=seed)
        if reference is None:
            return client.generate(template(prompt), num_draft_tokens=num_draft_tokens, **params).text
        return (client if num_draft_tokens else reference).generate(template(prompt), **params).text

    return generate


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


def _print_report(report, num_draft_tokens: int) -> None:
    for case in report.greedy:
        mark = "identical" if case.identical else f"DIVERGES at token {case.first_divergence}"
        click.echo(f"greedy  K={num_draft_tokens} vs 0  {mark:<24} {case.tokens_plain:>4} tok  {case.prompt[:50]!r}")
        if not case.identical:
            click.echo(f"        {case.context}")
    if report.sampling:
        s = report.sampling
        worst = min(s.positions, key=lambda t: t.p_value)
        verdict = "DRIFT" if s.drift else "no drift"
        click.echo(f"sampling T={s.temperature} {s.seeds} seeds x 2, {len(s.positions)} positions: {verdict} "
                   f"(min p = {worst.p_value:.3g} at position {worst.position}; threshold {s.threshold:.2g} = "
                   f"alpha {s.alpha:g} / {len(s.positions)})")
