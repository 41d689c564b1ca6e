"""Entry point of the `specbuild` console script.

Each command lives in its own module (`specbuild.cli.<name>`) and is registered in COMMANDS only once
it works. Library errors (`SpecbuildError`) become a one-line message on stderr and a non-zero exit.
"""

from __future__ import annotations

import importlib
import logging
import sys

import click

from specbuild import __version__
from specbuild.pipeline.config import default_map, find_config, load_config
from specbuild.core.errors import SpecbuildError

# command name -> module in specbuild.cli exposing a click.Command named `command`
COMMANDS: dict[str, str] = {
    "check": "convert",
    "convert": "convert",
    "build": "build",
    "deploy": "deploy",
    "serve": "serve",
    "stop": "serve",
    "status": "serve",
    "infer": "infer",
    "loadtest": "loadtest",
    "verify": "verify",
    "tune": "tune",
}


class SpecbuildGroup(click.Group):
    """Loads commands lazily (fast `--help`) and maps library errors to clean exits."""

    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        module = COMMANDS.get(name)
        if module is None:
            return None
        mod = importlib.import_module(f"specbuild.cli.{module}")
        return getattr(mod, f"{name}_command")

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except SpecbuildError as e:
            click.echo(f"Error: {e}", err=True)
            ctx.exit(e.exit_code)


@click.group(cls=SpecbuildGroup, context_settings={"help_option_names": ["-h", "--help"],
                                                   "auto_envvar_prefix": "SPECBUILD",
                                                   "max_content_width": 100})
@click.version_option(__version__, prog_name="specbuild")
@click.option("--config", "config_path", type=click.Path(resolve_path=True, dir_okay=False), envvar="SPECBUILD_CONFIG",
              help="TOML file with defaults per command (default: ./specbuild.toml if present).")
@click.option("-v", "--verbose", count=True, help="More logging (-vv for debug).")
@click.pass_context
def cli(ctx: click.Context, config_path: str | None, verbose: int) -> None:
    """specbuild: turn a target LLM and a same-tokenizer draft into a speculative-decoding
    deployment on Triton, prove it lossless, and measure what speculation buys.

    \b
    Precedence of settings: defaults -> specbuild.toml -> SPECBUILD_* environment -> flags.

    \b
    Example (the whole pipeline on the offline demo models):
      specbuild convert --target demo:smollm2-135m-instruct --draft demo:smollm2-135m-instruct
      specbuild build --draft-quantize int4      # the demo draft: the target's own GGUF blocks, 4-bit
      specbuild deploy && specbuild serve --background
      specbuild verify && specbuild loadtest --profile chat --profile batch
      specbuild stop
    """
    logging.basicConfig(level=logging.WARNING - 10 * min(verbose, 2),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(find_config(config_path))
        ctx.default_map = default_map(cfg, list(COMMANDS))
    except SpecbuildError as e:
        raise click.UsageError(str(e)) from e


def main(argv: list[str] | None = None) -> None:
    cli.main(args=argv, prog_name="specbuild")


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
