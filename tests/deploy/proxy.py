"""Replicas behind a real proxy, for the affinity tests: `python -m server` processes and
Debian's nginx routing between them by `hash $http_x_image_id consistent`, as ingress-nginx
does with `upstream-hash-by` (k8s/overlays/ingress-nginx).

nginx runs as a child process in the foreground with its own prefix, config and logs in a
temporary folder, on a free port: no daemon, no system path, no root needed. Its access log
names, per request, the X-Image-Id it hashed and the replica it chose.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port, spawn_server, stop_server, wait_until_ready

# Tiny models on the CPU, one frontend each.
REPLICA_ENV = {
    "SERVE_DEVICE": "cpu",
    "SERVE_SAM_MODEL": "vit_tiny",
    "SERVE_SWIN_MODEL": "swin_test",
    "SERVE_MAX_BATCH_SIZE": "4",
    "SERVE_BATCH_BUCKETS": "[1,2,4]",
    "SERVE_DECODER_MAX_BATCH_PROMPTS": "8",
    "SERVE_HTTP_WORKERS": "1",
    "SERVE_LOG_LEVEL": "WARNING",
    # one torch thread per engine: three engines' OpenMP pools spinning on two cores
    # would make each click wait for the others' spinning
    "OMP_NUM_THREADS": "1",
}
# The key nginx hashes: what k8s/overlays/ingress-nginx gives `upstream-hash-by` (a test
# there holds the two together).
HASH_BY = "$http_x_image_id"
# method uri status x-image-id upstream request_time (s): one line per request
LOG_FORMAT = "$request_method $uri $status $http_x_image_id $upstream_addr $request_time"


class Replica:
    """One `python -m server` (a pod, as far as the proxy knows)."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        self.log_path = folder / f"replica-{self.port}.log"
        self.log = self.log_path.open("w")
        self.proc = spawn_server({**os.environ, **REPLICA_ENV}, self.port, self.log)

    def wait_ready(self) -> Replica:
        wait_until_ready(self.proc, self.url, self.log_path, 240)
        return self

    def stop(self) -> int:
        """SIGTERM, as Kubernetes stops a pod: the replica drains and exits 0 (`stop_server`)."""
        try:
            code = self.proc.poll()
            return code if code is not None else stop_server(self.proc, self.log_path, 90)
        finally:
            self.log.close()


def nginx_binary() -> str:
    found = shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).is_file()), None
    )
    if found is None:
        pytest.fail("nginx is missing: apt-get install -y nginx-light")
    return found


class Nginx:
    """nginx in front of `upstreams` (host:port), hashing X-Image-Id consistently."""

    def __init__(self, folder: Path, upstreams: list[str]) -> None:
        self.prefix = folder / "nginx"
        self.prefix.mkdir()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.conf = self.prefix / "nginx.conf"
        self.access_log = self.prefix / "access.log"
        self.error_log = self.prefix / "error.log"
        self.generation = 0  # of the configuration, sent back in X-Config
        self.write_config(upstreams)
        binary = nginx_binary()
        check = [binary, "-t", "-q", "-p", str(self.prefix), "-e", str(self.error_log)]
        tested = subprocess.run([*check, "-c", str(self.conf)], capture_output=True, text=True)
        assert tested.returncode == 0, f"nginx -t: {tested.stderr}"
        command = [binary, "-p", str(self.prefix), "-e", str(self.error_log), "-c", str(self.conf)]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.wait_listening()

    def write_config(self, upstreams: list[str]) -> None:
        self.generation += 1
        p = self.prefix
        servers = "\n".join(f"        server {u} max_fails=0;" for u in upstreams)
        # as root, nginx would hand its workers to `nobody`, who cannot write in this folder
        user = "user root;" if os.geteuid() == 0 else ""
        self.conf.write_text(f"""
{user}
daemon off;
worker_processes 1;
pid {p}/nginx.pid;
error_log {self.error_log} warn;
events {{ worker_connections 1024; }}
http {{
    log_format affinity '{LOG_FORMAT}';
    access_log {self.access_log} affinity;
    client_body_temp_path {p}/client_body;
    proxy_temp_path {p}/proxy;
    fastcgi_temp_path {p}/fastcgi;
    uwsgi_temp_path {p}/uwsgi;
    scgi_temp_path {p}/scgi;
    client_max_body_size 8m;
    upstream sam_swin_serve {{
        # what ingress-nginx writes for upstream-hash-by, consistent hashing (ketama)
        hash {HASH_BY} consistent;
{servers}
        keepalive 32;
    }}
    server {{
        listen 127.0.0.1:{self.port};
        location / {{
            proxy_pass http://sam_swin_serve;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_read_timeout 120s;
            add_header X-Upstream $upstream_addr always;
            add_header X-Config {self.generation} always;
        }}
    }}
}}
""")

    def wait_listening(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.error_log.read_text()
            assert time.monotonic() < deadline, "nginx did not listen"
            try:
                httpx.get(self.url + "/healthz", timeout=1)
                return
            except httpx.TransportError:
                time.sleep(0.05)

    def reload(self, upstreams: list[str]) -> None:
        """New upstreams, as an ingress controller applies changed endpoints: SIGHUP; new
        workers take new requests, the old ones finish theirs. Returns once the old workers
        have exited: until then one may still take a connection and route it by the old
        configuration (what the pods' preStop sleep covers in Kubernetes)."""
        old = self.workers()
        self.write_config(upstreams)
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            answer = httpx.get(self.url + "/healthz", timeout=5)
            if answer.headers.get("x-config") == str(self.generation) and not (
                old & self.workers()
            ):
                return
            time.sleep(0.02)
        raise AssertionError(f"nginx did not reload: {self.error_log.read_text()}")

    def workers(self) -> set[int]:
        """The worker processes' ids: the master's children."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        return {int(pid) for pid in children.split()}

    def log_lines(self) -> list[list[str]]:
        return [line.split() for line in self.access_log.read_text().splitlines() if line]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
