"""A real S3-compatible server for tests: moto's server mode in a child process, on a free loopback port.

Not a mock of boto3: the code under test speaks HTTP to it exactly as it
would to AWS or MinIO. Each use gets its own bucket.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def s3_server(log_dir: Path) -> Iterator[dict[str, str]]:
    """Yield the ``CROWDTRAIN_S3_*`` variables of a fresh bucket on a running server; stop it afterwards."""
    import boto3

    port = _free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    with (log_dir / "moto.log").open("wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's S3 server did not start; see {log_dir / 'moto.log'}") from None
                time.sleep(0.1)
        env = {
            "CROWDTRAIN_S3_ENDPOINT_URL": endpoint, "CROWDTRAIN_S3_ACCESS_KEY_ID": "testing",
            "CROWDTRAIN_S3_SECRET_ACCESS_KEY": "testing", "CROWDTRAIN_S3_REGION": "us-east-1",
            "CROWDTRAIN_S3_BUCKET": f"crowdtrain-{uuid.uuid4().hex[:8]}",
        }  # fmt: skip
        boto3.client(
            "s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
            region_name="us-east-1",
        ).create_bucket(Bucket=env["CROWDTRAIN_S3_BUCKET"])  # fmt: skip
        yield env
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":  # a quick manual check: python -m tests.s3server
    with s3_server(Path(os.environ.get("TMPDIR", "/tmp")) / "s3server") as variables:
        print(variables)
