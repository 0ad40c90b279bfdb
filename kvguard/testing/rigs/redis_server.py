"""A private ``redis-server`` for tests: own port, own temp dir, no persistence.

Never the machine's shared 127.0.0.1:6379.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile

from kvguard.testing.rigs.net import DIE_WITH_PARENT, free_port, port_open, stop_process, wait_for_port


class RedisServer:
    """``start()``/``stop()`` may be repeated on the same port (data is lost on stop: no persistence)."""

    def __init__(self, port: int | None = None, *, binary: str | None = None, password: str | None = None):
        self.port = port or free_port()
        self.binary = binary or os.environ.get("REDIS_SERVER_BIN") or shutil.which("redis-server") or "redis-server"
        self.password = password
        self.dir = tempfile.mkdtemp(prefix="kvguard-redis-")
        self.log_path = os.path.join(self.dir, "redis.log")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        if self.running:
            return self
        if port_open(self.port):
            raise RuntimeError(f"port {self.port} is already taken; cannot start redis-server there")
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", self.dir, "--logfile", self.log_path,
                "--daemonize", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=DIE_WITH_PARENT)
        atexit.register(stop_process, self.process)  # no orphan when the run is interrupted
        wait_for_port(self.port, timeout_s=timeout_s, process=self.process, what="redis-server",
                      log_path=self.log_path)
        return self

    def stop(self) -> None:
        stop_process(self.process)
        self.process = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()
