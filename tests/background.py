"""Heavy CPU jobs of the suite, started in the background as soon as collection ends.

Three fixtures spend minutes of CPU in subprocesses: the Triton interpreter's kernel cases
(test_triton_kernels.py), the model on the kernels under the interpreter (test_model_triton.py) and the
AOT compile for three GPUs (test_triton_compile.py). Run when their tests were reached, the rest of the suite
waited on them, and between them that suite (mostly one busy core at a time: subprocess trainings, small torch
ops) left CI's second core idle for minutes. A module names such fixtures in `BACKGROUND_JOBS` (fixture name ->
a function returning the job's commands); conftest.py runs the tests using them last and, once collection and
deselection are done, starts the commands of those that will run (at a lower CPU priority, so the tests in the
foreground keep their speed). The fixture then calls `results(...)` with the same function, which starts the
commands if nothing has (conftest.py not loaded) and waits. Each command leads a process group of its own, so
stopping it stops its children too (triton_aot.py's compile workers).
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

BACKGROUND_NICENESS = 10  # the jobs yield the CPU to the foreground tests (Linux/macOS `nice`; none on Windows)


@dataclass
class Command:
    argv: list[str]
    env: dict[str, str] | None = None
    cwd: str | None = None


@dataclass
class Finished:
    returncode: int | None  # None: still running at the timeout (then killed)
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False


@dataclass
class _Job:
    procs: list[subprocess.Popen] = field(default_factory=list)
    # each command's output goes to unnamed temporary files, not pipes: nothing reads a job until its test is
    # reached, and a child writing more than a pipe holds (64 KiB: the AOT table) would stop there until then
    outputs: list[tuple] = field(default_factory=list)
    finished: list[Finished] | None = None  # kept: a second reader (a re-run fixture) gets the same outcome


_JOBS: dict[str, _Job] = {}


def _key(commands_function: Callable[[], list[Command]]) -> str:
    return f"{commands_function.__module__}.{commands_function.__qualname__}"


def _in_background():  # runs in the child before exec
    # a process group of its own (killed whole by _kill), in pytest's session: Linux's autogroup scheduler shares
    # the CPU between sessions before nice applies, so a session of its own would take a full share whatever its nice
    os.setpgrp()
    try:
        os.nice(BACKGROUND_NICENESS)
    except OSError:  # not permitted here: run at the normal priority
        pass


def start(commands_function: Callable[[], list[Command]]) -> None:
    """Start the function's commands unless they are running or done (idempotent)."""
    key = _key(commands_function)
    if key in _JOBS:
        return
    lower = _in_background if hasattr(os, "setpgrp") else None
    job = _Job()
    for c in commands_function():
        stdout, stderr = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        job.outputs.append((stdout, stderr))
        job.procs.append(subprocess.Popen(c.argv, env=c.env, cwd=c.cwd, stdout=stdout, stderr=stderr, text=True,
                                          preexec_fn=lower))  # fmt: skip
    _JOBS[key] = job


def results(commands_function: Callable[[], list[Command]], timeout: float) -> list[Finished]:
    """Each command's outcome, in order, waiting at most `timeout` seconds in all from now; a command still
    running then is killed and reported with timed_out=True."""
    start(commands_function)
    job = _JOBS[_key(commands_function)]
    if job.finished is not None:
        return job.finished
    deadline = time.monotonic() + timeout
    out = []
    for proc, (stdout, stderr) in zip(job.procs, job.outputs):
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill(proc)
            timed_out = True
        texts = []
        for f in (stdout, stderr):
            f.seek(0)
            texts.append(f.read())
            f.close()
        out.append(Finished(None if timed_out else proc.returncode, *texts, timed_out=timed_out))
    job.finished = out
    return out


def _kill(proc: subprocess.Popen) -> None:
    """Kill the command and every process it started (the process group it leads)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, AttributeError):  # gone already, or no process groups (Windows)
        proc.kill()
    proc.wait()


def stop_all() -> None:
    """Kill every job still running (the session ended before its tests read it: -x, Ctrl-C). A job's command in
    a process group of its own does not get the terminal's Ctrl-C: this is what stops it."""
    for job in _JOBS.values():
        for proc in job.procs:
            if proc.poll() is None:
                _kill(proc)
