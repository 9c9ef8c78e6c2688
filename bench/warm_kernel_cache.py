"""Compile the Triton launches a GPU session's steps will make before they run: Triton's kernel cache, warm.

Most of the host time of a GPU session's kernel steps goes to Triton compiling kernels, one at a time: the `check`
step's kernel cases took 390 s on one process and 154 s on six pytest workers (bench/gpu_session.sh), and each
launch sweep compiles every variant at every shape before it times anything. A session has 15 minutes of device
time. This script records every launch those steps make without running a kernel (each step's own code run on
CPU tensors of the same shapes, every kernel of modeling_nsa replaced by a recorder, as tests/triton_aot.py
records them) and compiles each distinct launch through the JIT's own path (`JITFunction.run(..., warmup=True)`:
the specialization, options and cache key of the launch itself) into Triton's kernel cache, on every core.

Two ways to use it:
- on the GPU machine, as a session's first step (`bash bench/gpu_session.sh warm ...`): the launches compile side
  by side on all its cores instead of one by one inside each step;
- ahead of a session, on a machine without a GPU, with the GPU image's Python and triton (3.12 and 3.6.0; the
  cache key hashes triton's own files, its compiled library among them): `--pack FILE` compiles, then writes the
  cache entries it used and the components of their keys to FILE (a .tar.gz to carry); on the GPU machine
  `--unpack FILE` puts them in Triton's cache and compares each key component with that machine's (a mismatch is
  named: the compile then does the work there, as without the file).

    python bench/warm_kernel_cache.py [--plans check attention pending decode ws] [--arch 90] [--workers N]
    python bench/warm_kernel_cache.py --pack runs/kernel-cache/sm90.tar.gz [--plans ...]
    python bench/warm_kernel_cache.py --unpack runs/kernel-cache/sm90.tar.gz [--plans ...]
    python bench/warm_kernel_cache.py --list [--plans ...]     # the distinct launches per plan, nothing compiled

Plans (what each GPU session step launches; bench/gpu_session.sh passes the same lists to both):
- check: the GPU kernel cases of tests/test_triton_kernels.py (`gpu_kernels_match`, `gpu_decode`);
- attention: bench/bench_attention.py's op rows (forward, and forward + backward, at --lengths x --layouts with
  --tokens per step) and its decode rows (--decode-lengths x --decode-batch, eager and a static cache's step);
- pending: bench/tune_kernels.py's f+b cases (--tune-cases) under each launch variant (--tune-variants);
- decode: bench/tune_kernels.py's decode section (its 64k step, eager and static) under --decode-variants;
- ws: bench/ws_tiles.py's tile loops, every variant at each of --ws-stages (its check and its timed walk).
Not covered: the GPU tests of the whole model (`tests`), `floors`' copy and matmul probes, and the torch.compile
steps (`flex`, `model-compile`): those compile as they run.
TRITON_INTERPRET must be unset (the kernels must be JIT functions).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tarfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests", ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from triton_aot import with_kernels_replaced  # noqa: E402
from triton_helpers import as_arch, import_nsa, pdl_decode_case  # noqa: E402

_, _reference, tri = import_nsa()

PLANS = ("check", "attention", "pending", "decode", "ws")
MANIFEST = "warm_kernel_cache.json"  # the key components, first in a --pack file


class _Recorded(Exception):
    """Raised where a kernel case's runner would compare with the reference: its launches are all recorded."""


