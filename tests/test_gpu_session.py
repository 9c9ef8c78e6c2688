"""bench/gpu_session.sh run dry on the CPU: every step's commands, as the script builds them, parse their flags.

A session with a GPU is lent by chance and holds 15 minutes of device time; a step that dies on a renamed flag or
a test selection that matches nothing costs one of its two calls. Here the script runs every step with `PY` set to
a recorder that writes each command's arguments and returns at once; each recorded command is then parsed by its
own script (run as __main__ with argparse stopped after a successful parse), and every pytest command is
collected and must select at least one test.
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_session.sh"

RECORDER = """#!/usr/bin/env bash
# records one command's arguments, NUL-separated, in a file of its own; runs nothing
printf '%s\\0' "$@" > "$GPU_SESSION_DRY_LOG/$(date +%s%N)-$$-$RANDOM"
"""


def session_steps() -> list[str]:
    """The step names of the script's case statement (every arm but the catch-all)."""
    body = SCRIPT.read_text().split('case "$step" in', 1)[1].split("\n  esac", 1)[0]
    return re.findall(r"^    ([a-z0-9-]+)\)", body, flags=re.M)


def script_defaults() -> dict[str, str]:
    """Each `NAME=${NAME:-value}` default the script assigns, as bash assigns it where NAME is unset: a quoted
    value without its quotes, its line breaks kept (the steps expand the lists unquoted, so bash splits them on
    any whitespace); an unquoted one up to its closing brace (a comment after it is not the value)."""
    found = re.findall(r'^([A-Z_]+)=\$\{\1:-(?:"([^"]*)"|([^}"]*))\}', SCRIPT.read_text(), flags=re.M)
    return {name: quoted or plain for name, quoted, plain in found}


class _Parsed(Exception):
    """Raised in place of returning from ArgumentParser.parse_args: the flags parsed, nothing else runs."""


def _parse_only(argv: list[str]) -> str | None:
    """Run one recorded command's script up to its argument parsing; None where the flags parsed, else the
    parser's message."""
    if argv[0].endswith(".py") and "argparse" not in (ROOT / argv[0]).read_text():
        return f"flags {argv[1:]} for a script that takes none" if argv[1:] else None  # e.g. profile_nsa.py
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.path.insert(0, str(ROOT))
    import train_accelerate

    original, original_train = argparse.ArgumentParser.parse_args, train_accelerate.parse_args

    def parse_args(self, args=None, namespace=None):
        original(self, args, namespace)  # an unknown or malformed flag exits here with status 2
        raise _Parsed

    def parse_train_flags(argv=None):  # the trainer's flags, with its own checks (HfArgumentParser, then its rules)
        original_train(argv)
        raise _Parsed

    argparse.ArgumentParser.parse_args, train_accelerate.parse_args = parse_args, parse_train_flags
    try:
        if argv[0] == "train_accelerate.py":
            parse_train_flags(argv[1:])
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            with warnings.catch_warnings():  # the module may be imported already (the trainer imports it)
                warnings.simplefilter("ignore", RuntimeWarning)
                runpy.run_module(argv[1], run_name="__main__", alter_sys=False)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, str((ROOT / argv[0]).parent))  # as `python script.py` puts the script's folder first
            runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
        return "the script ran past its argument parsing without calling parse_args"
    except _Parsed:
        if "--" in argv:  # ab_compare.py's training flags, after its own: the trainer's parser checks them too
            try:
                parse_train_flags(argv[argv.index("--") + 1 :])
            except _Parsed:
                return None
            except SystemExit as e:
                return f"its training flags (after --): exited {e.code}"
        return None
    except SystemExit as e:
        return f"exited {e.code}"
    finally:
        argparse.ArgumentParser.parse_args, train_accelerate.parse_args = original, original_train
        sys.argv, sys.path[:] = saved_argv, saved_path


