"""Suite-wide hooks: the heavy CPU jobs start in the background when collection ends (tests/background.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import background  # noqa: E402


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
