"""A real S3-compatible server (moto) on loopback, for tests of ``s3://`` paths.

``s3_bucket`` is a pytest fixture (``tests/conftest.py`` makes it every test module's):
each module that uses it gets one server and one bucket.
"""

from __future__ import annotations

import logging
import socket

import pytest

from .helpers import point_aws_at_loopback

BUCKET = "ink-runs"


def _free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def s3_bucket():
    """A moto S3 server on 127.0.0.1 with one bucket; dummy credentials, endpoint via env."""
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = _free_loopback_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        with pytest.MonkeyPatch.context() as env:
            point_aws_at_loopback(env, port)
            s3fs.S3FileSystem.clear_instance_cache()
            # moto keeps its buckets in the process: an earlier module's server made it already.
            s3fs.S3FileSystem().makedirs(BUCKET, exist_ok=True)
            yield f"s3://{BUCKET}"
            s3fs.S3FileSystem.clear_instance_cache()
    finally:
        server.stop()
