"""One rule for where clients (infer, verify, loadtest, tune) reach a deployment."""

import json

from specbuild.pipeline.serve import endpoints


def test_explicit_url_wins_and_its_host_carries_grpc_and_metrics(tmp_path):
    e = endpoints(tmp_path, "http://10.0.0.5:9000/")
    assert (e.http, e.grpc, e.metrics, e.recorded) == ("http://10.0.0.5:9000", "10.0.0.5:8001",
                                                       "http://10.0.0.5:8002/metrics", False)
    assert endpoints(tmp_path, "http://h:1", "h:2", "").metrics == ""      # "" = do not scrape


def test_recorded_server_then_local_defaults(tmp_path):
    assert endpoints(tmp_path).http == "http://127.0.0.1:8000" and not endpoints(tmp_path).recorded
    (tmp_path / "server").mkdir()
    (tmp_path / "server" / "server.json").write_text(json.dumps(
        {"pid": 1, "host": "127.0.0.1", "http_port": 18000, "grpc_port": 18001, "metrics_port": 18002,
         "repository": "r", "log_file": "l"}))
    e = endpoints(tmp_path)
    assert (e.http, e.grpc, e.metrics, e.recorded) == ("http://127.0.0.1:18000", "127.0.0.1:18001",
                                                       "http://127.0.0.1:18002/metrics", True)
    assert endpoints(tmp_path, "http://other:8000").recorded is False       # never mixes another host's ports
