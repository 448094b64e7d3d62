"""``dayzero launch-local``: run one dayzero command as N local processes of a multi-host run.

Each process is started as ``python -m dayzero.engine.cli <command> --coordinator localhost:PORT
--num-processes N --process-id I`` with ``XLA_FLAGS=--xla_force_host_platform_device_count=D``
(and ``JAX_PLATFORMS=cpu`` unless set), so N x D CPU devices form one mesh through JAX's
multi-controller runtime with gloo collectives -- the same program a real multi-host run runs,
on one machine, for testing.

Output: process 0's stdout passes through untouched (the results; the others print none), every
process's stderr is prefixed ``[I] ``. Exit: 0 when every process exits 0; otherwise the first
failure's code (128 + signal number for a process killed by a signal). When one process fails,
the others -- which would otherwise wait on it in a collective until their runtime's heartbeat
timeout -- are stopped (SIGTERM, then SIGKILL after ``GRACE_S``) and the launcher says which
process failed.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO

GRACE_S = 5.0  # how long a stopped process gets to exit after SIGTERM before SIGKILL
POLL_S = 0.05
_DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")
_PROCESS_FLAGS = ("--coordinator", "--num-processes", "--process-id")


class LaunchError(ValueError):
    """A launch-local request that cannot be run."""


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now (for the coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def child_env(devices_per_process: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one process: ``devices_per_process`` CPU devices, CPU platform by default."""
    env = dict(os.environ if base is None else base)
    flags = _DEVICE_FLAG.sub("", env.get("XLA_FLAGS", "")).split()
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices_per_process}"])
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def check_command(command: list[str], known: tuple[str, ...]) -> None:
    """Raise LaunchError unless ``command`` is a dayzero sub-command without process flags."""
    if not command:
        raise LaunchError("launch-local needs a dayzero command after '--', e.g. -- generate --prompt-ids 1,2,3")
    if command[0] not in known:
        raise LaunchError(f"{command[0]!r} is not a dayzero command to launch; use one of {', '.join(known)}")
    given = [a for a in command if a.split("=")[0] in _PROCESS_FLAGS]
    if given:
        raise LaunchError(f"launch-local sets {given[0].split('=')[0]} itself; remove it from the command")


def _pump(source: IO[bytes], sink: IO[bytes], prefix: bytes | None) -> None:
    """Copy a child's output to ``sink``: raw chunks (streamed text stays live) or prefixed lines."""
    if prefix is None:
        while chunk := source.read1(4096):
            sink.write(chunk)
            sink.flush()
    else:
        for line in iter(source.readline, b""):
            sink.write(prefix + line)
            sink.flush()
    source.close()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every running process, then SIGKILL those still running after GRACE_S."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _watch(procs: list[subprocess.Popen]) -> int:
    """Wait for every process; on the first failure stop the rest and return its exit code."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i, code = failed[0]
            others = [p for p in procs if p.poll() is None]
            _stop(procs)
            stopped = f"; stopped the other {len(others)} process(es)" if others else ""
            print(f"dayzero: error: launch-local: process {i} {_describe(code)}{stopped}", file=sys.stderr, flush=True)
            return _exit_code(code)
        if all(c == 0 for c in codes):
            return 0
        time.sleep(POLL_S)


def launch_local(command: list[str], processes: int, devices_per_process: int, known: tuple[str, ...]) -> int:
    """Run ``dayzero <command>`` as ``processes`` local processes of ``devices_per_process`` devices each.

    Returns the exit status described in the module docstring.
    """
    if command and command[0] == "--":
        command = command[1:]
    if command and command[0] == "dayzero":  # "-- dayzero serve ..." reads naturally; the same command
        command = command[1:]
    check_command(command, known)
    if processes < 1 or devices_per_process < 1:
        raise LaunchError(f"--processes {processes} and --devices-per-process {devices_per_process} must be >= 1")
    coordinator = f"localhost:{free_port()}"
    env = child_env(devices_per_process)
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    try:
        for i in range(processes):
            argv = [sys.executable, "-m", "dayzero.engine.cli", *command, "--coordinator", coordinator,
                    "--num-processes", str(processes), "--process-id", str(i)]
            p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            procs.append(p)
            print(f"[launch-local] process {i} pid {p.pid}", file=sys.stderr, flush=True)
            tag = f"[{i}] ".encode()
            # Only process 0's stdout is the command's output; anything another prints goes to stderr.
            stdout = (p.stdout, sys.stdout.buffer, None) if i == 0 else (p.stdout, sys.stderr.buffer, tag)
            outputs = (stdout, (p.stderr, sys.stderr.buffer, tag))
            for source, sink, prefix in outputs:
                pumps.append(threading.Thread(target=_pump, args=(source, sink, prefix), daemon=True))
                pumps[-1].start()
        code = _watch(procs)
    except KeyboardInterrupt:
        _stop(procs)
        raise
    for t in pumps:
        t.join(timeout=GRACE_S)
    return code
