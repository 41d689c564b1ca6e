"""Soak and fault benchmark of the embedded deployment through a real tritonserver (`make soak`, a gate).

The runner: it builds the tiny test models (or takes a deployed --workdir), and hands `specbuild.loadtests.soak`
the server to load, started and stopped with `specbuild.pipeline.serve`. What the soak does, what it measures and
what its gate fails on: `specbuild/loadtests/soak.py` (its docstring) and bench/README.md "Soak"; the hostile
catalogue: `specbuild/loadtests/hostile.py`.

    .venv/bin/python bench/soak.py --duration 120                      # tiny models in a temp workdir
    .venv/bin/python bench/soak.py --workdir specbuild-work --duration 600   # a deployed workspace

Loopback only; every loop is bounded by the deadline and every request by a timeout.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from specbuild.loadtests import soak

ROOT = Path(__file__).resolve().parents[1]


def tiny_workdir(root: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from servers import deploy_tiny  # noqa: E402 - the test suite's tiny models, no download
    from tinymodels import make_checkpoint, make_tokenizer  # noqa: E402

    tok = make_tokenizer(root / "tok")
    target = make_checkpoint(root / "target", tok, layers=4, seed=1)
    draft = make_checkpoint(root / "draft", tok, layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64, seed=2)
    return deploy_tiny(root / "work", target, draft, max_batch_size=8)


def main(argv=None) -> int:
    args = soak.parse_args(argv, default_out=ROOT / "bench" / "results" / "soak.json")
    sys.path.insert(0, str(ROOT / "tests"))
    from servers import serve_options  # noqa: E402 - free ports

    from specbuild.engines.embedded.config import DEFAULT_REQUEST_TIMEOUT_S
    from specbuild.pipeline import serve

    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        workdir = args.workdir
        if workdir is None:
            print("building the tiny models ...", flush=True)
            workdir = tiny_workdir(Path(tmp))
        opts = serve_options()
        server = soak.Server(start=lambda: serve.start(workdir, opts),
                             stop=lambda: serve.stop(workdir, timeout=30),
                             default_request_timeout_s=DEFAULT_REQUEST_TIMEOUT_S)
        return soak.run(args, workdir, server)


if __name__ == "__main__":
    sys.exit(main())
