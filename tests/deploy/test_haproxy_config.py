"""deploy/haproxy.cfg is the template rendered for compose, and HAProxy accepts both renderings."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from crowdtrain_launcher import engines
from crowdtrain_launcher.cluster import (
    COMPOSE_HAPROXY,
    compose_haproxy_config,
    render_haproxy_config,
    self_signed_certificate,
)


def haproxy_check(config: str, folder: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    path = folder / "haproxy.cfg"
    path.write_text(config)
    return subprocess.run([engines.find_haproxy(), "-c", "-f", str(path)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=30)  # fmt: skip


def test_the_compose_config_is_the_template_rendered() -> None:
    assert COMPOSE_HAPROXY.read_text() == compose_haproxy_config(), (
        "deploy/haproxy.cfg is out of date: "
        "python -m crowdtrain_launcher.cluster --print-compose-haproxy > deploy/haproxy.cfg"
    )


def test_haproxy_accepts_the_compose_config(tmp_path: Path) -> None:
    _, pem = self_signed_certificate(tmp_path / "certs")
    (tmp_path / "certs" / "cert.pem").unlink()  # the folder is HAProxy's: certificate-and-key PEMs only
    (tmp_path / "certs" / "key.pem").unlink()

    result = haproxy_check(compose_haproxy_config(f"{pem.parent}/"), tmp_path,
                           env={"CROWDTRAIN_PUBLIC_HOST": "crowdtrain.example.org"})  # fmt: skip

    assert result.returncode == 0, result.stderr


def test_haproxy_accepts_a_one_machine_config(tmp_path: Path) -> None:
    _, pem = self_signed_certificate(tmp_path / "tls")
    servers = ["server site-1 127.0.0.1:8001", "server site-2 127.0.0.1:8002"]
    config = render_haproxy_config(binds=[f"127.0.0.1:8443 ssl crt {pem}"], servers=servers, health_host="127.0.0.1")

    result = haproxy_check(config, tmp_path)

    assert result.returncode == 0, result.stderr