class TargetOnlyDriver:
    """Triton's driver as the JIT's compile path asks it (`JITFunction.run` with warmup=True): the target, device 0
    and stream 0. Nothing launches, so no GPU is touched: the same on a GPU machine as on a CPU (gpu_session.sh runs
    this script with no GPU visible: the compile processes are forked, and modules the plans import may ask CUDA
    things, e.g. fla's). The real driver's target on an H100 or H200 is GPUTarget("cuda", 90, 32)."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def _standin_tensor(t: torch.Tensor) -> torch.Tensor:
    """A one-element CPU tensor that Triton specializes as it does t: the same dtype and the same address modulo 16
    (what the JIT reads of a tensor argument), so a kept launch does not hold the step's large inputs."""
    size = t.element_size()
    base = torch.empty(64 // size + 1, dtype=t.dtype)
    offset = (t.data_ptr() - base.data_ptr()) % 16
    if offset % size:  # (an address not a multiple of the element size: keep the tensor itself)
        return t
    return base[offset // size:offset // size + 1]


class LaunchSet:
    """The distinct launches recorded so far: one per (kernel, JIT specialization, options); each kept with
    stand-ins for its tensors (_standin_tensor), in the order first seen, with the plan that first made it."""

    def __init__(self, arch: int):
        self.arch = arch
        self.launches: list[tuple[str, str, object, tuple, dict]] = []  # (plan, kernel name, jit fn, args, kwargs)
        self.keys: set = set()
        self.recorded = 0

    def record(self, plan: str):
        launches = self

        class Recorder:
            def __init__(self, name, fn):
                self.name, self.fn = name, fn

            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    launches.add(plan, self.name, self.fn, args, kwargs)

                return launch

        return Recorder

    def add(self, plan, name, fn, args, kwargs):
        self.recorded += 1
        binder = fn.device_caches[0][4]  # the JIT's own argument binder (TargetOnlyDriver active)
        _, specialization, options = binder(*args, **kwargs)
        key = (name, repr(specialization), repr(sorted(options.items())) if isinstance(options, dict) else repr(options))
        if key in self.keys:
            return
        self.keys.add(key)
        standins = tuple(_standin_tensor(a) if torch.is_tensor(a) else a for a in args)
        if repr(binder(*standins, **kwargs)[1]) != key[1]:  # what the compile will see must be the launch's own
            raise RuntimeError(f"{name}: the stand-in arguments specialize otherwise than the launch's")
        self.launches.append((plan, name, fn, standins, dict(kwargs)))


def _with_driver(arch: int):
    """Context: Triton's active driver is TargetOnlyDriver(arch)."""
    from triton.runtime import driver

    @contextlib.contextmanager
    def active():
        before = driver._active  # (reset_active() would make the default driver, which fails without a GPU)
        driver.set_active(TargetOnlyDriver(arch))
        try:
            yield
        finally:
            driver._active = before

    return active()


@contextlib.contextmanager
def _values_unread():
    """torch.randn makes uninitialized tensors inside the block: a recorded launch depends on its inputs' shapes,
    dtypes and strides, never on their values (the launchers read nothing on the host), and drawing the session's
    inputs (32 rows of 64k tokens for the decode rows) took most of the recording's time on a CPU. The random
    integers that lay out documents (torch.randint) stay drawn: they decide the compressed tokens' count."""
    randn = torch.randn

    def unread(*size, generator=None, out=None, **options):
        if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
            size = tuple(size[0])
        return torch.empty(*size, **options)

    torch.randn = unread
    try:
        yield
    finally:
        torch.randn = randn


def _recorded(launches: LaunchSet, plan: str, run) -> None:
    """run() with every kernel recorded into launches; a _Recorded exception ends it."""
    def guarded():
        try:
            run()
        except _Recorded:
            pass

    with_kernels_replaced(guarded, lambda name, fn: launches.record(plan)(name, fn))


# ------------------------------------------------------------------------------------------------------------------
# Plans: each step's own calls, on CPU tensors
# ------------------------------------------------------------------------------------------------------------------

def plan_check(launches: LaunchSet, arch: int) -> None:
    """tests/test_triton_kernels.py's GPU cases (gpu_session.sh check: `gpu_kernels_match or gpu_decode`), each case's
    runner on the CPU, stopped where it would compare with the reference (after its last launch)."""
    import test_triton_kernels as cases
    import triton_helpers

    def stop(*args, **kwargs):
        raise _Recorded

    def zeros_like_query(q, *args, **kwargs):  # the decode runner's reference between steps: a stand-in
        return torch.zeros(q.shape, dtype=torch.float32)

    saved = triton_helpers._reference_on, _reference.nsa_attention_reference
    triton_helpers._reference_on, _reference.nsa_attention_reference = stop, zeros_like_query
    try:
        for case in cases.GPU_CASES:
            _recorded(launches, "check", lambda: triton_helpers.run_case(dict(case, device="cpu", arch=arch)))
        for case in cases._GPU_DECODE_CASES:
            _recorded(launches, "check", lambda: triton_helpers.run_decode_case(dict(case, device="cpu", arch=arch)))
        _recorded(launches, "check", lambda: _pdl_test_calls(arch))
    finally:
        triton_helpers._reference_on, _reference.nsa_attention_reference = saved


def _pdl_test_calls(arch: int) -> None:
    """test_gpu_decode_pdl_equals_the_default_eager_and_graphed's decoding calls (triton_helpers.pdl_decode_case:
    eager steps and a static cache's step, both combines, with and without programmatic dependent launches)."""
    case = pdl_decode_case("cpu")
    with as_arch(arch):
        for pdl in (0, 1):
            for fused in (0, 1):
                with tri.launch_overrides(decode_pdl=pdl, decode_fused_combine=fused):
                    for tk in case.positions:
                        case.eager(tk)
                    case.static_step()


def plan_attention(launches: LaunchSet, arch: int, layouts, lengths, tokens, decode_lengths, decode_batches) -> None:
    """bench/bench_attention.py's rows: the op's forward and forward + backward per layout and length (B = tokens /
    T), then its decode step eagerly and as a static cache's step per context and batch (12 q / 2 kv, d64)."""
    import bench_attention

    for spec in layouts:
        H, Hkv, D = (int(s) for s in spec.split(","))
        for T in lengths:
            step = bench_attention.nsa_step(*bench_attention.nsa_inputs(max(1, tokens // T), T, H, Hkv, D,
                                                                        device="cpu"))
            with as_arch(arch):
                _recorded(launches, "attention", lambda: (step(False), step(True)))
    for batch in decode_batches:
        for T in decode_lengths:
            step = bench_attention.decode_step(batch, T, 12, 2, 64, device="cpu")
            query_end = torch.tensor([T - 1])
            with as_arch(arch):
                _recorded(launches, "attention", lambda: (step(), step(query_end)))


def plan_pending(launches: LaunchSet, arch: int, cases, variants) -> None:
    """bench/tune_kernels.py's f+b cases under each variant: its top-n call and its timed step (forward and
    backward), as `gpu_session.sh pending` runs them."""
    import tune_kernels

    for H, Hkv, D, T, B, kind, _ in cases:
        x, cmp_end, doc_pos = tune_kernels.nsa_inputs(B, T, H, Hkv, D, kind=kind, device="cpu")
        step = tune_kernels.fwd_bwd_call(x, cmp_end, doc_pos)
        for name, settings in variants:
            if name.startswith("decode_"):  # (tune_kernels' f+b cases skip them too)
                continue

            def run():
                tri.select_blocks_triton(x["q"].detach(), x["k_cmp"].detach(), cmp_end, doc_pos, tune_kernels.PARAMS)
                step()

            with as_arch(arch), tri.launch_overrides(**settings):
                _recorded(launches, "pending", run)


def plan_decode(launches: LaunchSet, arch: int, variants) -> None:
    """bench/tune_kernels.py's decode section under each variant: its step eagerly and as a static cache's step."""
    import tune_kernels

    step = tune_kernels.decode_call(tune_kernels.DECODE_CONTEXT, device="cpu")
    query_end = torch.tensor([tune_kernels.DECODE_CONTEXT - 1])
    for _, settings in variants:
        with as_arch(arch), tri.launch_overrides(**settings):
            _recorded(launches, "decode", lambda: (step(), step(query_end)))


def plan_ws(launches: LaunchSet, arch: int, stages, head_dim: int = 64) -> None:
    """bench/ws_tiles.py's variants at each of `stages` (0: Triton's default), as `gpu_session.sh ws` launches them:
    its check against torch (512 rows) and its timed walk at its default lengths. Its kernels live in that script,
    not in modeling_nsa's kernel files, so they are replaced here by hand."""
    import ws_tiles

    kernels = {name: getattr(ws_tiles, name) for name in dir(ws_tiles) if name.startswith("_") and name.endswith("_kernel")}
    record = launches.record("ws")
    defaults = ws_tiles.parse_args([])
    try:
        for name, fn in kernels.items():
            setattr(ws_tiles, name, record(name, fn))
        for variant, (loop, *_) in ws_tiles.VARIANTS.items():
            walk = defaults.dkdv_walk if loop == "dkdv" else defaults.dq_walk
            R, N, _ = ws_tiles.walk_problem(loop, walk, defaults.length, head_dim)
            timed = ws_tiles.make_inputs(R, N, head_dim, "cpu")
            checked = ws_tiles.make_inputs(512, 512, head_dim, "cpu")
            for num_stages in stages:
                with as_arch(arch):
                    ws_tiles.launch(variant, *checked, 256, num_stages or None)  # ws_tiles.check's launch
                    ws_tiles.launch(variant, *timed, walk, num_stages or None)
    finally:
        for name, fn in kernels.items():
            setattr(ws_tiles, name, fn)


# ------------------------------------------------------------------------------------------------------------------
# Compiling, and the cache as a file to carry
# ------------------------------------------------------------------------------------------------------------------

_LAUNCHES: list = []  # the parent's LaunchSet.launches, read by the forked workers
_ARCH = 90


def _compile_one(i: int) -> dict:
    import triton

    plan, name, fn, args, kwargs = _LAUNCHES[i]
    start = time.time()
    row = dict(plan=plan, kernel=name)
    seen = {}

    def listener(*, cache_hit, **_):  # Triton's own word on whether the compile was found in its cache
        seen["cache_hit"] = cache_hit

    triton.knobs.compilation.listener = listener
    try:
        with _with_driver(_ARCH):
            kernel = fn.run(*args, grid=(1,), warmup=True, **kwargs)
        row.update(ok=True, entry=_cache_entry_name(kernel.hash), found=seen.get("cache_hit", False))
    except Exception as exc:  # named per launch: one failing compile must not hide the rest
        row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[-600:]}")
    row["seconds"] = round(time.time() - start, 2)
    return row


def compile_all(launches: LaunchSet, workers: int) -> list[dict]:
    """Compile every launch (each a cache hit where Triton's cache has it) on `workers` forked processes."""
    global _LAUNCHES, _ARCH
    _LAUNCHES, _ARCH = launches.launches, launches.arch
    if workers <= 1:
        return [_compile_one(i) for i in range(len(_LAUNCHES))]
    import multiprocessing

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_compile_one, range(len(_LAUNCHES))))


