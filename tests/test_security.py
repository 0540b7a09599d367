"""Security defaults of the shipped server configs, and token authorization on a real TorchServe."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT
from test_server import SAMPLES, build_archive
from scripts.tsctl import Server, get, post, read_properties

DEV = read_properties(ROOT / "config.properties")
PROD = read_properties(ROOT / "config.production.properties")


def test_development_config_binds_loopback_only():
    for key in ("inference_address", "management_address", "metrics_address"):
        assert DEV[key].startswith("http://127.0.0.1:"), key
    assert DEV["disable_token_authorization"] == "true"  # safe only because of the loopback binds
    # On for scripts/rollout.py: safe only because management is loopback and allowed_urls is ^$.
    assert DEV["enable_model_api"] == "true"


def test_production_config_turns_token_auth_on_and_keeps_management_local():
    assert PROD["disable_token_authorization"] == "false"
    assert PROD["management_address"].startswith("http://127.0.0.1:")
    assert PROD["metrics_address"].startswith("http://127.0.0.1:")


@pytest.mark.parametrize("props", [DEV, PROD], ids=["dev", "production"])
def test_no_model_url_is_allowed(props):
    # TorchServe matches URL-shaped model urls against these regexes; '^$' matches none, so only
    # bare archive names from model_store load.
    assert props["allowed_urls"] == "^$"


def test_handler_never_logs_headers():
    source = (ROOT / "dlrm_handler.py").read_text()
    assert "get_all_request_header" not in source
    assert "logger" in source and "headers" not in source.replace("Never log headers", "")


@pytest.mark.integration
def test_token_authorization_on_a_real_server(tmp_path):
    store = build_archive(tmp_path)
    srv = Server.on_free_ports(tmp_path / "home", properties=ROOT / "config.production.properties", model_store=store)
    try:
        srv.start()
        sample = (SAMPLES / "seed_single.json").read_bytes()
        srv.wait_ready("dlrm", sample, timeout=180)  # reads the inference key from key_file.json
        key_file = srv.home / "key_file.json"
        assert oct(key_file.stat().st_mode & 0o777) == "0o600"
        url = f"{srv.url}/predictions/dlrm"
        status, body, _ = post(url, sample)
        assert status == 400 and b"Token Authorization failed" in body  # TorchServe answers 400, not 401
        status, body, _ = post(url, sample, headers={"Authorization": "Bearer wrong"})
        assert status == 400
        status, body, _ = post(url, sample, headers=srv.auth("inference"))
        assert status == 200 and 0 < json.loads(body)["score"] < 1
        # the management API wants the management key, not the inference key
        status, _, _ = get(f"{srv.management_url}/models/dlrm", headers=srv.auth("inference"))
        assert status == 400
        status, _, _ = get(f"{srv.management_url}/models/dlrm", headers=srv.auth("management"))
        assert status == 200
        log = (srv.log_dir / "model_log.log").read_text() + (srv.log_dir / "ts_log.log").read_text()
        assert srv.token("inference") not in log  # the token never reaches the logs
    finally:
        srv.stop()
