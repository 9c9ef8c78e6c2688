"""The sm_90 compile of the default launches with the Triton the H100 sessions run, beside the one installed here.

The project's GPU benchmarks run torch 2.11, which pins triton 3.6 (ptxas 12.8); this machine's torch pins a later
triton (3.9, ptxas 12.9). The two compile the same kernels differently: on 2026-11-28 triton 3.6 put every
tensor-core instruction of the compressed/window dK/dV kernel in a wait of its own at the 125M layout (ptxas
C7515) where 3.9 did not, so tests/triton_aot.py's checks with the local triton said nothing of what the H100
ran. This script installs that triton into a directory of its own (pip --no-deps --target, from the package index
pip is configured with, into a temporary directory renamed when complete; one directory per Python, whose
compiled modules the wheel matches) unless a triton there imports at that version, and runs tests/triton_aot.py
for sm_90 with it first on the path.

    python tests/h100_compiler.py [--dir DIR] [more triton_aot.py arguments, after the defaults]

Exit status 3: the triton could not be installed (no index with it). The test then skips, naming this command,
unless NSA_REQUIRE_H100_TRITON=1 (set by .ci/run), where it fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
H100_TRITON = "3.6.0"  # torch 2.11's pin, the H100 sessions' triton (bench/results/*-h100*/env.txt)
# the default launches at the layouts the benchmarks time, head_dim 32-128 (the opt-in variants compile with the
# local triton only: CI time)
H100_SCENARIOS = ["125M-G6-d64-bf16", "125M-G6-d64-bf16-long", "fla-G16-d64-bf16", "G1-d64-bf16", "G4-d128-fp16",
                  "G8-d128-bf16-long", "G4-d32-fp16",
                  # the decode step's programmatic dependent launches (opt-in, the next decode timing): the
                  # griddepcontrol the device's triton emits for them
                  "125M-G6-d64-bf16-pdl", "125M-G6-d64-bf16-pdl-fusedcombine"]


def env_with_first(target: Path) -> dict:
    """This process's environment with target first on the Python path, without TRITON_INTERPRET (the compile
    needs the JIT's kernels, not interpreted ones)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(target), *filter(None, [env.get("PYTHONPATH")])])
    return env


def imported_version(target: Path) -> str | None:
    """The version of the triton that imports from target first on the path (None: none imports)."""
    proc = subprocess.run([sys.executable, "-c", "import triton; print(triton.__version__)"],
                          env=env_with_first(target), capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 and (target / "triton").is_dir() else None


def ensure_triton(target: Path, version: str) -> bool:
    if imported_version(target) == version:
        return True
    partial = target.with_name(target.name + ".partial")  # a killed install never looks complete
    shutil.rmtree(partial, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-compile", "--no-deps", "--target",
                           str(partial), f"triton=={version}"], capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        print(f"pip could not install triton=={version} into {partial}:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return False
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return imported_version(target) == version


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=str(ROOT / ".cache" / f"triton-{H100_TRITON}-{sys.implementation.cache_tag}"))
    ap.add_argument("--version", default=H100_TRITON)
    args, aot_args = ap.parse_known_args()
    target = Path(args.dir)
    if not ensure_triton(target, args.version):
        sys.exit(3)
    # the defaults first: a later --scenarios or --arch replaces theirs, other options add to them
    aot_args = ["--arch", "90", "--sass-loops", "--scenarios", *H100_SCENARIOS, *aot_args]
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_aot.py"), *aot_args],
                          env=env_with_first(target), cwd=ROOT)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