def key_components(arch: int) -> dict:
    """What Triton's cache key is made of besides the launch itself (triton.runtime.cache.get_cache_key): triton's
    own hash (its Python files and compiled library), the backend's (ptxas version and target), the default
    options' (libdevice's hash among them) and the cache-invalidating environment variables that are set."""
    import triton
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.cache import triton_key

    backend = make_backend(GPUTarget("cuda", arch, 32))
    return dict(triton=triton.__version__, python=sys.version.split()[0], triton_key=triton_key(),
                backend=backend.hash(), default_options=backend.parse_options({}).hash(),
                env=dict(sorted(get_cache_invalidating_env_vars().items())))


def _cache_entry_name(kernel_hash: str) -> str:
    """The folder in Triton's cache that holds a compiled kernel: its key's hash in base32 (runtime.cache._base32)."""
    from triton.runtime.cache import _base32

    return _base32(kernel_hash)


def cache_dir() -> Path:
    import triton

    return Path(triton.knobs.cache.dir)


KEPT_FILES = (".json", ".cubin")  # what a cache hit reads of an entry (CompiledKernel: the metadata and the binary)


def pack(path: Path, rows: list[dict], arch: int) -> dict:
    """Write the cache entries the compiled launches used, and their key components, to a .tar.gz. Of each entry
    only what a cache hit reads (KEPT_FILES: the IR stages are a ninth of the size), and its group file (the
    entry's list of files, which Triton keeps as absolute paths) with the names alone: unpack() roots them where
    the entry lands."""
    entries = sorted({r["entry"] for r in rows if r.get("ok")})
    manifest = dict(key_components(arch), arch=arch, entries=len(entries), launches=len(rows),
                    created=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    path.parent.mkdir(parents=True, exist_ok=True)

    def add_bytes(tar, name, data: bytes):
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    partial = path.with_name(path.name + ".partial")  # renamed when whole: a call never carries half a file
    with tarfile.open(partial, "w:gz") as tar:
        add_bytes(tar, MANIFEST, json.dumps(manifest, indent=1).encode())
        for name in entries:
            for group in (cache_dir() / name).glob("__grp__*"):
                children = json.loads(group.read_text())["child_paths"]
                kept = sorted(c for c in children if c.endswith(KEPT_FILES))
                add_bytes(tar, f"{name}/{group.name}", json.dumps({"child_names": kept}).encode())
                for child in kept:
                    tar.add(cache_dir() / name / child, arcname=f"{name}/{child}")
    os.replace(partial, path)
    return manifest


def unpack(path: Path, arch: int) -> list[str]:
    """Put a --pack file's entries into Triton's cache (each group file's names rooted at the entry's folder
    there); returns the key components that differ here (empty: its entries are what this machine's launches
    look up)."""
    root = cache_dir().resolve()  # (Triton's file lists hold absolute paths)
    with tarfile.open(path, "r:gz") as tar:
        manifest = json.load(tar.extractfile(MANIFEST))
        members = [m for m in tar.getmembers() if m.name != MANIFEST]
        root.mkdir(parents=True, exist_ok=True)
        tar.extractall(root, members=members, filter="data")
    for member in members:
        if Path(member.name).name.startswith("__grp__"):
            group = root / member.name
            names = json.loads(group.read_text())["child_names"]
            group.write_text(json.dumps({"child_paths": {n: str(group.parent / n) for n in names}}))
    here = key_components(arch)
    return [f"{k}: {manifest.get(k)!r} in the file, {v!r} here" for k, v in here.items()
            if k != "python" and manifest.get(k) != v]


def parse_args(argv=None):
    import tune_kernels  # its case and variant syntax

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", nargs="*", default=list(PLANS), choices=PLANS)
    ap.add_argument("--arch", type=int, default=90,
                    help="sm version to compile for (default 90: the H100 and H200; not read from a GPU, so that "
                         "this process need not touch CUDA before it forks its compile processes)")
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                    help="compile processes (default: one per core this process may use)")
    ap.add_argument("--layouts", nargs="*", default=["12,2,64", "16,1,64"], help="attention: bench_attention's")
    ap.add_argument("--lengths", type=int, nargs="*", default=[2048, 8192, 32768, 65536])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--decode-lengths", type=int, nargs="*", default=[8192, 32768, 65536])
    ap.add_argument("--decode-batch", type=int, nargs="*", default=[1, 32])
    ap.add_argument("--tune-cases", nargs="*", type=tune_kernels.parse_case,
                    default=[tune_kernels.parse_case(c) for c in ("12,2,64,8192,8,random", "12,2,64,65536,1,random")],
                    metavar="H,HKV,D,T,B,KIND",
                    help="pending: tune_kernels' --cases")
    ap.add_argument("--tune-variants", nargs="*", type=tune_kernels.parse_variant,
                    default=[tune_kernels.parse_variant("default")],
                    help="pending: tune_kernels' --variants")
    ap.add_argument("--decode-variants", nargs="*", type=tune_kernels.parse_variant,
                    default=[tune_kernels.parse_variant("default")],
                    help="decode: tune_kernels' --variants of its decode section")
    ap.add_argument("--ws-stages", type=int, nargs="*", default=[0],
                    help="ws: bench/ws_tiles.py's --stages (0: Triton's default)")
    ap.add_argument("--pack", type=Path, default=None, help="after compiling, write the used entries to this .tar.gz")
    ap.add_argument("--unpack", type=Path, default=None, help="first put this --pack file's entries in the cache")
    ap.add_argument("--list", action="store_true", help="record and count the launches; compile nothing")
    ap.add_argument("--kernels", nargs="*", default=None, help="compile only these kernels' launches (default: all)")
    args = ap.parse_args(argv)
    return args


def record_plans(args) -> LaunchSet:
    launches = LaunchSet(args.arch)
    with _with_driver(args.arch), _values_unread():
        for plan in args.plans:
            start, before = time.time(), len(launches.launches)
            if plan == "check":
                plan_check(launches, args.arch)
            elif plan == "attention":
                plan_attention(launches, args.arch, args.layouts, args.lengths, args.tokens, args.decode_lengths,
                               args.decode_batch)
            elif plan == "pending":
                plan_pending(launches, args.arch, args.tune_cases, args.tune_variants)
            elif plan == "decode":
                plan_decode(launches, args.arch, args.decode_variants)
            else:
                plan_ws(launches, args.arch, args.ws_stages)
            print(f"# {plan}: {len(launches.launches) - before} new distinct launches "
                  f"({time.time() - start:.0f} s to record)", flush=True)
    return launches


def main(argv=None):
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("warm_kernel_cache.py compiles kernels: unset TRITON_INTERPRET")
    args = parse_args(argv)
    if args.unpack:
        if not args.unpack.is_file():
            sys.exit(f"--unpack {args.unpack}: no such file (written by --pack)")
        differ = unpack(args.unpack, args.arch)
        print(f"# unpacked {args.unpack} into {cache_dir()}: " + (
            "every key component matches: its launches will be found" if not differ else
            "key components differ, so its entries will not be found: " + "; ".join(differ)), flush=True)
    launches = record_plans(args)
    print(f"# {len(launches.launches)} distinct launches of {launches.recorded} recorded, sm_{args.arch}", flush=True)
    if args.kernels is not None:
        launches.launches = [launch for launch in launches.launches if launch[1] in args.kernels]
    if args.list:
        for plan, name, _, _, kwargs in launches.launches:
            print(plan, name, json.dumps({k: v for k, v in kwargs.items() if isinstance(v, (int, float, bool))}))
        return
    start = time.time()
    rows = compile_all(launches, args.workers)
    failed = [r for r in rows if not r["ok"]]
    found = sum(1 for r in rows if r.get("found"))
    print(f"# {len(rows)} launches: {found} found in the cache, {len(rows) - found - len(failed)} compiled, "
          f"{len(failed)} failed; {time.time() - start:.0f} s on {args.workers} processes "
          f"({sum(r['seconds'] for r in rows):.0f} process-s)", flush=True)
    for r in failed:
        print(f"FAILED {r['plan']} {r['kernel']}: {r['error']}", flush=True)
    if args.pack:
        manifest = pack(args.pack, rows, args.arch)
        print(f"# wrote {args.pack} ({args.pack.stat().st_size / 2**20:.1f} MiB, {manifest['entries']} entries): "
              f"triton {manifest['triton']}, Python {manifest['python']}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