def _record(tmp_path: Path, steps: list[str]) -> dict[str, list[list[str]]]:
    """Run the script over `steps` with the recorder as PY; the commands each step ran, in order."""
    recorder = tmp_path / "py"
    recorder.write_text(RECORDER)
    recorder.chmod(0o755)
    placeholder = tmp_path / "placeholder.parquet"  # the steps that check a data file exists before using it
    placeholder.write_bytes(b"")
    (tmp_path / "captured.pt").write_bytes(b"")  # so that attention and floors add their captured input kind
    by_step = {}
    for step in steps:
        log = tmp_path / f"log-{step}"
        log.mkdir()
        env = dict(os.environ, PY=str(recorder), OUT=str(tmp_path / "out"), GPU_SESSION_DRY_LOG=str(log),
                   LONG_DOCS=str(placeholder), RETRIEVAL_ROWS=str(placeholder), DATA=str(tmp_path / "data"),
                   CAPTURED=str(tmp_path / "captured.pt"), RT_OVERRIDES='{"compressor": "mean"}')  # fmt: skip
        env.pop("FLA_WHEEL", None)
        done = subprocess.run(["bash", str(SCRIPT), step], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert done.returncode == 0, f"step {step}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
        assert "exited non-zero" not in done.stdout, f"step {step}: {done.stdout[-2000:]}"
        commands = [f.read_bytes().split(b"\0")[:-1] for f in sorted(log.iterdir())]
        by_step[step] = [[a.decode() for a in c] for c in commands if c and c[0] != b"-c"]  # -c: inline code
    return by_step


def _pytest_selection(argv: list[str]) -> tuple[int, str]:
    """(tests selected, output) of a recorded `-m pytest ...` command, collected only."""
    args = argv[2:]
    if "-n" in args:  # pytest-xdist's workers, where the recorder stood in for `import xdist`
        i = args.index("-n")
        args = args[:i] + args[i + 2 :]
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    counts = re.findall(r"^tests/\S+: (\d+)$", done.stdout, flags=re.M)
    return sum(map(int, counts)), done.stdout[-1500:] + done.stderr[-1500:]


def test_every_step_of_the_gpu_session_parses_its_flags(tmp_path):
    steps = session_steps()
    assert {"check", "pending", "attention", "decode", "floors", "flex", "ws", "tests", "retrieval", "fuzz"} <= set(steps)
    recorded = _record(tmp_path, steps)
    overrides = [c for c in recorded["retrieval"] if "--model-overrides" in c]  # RT_OVERRIDES as one argument
    assert overrides and overrides[0][overrides[0].index("--model-overrides") + 1] == '{"compressor": "mean"}'
    failures = []
    for step, commands in recorded.items():
        if not commands:
            failures.append(f"{step}: ran no command")
        for argv in commands:
            if argv[:2] == ["-m", "pytest"]:
                selected, output = _pytest_selection(argv)
                if not selected:
                    failures.append(f"{step}: {' '.join(argv)} selects no test:\n{output}")
            elif argv[0] == "-m" or argv[0].endswith(".py"):
                problem = _parse_only(argv)
                if problem:
                    failures.append(f"{step}: {' '.join(argv)}: {problem}")
            else:
                failures.append(f"{step}: a command this test does not know how to check: {argv}")
    assert not failures, "\n".join(failures)


def test_the_dry_run_finds_a_bad_flag_and_an_empty_test_selection(tmp_path):
    """The check above has teeth: a flag the script does not take, and a -k that matches nothing, are reported."""
    assert _parse_only(["bench/kernel_floors.py", "--lengths", "2048", "--no-such-flag"]) == "exited 2"
    assert _parse_only(["bench/kernel_floors.py", "--lengths", "2048"]) is None
    ab = ["bench/ab_compare.py", "--out", "runs/x", "--seeds", "0", "--", "--model", "tiny"]
    assert _parse_only(ab) is None
    assert _parse_only([*ab, "--warmup-stepz", "3"]) == "its training flags (after --): exited 2"
    assert _pytest_selection(["-m", "pytest", "tests/test_gpu_session.py", "-k", "no_test_has_this_name"])[0] == 0


def test_the_next_gpu_sessions_calls_name_steps_the_script_has():
    """bench/KERNELS.md's "Next GPU session" plan: every step its calls name is one the script runs."""
    plan = (ROOT / "bench" / "KERNELS.md").read_text().split("## Next GPU session", 1)[1]
    calls = re.findall(r"bash bench/gpu_session\.sh ([a-z0-9 -]+)`", plan)
    assert len(calls) >= 2
    unknown = {s for call in calls for s in call.split() if s not in session_steps()}
    assert not unknown, unknown


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
