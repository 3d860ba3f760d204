"""deploy/haproxy.cfg is the template rendered for compose, and HAProxy accepts both renderings."""

from __future__ import annotations

import http.server
import os
import subprocess
import threading
import time
from pathlib import Path

from crowdtrain_launcher import engines
from crowdtrain_launcher.cluster import (
    COMPOSE_HAPROXY,
    balancer_server_states,
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


def test_the_launcher_reads_which_site_processes_the_balancer_counts_as_up(tmp_path: Path) -> None:
    """``Cluster.start`` waits on this: one site answering /livez is up, one with nothing listening is down."""
    answering = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Livez)
    threading.Thread(target=answering.serve_forever, daemon=True).start()
    silent_port = engines.free_port()
    _, pem = self_signed_certificate(tmp_path / "tls")
    servers = [f"server live 127.0.0.1:{answering.server_port}", f"server gone 127.0.0.1:{silent_port}"]
    sock = tmp_path / "haproxy.sock"
    config = tmp_path / "haproxy.cfg"
    config.write_text(render_haproxy_config(binds=[f"127.0.0.1:{engines.free_port()} ssl crt {pem}"],
                                            servers=servers, health_host="127.0.0.1", stats_socket=sock))  # fmt: skip
    balancer = subprocess.Popen([engines.find_haproxy(), "-db", "-f", str(config)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        states: dict[str, str] = {}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # `fall 2` at `inter 1s`: the silent one is down within ~2 s
            try:
                states = balancer_server_states(sock)
            except OSError:
                states = {}
            if states.get("gone", "").startswith("DOWN"):
                break
            time.sleep(0.2)
        assert set(states) == {"live", "gone"}
        assert states["live"].startswith("UP") and states["gone"].startswith("DOWN"), states
    finally:
        balancer.terminate()
        balancer.wait(10)
        answering.shutdown()


class Livez(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/livez" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass
