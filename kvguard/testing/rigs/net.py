"""Loopback helpers shared by the rigs."""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import time


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG: the server gets SIGTERM when the process (thread) that started it dies,
    # so a killed test run leaves no broker or redis-server behind
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


# the preexec_fn for rig servers (Linux only; elsewhere atexit is the only cleanup)
DIE_WITH_PARENT = _die_with_parent if sys.platform.startswith("linux") else None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_for_port(port: int, *, timeout_s: float, process: subprocess.Popen | None = None,
                  what: str = "server", log_path: str | None = None) -> None:
    """Wait until ``port`` accepts connections; fail early, with the log, if ``process`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode} before listening on "
                               f"port {port}{_log_tail(log_path)}")
        if port_open(port):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s} s{_log_tail(log_path)}")


def stop_process(process: subprocess.Popen | None, timeout_s: float = 5.0) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout_s)


def _log_tail(log_path: str | None, lines: int = 20) -> str:
    if not log_path:
        return ""
    try:
        with open(log_path, errors="replace") as fh:
            tail = fh.readlines()[-lines:]
    except OSError:
        return ""
    return "\n--- log tail (" + log_path + ") ---\n" + "".join(tail)
