"""httpx with one TLS context per process: the clients of every layer (the load generators, the soak, `infer`,
`verify`, the server's readiness probe) call these instead of `httpx.post` / `httpx.get` / `httpx.stream` /
`httpx.Client`.

    from specbuild.core import http
    r = http.post(f"{url}/v2/models/ensemble/generate", json=body, timeout=30)
    with http.stream("POST", url, json=body, timeout=30) as r: ...
    with http.Client(timeout=30) as c: ...

Why: httpx builds a new `ssl.SSLContext` (loading certifi's CA bundle) for every top-level call and every
Client it is not handed one, even for a plain-http URL: 18 ms of CPU each, holding the GIL, on an Intel Xeon
2-vCPU VM (0.2 ms with a context built once). A load generator that pays that per request measures its own
CPU: the soak's flood of 500 refused requests from 16 threads took 28 s and a core of the 2-core machine,
and its good clients paid 18 ms per request of their own latency. Verification stays on (the same default
context httpx would build); a caller may still pass its own `verify=`.
"""

from __future__ import annotations

import functools
import ssl


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The process's one default TLS context (certifi's CA bundle, as httpx builds it)."""
    import httpx

    return httpx.create_ssl_context()


def _kw(kw: dict) -> dict:
    kw.setdefault("verify", tls_context())
    return kw


def post(url: str, **kw):
    import httpx

    return httpx.post(url, **_kw(kw))


def get(url: str, **kw):
    import httpx

    return httpx.get(url, **_kw(kw))


def stream(method: str, url: str, **kw):
    import httpx

    return httpx.stream(method, url, **_kw(kw))


def Client(**kw):  # noqa: N802 - stands in for httpx.Client
    import httpx

    return httpx.Client(**_kw(kw))
