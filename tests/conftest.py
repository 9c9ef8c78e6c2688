"""Suite-wide hooks: the heavy CPU jobs start in the background when collection ends (tests/background.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# One torch thread in the tests and the processes they start, unless the caller sets OMP_NUM_THREADS: the tests'
# tensors are tiny, and a second thread spent more CPU than it saved (test_train_loop.py: 3m15s of CPU and 3m47s
# of wall time with torch's 2 threads on a 2-core machine, 2m05s and 3m18s with one), CPU the background jobs
# (tests/background.py) and the other processes of a test need. Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import background  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_compiled_frames_left_over():
    """Each test starts without torch.compile's state from earlier ones: the compiled frames transformers' generate()
    left behind made a later test's tracing 4x slower (test_compile_trains_as_uncompiled_and_resumes_without_it:
    16 s alone, 72 s after test_generate_compiles_the_static_cache_steps_into_one_graph)."""
    yield
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()


def _jobs_read(item) -> list:
    """The background jobs (commands functions) of the fixtures the test uses: its module's BACKGROUND_JOBS."""
    jobs = getattr(getattr(item, "module", None), "BACKGROUND_JOBS", {})
    return [jobs[name] for name in getattr(item, "fixturenames", ()) if name in jobs]


def pytest_collection_modifyitems(session, config, items):
    """Tests reading a background job run last (deselection, which may run after this hook, keeps the order)."""
    readers = [item for item in items if _jobs_read(item)]
    if readers:
        items[:] = [item for item in items if not _jobs_read(item)] + readers


def pytest_collection_finish(session):
    """The jobs of the tests that will run start now (after -k/-m/--deselect/--lf), unless only collecting."""
    if session.config.option.collectonly:
        return
    for item in session.items:
        for commands_function in _jobs_read(item):
            background.start(commands_function)


def pytest_sessionfinish(session, exitstatus):
    background.stop_all()
