"""bench/warm_kernel_cache.py without a GPU: a GPU session's launches recorded on the CPU, compiled for sm_90 through
the JIT's own path into Triton's cache, packed, and found after unpacking into another cache folder.

Each run is a subprocess without TRITON_INTERPRET (the compile needs the JIT's kernels) and with a cache folder of
its own (TRITON_CACHE_DIR), so nothing the suite compiled elsewhere can stand in for a hit.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "warm_kernel_cache.py"

try:
    import triton.backends.nvidia  # noqa: F401  (the sm_90 compile needs the wheel's CUDA backend and ptxas)

    HAS_NVIDIA_BACKEND = True
except Exception:
    HAS_NVIDIA_BACKEND = False

needs_backend = pytest.mark.skipif(not HAS_NVIDIA_BACKEND, reason="triton's NVIDIA backend is not installed")

# every plan at small shapes (the session's own lengths take 20-40 s to record on two cores): one f+b length and decode
# context, pending's cases with one variant that adds a kernel, decode with one that changes every launch
SMALL = ["--lengths", "2048", "--tokens", "4096", "--decode-lengths", "4096", "--decode-batch", "1",
         "--tune-cases", "12,2,64,2048,2,random", "--tune-variants", "default", "seldq_split:sel_dq_split=1",
         "--decode-variants", "default", "decode_pdl:decode_pdl=1", "--ws-stages", "0", "2"]


def _run(args: list, cache: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)
    done = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    return done


def _summary(stdout: str) -> tuple[int, int, int]:
    """(found in the cache, compiled, failed) from the run's summary line."""
    found, compiled, failed = re.search(r"launches: (\d+) found in the cache, (\d+) compiled, (\d+) failed",
                                        stdout).groups()
    return int(found), int(compiled), int(failed)


@needs_backend
def test_every_plan_records_the_launches_of_its_step(tmp_path):
    """Each plan runs its step's own code on the CPU and records launches; a launch variant's knobs reach them
    (pending's split selected dQ adds its kernel, decode's programmatic dependent launches change the decode
    kernels'); the GPU kernel cases all run to where they would compare with the reference."""
    done = _run(["--list", *SMALL], tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    new = dict(re.findall(r"^# (\w+): (\d+) new distinct launches", done.stdout, flags=re.M))
    assert set(new) == {"check", "attention", "pending", "decode", "ws"} and all(int(n) > 0 for n in new.values()), new
    listed = [line.split(" ", 2) for line in done.stdout.splitlines() if line.split(" ", 1)[0] in new]
    assert sum(1 for plan, _, _ in listed if plan == "check") == int(new["check"])
    assert any(plan == "pending" and kernel == "_sel_dq_kernel" for plan, kernel, _ in listed), listed
    pdl = [json.loads(spec) for plan, _, spec in listed if plan == "decode" and '"PDL": true' in spec]
    assert pdl and all(spec["launch_pdl"] for spec in pdl)
    # ws_tiles' eight variants (its own kernels, not modeling_nsa's) at both stages; its check and its timed walk
    # specialize alike, so 2 x 8 distinct launches; the warp-specialized ones among them
    ws = [(kernel, json.loads(spec)) for plan, kernel, spec in listed if plan == "ws"]
    assert len(ws) == 16 and sum(1 for _, spec in ws if spec.get("num_stages") == 2) == 8, ws
    assert sum(1 for kernel, spec in ws if spec.get("WS")) == 4, ws
    assert not (tmp_path.exists() and any(tmp_path.iterdir())), "--list compiled something"


def test_the_session_warms_the_ws_steps_stages():
    """gpu_session.sh hands the warm step the stages its ws step times (one list, WS_STAGES), so warm compiles what
    the step will launch."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_gpu_session import SCRIPT as SESSION, script_defaults

    text = SESSION.read_text()
    warm = text.split("    warm)", 1)[1].split(";;", 1)[0]
    ws = text.split("    ws)", 1)[1].split(";;", 1)[0]
    assert "--ws-stages $WS_STAGES" in warm and "--stages $WS_STAGES" in ws, (warm, ws)
    assert script_defaults()["WS_STAGES"].split() == ["0", "2", "4"]


@needs_backend
def test_a_packed_cache_is_found_where_it_is_unpacked(tmp_path):
    """Compile into one cache folder and pack; unpack into an empty one: the same launches are found there, not
    compiled again (Triton keeps each entry's file list as absolute paths: the unpack roots them anew), and the
    pack holds only what a hit reads."""
    first, second = tmp_path / "first", tmp_path / "second"
    pack = tmp_path / "sm90.tar.gz"
    # three launches (the combine, and the compressed split eager and static) on two forked compile processes
    only = ["--plans", "decode", "--kernels", "_decode_combine_kernel", "_decode_cmp_split_kernel", "--workers", "2"]
    done = _run([*only, "--pack", str(pack)], first)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert _summary(done.stdout) == (0, 3, 0), done.stdout
    with tarfile.open(pack) as tar:
        names = tar.getnames()
        manifest = json.load(tar.extractfile("warm_kernel_cache.json"))
    assert manifest["entries"] == 3 and manifest["arch"] == 90 and manifest["triton_key"]
    assert {Path(n).suffix for n in names if "/" in n} == {".json", ".cubin"}, names  # no IR stages

    again = _run(only, first)  # the compile's own cache: hits
    assert _summary(again.stdout) == (3, 0, 0), again.stdout
    done = _run([*only, "--unpack", str(pack)], second)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "every key component matches" in done.stdout, done.stdout
    assert _summary(done.stdout) == (3, 0, 0), done.stdout
    groups = list(second.glob("*/__grp__*.json"))
    assert groups and all(Path(p).parent == g.parent for g in groups
                          for p in json.loads(g.read_text())["child_paths"].values())


@needs_backend
def test_an_unpacked_cache_from_another_triton_names_the_key_that_differs(tmp_path):
    """A pack whose triton hash is not this machine's (another triton build, or another Python's compiled
    library) is named as such: its entries would never be found, and the session should know why."""
    pack = tmp_path / "other.tar.gz"
    manifest = dict(triton="0.0", triton_key="not-this-triton", entries=0, launches=0)
    with tarfile.open(pack, "w:gz") as tar:
        data = json.dumps(manifest).encode()
        info = tarfile.TarInfo("warm_kernel_cache.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    done = _run(["--unpack", str(pack), "--list", "--plans", "decode"], tmp_path / "cache")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("# unpacked"))
    assert "key components differ" in line and "triton_key: 'not-this-triton' in the file" in line, line
