"""Compile every Triton kernel launch of the NSA op for NVIDIA GPUs, on a machine without one.

Triton's interpreter checks what the kernels compute, not whether they compile: loop-carried type
changes, tl.dot shapes below 16, or a variable bound in only one branch of an ``if`` pass on CPU and
fail on the first GPU launch. This script runs the host-side launchers of the kernel files on CPU
tensors with every kernel replaced by a recorder, then compiles each recorded launch (the JIT's own
argument specialization, constexprs and options) ahead of time for the requested architectures with
the ptxas that ships in the triton wheel, and reports registers, spills, shared memory and software-pipelined
loads per kernel.

    python tests/triton_aot.py [--arch 90 80] [--json out.json]

Used by tests/test_triton_compile.py (CI) and as a resource table when tuning tile sizes.
TRITON_INTERPRET must be unset (the kernels must be JITFunctions, not interpreted ones).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from triton_helpers import DEFAULT, as_arch, import_nsa, kernel_modules, make_inputs  # noqa: E402

_, _, tri = import_nsa()


class _Recorder:
    """Stands in for a @triton.jit kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, name, fn, sink):
        self.name, self.fn, self.sink = name, fn, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append((self.name, self.fn, args, kwargs))

        return launch


def with_kernels_replaced(run, stand_in):
    """Run ``run()`` with every @triton.jit kernel of the kernel files replaced by ``stand_in(name, jit_fn)``
    (in each file that names it: the launchers look their kernels up in their own file's globals)."""
    kernels = {(module, n): getattr(module, n) for module in kernel_modules() for n in dir(module)
               if n.endswith("_kernel") and n.startswith("_")}
    stand_ins = {}
    try:
        for (module, name), fn in kernels.items():
            setattr(module, name, stand_ins.setdefault(name, stand_in(name, fn)))
        run()
    finally:
        for (module, name), fn in kernels.items():
            setattr(module, name, fn)


def capture_launches(run) -> list:
    """Launches (name, jit_fn, args, kwargs) made by ``run()`` with every kernel of the kernel files recorded."""
    sink: list = []
    with_kernels_replaced(run, lambda name, fn: _Recorder(name, fn, sink))
    return sink


def _scenario(B, T, H, Hkv, D, dtype, layout="varlen", decode_steps=(), overrides=None):
    """Forward, backward and select_blocks at one shape (plus cached decode steps at Tk in decode_steps), under
    launch_overrides(**overrides) when given (a launch variant not yet the default)."""

    def run():
        with tri.launch_overrides(**(overrides or {})):
            launch()

    def launch():
        t, cmp_end, doc_pos, p = make_inputs(B, T, H, Hkv, D, DEFAULT, dtype, "cpu", layout)
        if not tri.triton_supports(p, D, "cpu"):  # as the public entry points: no launch on this architecture
            return
        args = tri._prepare(t["q"], t["k_cmp"], t["v_cmp"], cmp_end, t["k_slc"], t["v_slc"], t["k_win"], t["v_win"],
                            t["gates"], doc_pos)
        scale = D ** -0.5
        outs = tri._forward_impl(*args, p, scale)
        dout = torch.randn_like(t["q"])
        tri._backward_op(outs[1], outs[3])(dout, *args, *outs[1:], tri._params_tuple(p), scale)
        tri.select_blocks_triton(t["q"], t["k_cmp"], cmp_end, doc_pos, p)
        for tk in decode_steps:
            w = min(tk, p.window_size)
            tri.nsa_decode_triton(t["q"][:, tk - 1:tk], t["k_cmp"], t["v_cmp"], cmp_end, t["k_slc"][:, :tk],
                                  t["v_slc"][:, :tk], t["k_win"][:, tk - w:tk], t["v_win"][:, tk - w:tk],
                                  t["gates"][:, tk - 1:tk], doc_pos[:, :tk], p)
            # a static cache's step (STATIC launches): full-length buffers, a w-slot window ring
            query_end = torch.tensor([tk - 1])
            tri.nsa_decode_triton(t["q"][:, tk - 1:tk], t["k_cmp"], t["v_cmp"], cmp_end, t["k_slc"], t["v_slc"],
                                  t["k_win"][:, :p.window_size], t["v_win"][:, :p.window_size],
                                  t["gates"][:, tk - 1:tk], doc_pos, p, query_end=query_end)

    return run


# The shapes the kernels meet: the 125M layout (G=6) short and long (several top-n chunks, the compressed
# dK/dV without query splits, decode over several top-n block ranges), fla's layout (G=16), G=1, head_dim
# 128 in fp16 and bf16, head_dim 256, and decode.
SCENARIOS = {
    "125M-G6-d64-bf16": _scenario(2, 300, 12, 2, 64, torch.bfloat16, decode_steps=(1, 300)),
    "125M-G6-d64-bf16-long": _scenario(1, 8300, 12, 2, 64, torch.bfloat16, layout="single", decode_steps=(8300,)),
    "fla-G16-d64-bf16": _scenario(1, 300, 16, 1, 64, torch.bfloat16, layout="pad"),
    "G1-d64-bf16": _scenario(1, 200, 4, 4, 64, torch.bfloat16),
    "G4-d128-fp16": _scenario(2, 200, 8, 2, 128, torch.float16, layout="pad", decode_steps=(200,)),
    "G8-d128-bf16-long": _scenario(1, 8300, 16, 2, 128, torch.bfloat16, layout="single", decode_steps=(8300,)),
    # head_dim 32: the decode step's keys per step are capped (256), not grown as head_dim shrinks
    "G4-d32-fp16": _scenario(1, 300, 8, 2, 32, torch.float16, decode_steps=(300,)),
    # head_dim 256 runs on the kernels too with 160 KiB of shared memory per block (not a tuned shape: it
    # compiles, fits and spills; on sm_86 it runs the reference: no launches)
    "G2-d256-bf16": _scenario(1, 300, 4, 2, 256, torch.bfloat16, decode_steps=(300,)),
    # the decode parts combined by their last program (opt-in, decode_fused_combine): the parts kernel with its atomic
    # count and the combine inside (the scenario's other launches repeat the first one's and are compiled once)
    "125M-G6-d64-bf16-fusedcombine": _scenario(2, 300, 12, 2, 64, torch.bfloat16, decode_steps=(300,),
                                               overrides=dict(decode_fused_combine=True)),
    # the decode step's programmatic dependent launches (opt-in, decode_pdl): every decode kernel with its
    # griddepcontrol wait on sm_90 (before Hopper the launches are the default's, compiled once)
    "125M-G6-d64-bf16-pdl": _scenario(2, 300, 12, 2, 64, torch.bfloat16, decode_steps=(300,),
                                      overrides=dict(decode_pdl=True)),
    # ... with the fused combine, as gpu_session.sh times them together (only the parts kernel differs)
    "125M-G6-d64-bf16-pdl-fusedcombine": _scenario(2, 300, 12, 2, 64, torch.bfloat16, decode_steps=(300,),
                                                   overrides=dict(decode_pdl=True, decode_fused_combine=True)),
}

# Launch variants not yet the default (bench/KERNELS.md), each compiled at the shapes where its kernels differ
# most: the 125M layout long, fla's layout and head_dim 128 long (the other launches repeat the ones above).
_VARIANT_SHAPES = {
    "125M-G6-d64-bf16-long": dict(B=1, T=8300, H=12, Hkv=2, D=64, dtype=torch.bfloat16, layout="single"),
    "fla-G16-d64-bf16": dict(B=1, T=300, H=16, Hkv=1, D=64, dtype=torch.bfloat16, layout="pad"),
    "G8-d128-bf16-long": dict(B=1, T=8300, H=16, Hkv=2, D=128, dtype=torch.bfloat16, layout="single"),
}
_VARIANTS = {
    # the selected dQ added pair by pair by the selected dK/dV kernel
    "seldq": dict(sel_dq_in_dkdv=True),
    # the block-outer selected forward (pair tiles and the combine of their partials) and dQ (its own pair kernel)
    "selfwdpairs": dict(sel_fwd_pairs=True, sel_dq_pairs=True),
    # the selected forward and the training top-n without the 128-register cap they take on sm_90 at head_dim 64
    # (three programs per SM instead of four)
    "selfwduncapped": dict(sel_fwd_max_registers=0),
    "topnuncapped": dict(topn_max_registers=0),
    # the tile unions' int64 sort keys, which only inputs of 2**27 keys and more reach at the 125M layout
    "unionwide": dict(sel_union_wide_keys=True),
    # the int64 offsets only huge inputs take: the selected dK/dV's pair positions (from 2**31 (query, block) pairs)
    # and the K/V element offsets within a row (from 2**31 elements)
    "int64offsets": dict(sel_pairs_int64=True, offsets_int64=True),
    # the selected dQ in a launch of its own in the selected forward's tiles, then the fused dQ's interval share
    "seldqsplit": dict(sel_dq_split=True),
}
# variants compiled at fewer shapes (CI time): the block-outer kernels' registers differ by G and head_dim, which the
# 125M layout (G = 6) and head_dim 128 (G = 8) cover
_VARIANT_SKIP = {("fla-G16-d64-bf16", "selfwdpairs"), *((shape, uncapped) for uncapped in ("selfwduncapped", "topnuncapped")
                                                         for shape in ("fla-G16-d64-bf16", "G8-d128-bf16-long")),
                 ("fla-G16-d64-bf16", "unionwide"), ("G8-d128-bf16-long", "unionwide"),
                 ("fla-G16-d64-bf16", "int64offsets"), ("G8-d128-bf16-long", "int64offsets"),
                 ("fla-G16-d64-bf16", "seldqsplit")}
_VARIANT_SCENARIOS = {f"{shape}-{variant}": (shape, variant) for variant in _VARIANTS for shape in _VARIANT_SHAPES
                      if (shape, variant) not in _VARIANT_SKIP}
SCENARIOS.update({name: _scenario(**_VARIANT_SHAPES[shape], overrides=_VARIANTS[variant])
                  for name, (shape, variant) in _VARIANT_SCENARIOS.items()})
# The opt-in variants (launch_overrides knobs the benchmarks time) compile for sm_90 alone, the GPU they are timed
# on: for sm_80 and sm_86 too they were about a seventh of the AOT job's launches (CI time). The paths that inputs
# take by themselves (the int64 sort keys and offsets of huge inputs) compile for every architecture, as does the
# decode's fused combine (the *-fusedcombine scenario above), a candidate default.
AUTOMATIC_VARIANTS = ("unionwide", "int64offsets")
OPT_IN_VARIANT_SCENARIOS = {name for name, (_, variant) in _VARIANT_SCENARIOS.items()
                            if variant not in AUTOMATIC_VARIANTS}
OPT_IN_VARIANT_ARCHS = (90,)


def _specialize(fn, args, kwargs, arch):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    return target, options, signature, constexprs, attrs


def _cuobjdump_cache_dir() -> Path:
    """Where _cuobjdump keeps its outputs: inside Triton's own kernel cache (triton.knobs.cache.dir:
    TRITON_CACHE_DIR, default ~/.triton/cache), so that they are warm exactly where the compiles are."""
    import triton

    return Path(triton.knobs.cache.dir) / "nsa-cuobjdump"


def _cuobjdump(cubin: bytes, flag: str) -> subprocess.CompletedProcess:
    """The triton wheel's cuobjdump run on a cubin (written to a temporary file) with one flag. Its output is a
    function of the tool and the cubin, so a successful run's is kept on disk under their hash: Triton's cache
    skips a warm compile, and the disassembly (~0.6 CPU-s per launch, a resource count ~0.1) was then most of this
    script's CPU."""
    import gzip
    import hashlib
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    stat = tool.stat()
    key = hashlib.sha256(f"{tool}|{stat.st_size}|{stat.st_mtime_ns}|{flag}|".encode() + cubin).hexdigest()
    cached = _cuobjdump_cache_dir() / key[:2] / f"{key}.txt.gz"
    if cached.is_file():
        return subprocess.CompletedProcess([str(tool), flag], 0, gzip.decompress(cached.read_bytes()).decode(), "")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        proc = subprocess.run([str(tool), flag, f.name], capture_output=True, text=True)
    if proc.returncode == 0:
        try:  # written whole, then renamed: a reader never sees half a file (workers run side by side)
            cached.parent.mkdir(parents=True, exist_ok=True)
            partial = cached.with_suffix(f".{os.getpid()}.tmp")
            partial.write_bytes(gzip.compress(proc.stdout.encode(), compresslevel=1))  # SASS text: ~10x smaller
            os.replace(partial, cached)
        except OSError:  # a read-only or full disk: the run goes on without the cache
            pass
    return proc


def _resources(cubin: bytes) -> dict:
    text = _cuobjdump(cubin, "--dump-resource-usage").stdout
    line = next((ln for ln in text.splitlines() if "REG:" in ln), "")
    fields = dict(tok.split(":", 1) for tok in line.split() if ":" in tok)
    return {k.lower(): int(fields[k]) for k in ("REG", "STACK", "LOCAL") if k in fields}


def _loop_pipelining(ttgir: str) -> tuple[int, int, int]:
    """(loops, unpipelined loops, loops with exposed loads) among a kernel's TTGIR loops that run a tl.dot in their
    own body (not in a nested loop's). A loop is software-pipelined when its body holds asynchronous global-to-
    shared copies: the next iteration's loads are issued while this one computes (a branch around a loop's block
    math, or a loop nested directly in its body, can keep Triton from doing so). A pipelined loop's loads are
    exposed when every wait in its body waits for all outstanding copies (async_wait num = 0): the copies issued
    for the next iteration are then waited for before its dots, so their latency is not hidden behind any (the
    selected dK/dV's per-tile index loads did this: bench/KERNELS.md)."""
    loops: list[dict] = []  # every scf.for, in order
    stack: list[tuple[int, dict]] = []  # (indent, loop) of the loops enclosing the current line
    for line in ttgir.splitlines():
        indent = len(line) - len(line.lstrip())
        while stack and indent <= stack[-1][0]:
            stack.pop()
        if "scf.for" in line:
            loops.append(dict(dot=False, copy=False, waits=[]))
            stack.append((indent, loops[-1]))
        elif stack:
            if _has_dot(line):
                stack[-1][1]["dot"] = True
            if "async_copy_global_to_local" in line:
                stack[-1][1]["copy"] = True
            wait = re.search(r"ttg\.async_wait .*\{num = (\d+)", line)
            if wait:
                stack[-1][1]["waits"].append(int(wait.group(1)))
    with_dot = [lp for lp in loops if lp["dot"]]
    exposed = [lp for lp in with_dot if lp["copy"] and lp["waits"] and max(lp["waits"]) == 0]
    return len(with_dot), sum(not lp["copy"] for lp in with_dot), len(exposed)


def _waits_before_memory(ptx: str) -> bool:
    """Whether a kernel's PTX waits for the launch before it (griddepcontrol.wait, a programmatic dependent launch)
    before its first global memory access: a load, store, atomic or asynchronous copy ahead of the wait could
    meet that launch's data half written."""
    wait = ptx.find("griddepcontrol.wait")
    first_access = min((m.start() for m in re.finditer(r"\b(ld|st|atom|red|cp\.async)\.[a-z.]*global", ptx)),
                       default=len(ptx))
    return 0 <= wait < first_access


def _has_dot(ttgir: str) -> bool:
    """Whether a kernel's TTGIR runs a tl.dot anywhere (in a loop or not)."""
    return "warp_group_dot " in ttgir or "tt.dot " in ttgir


def _sass_loops(sass: str) -> list[dict]:
    """The loops of a kernel's SASS (cuobjdump -sass): each backward branch closes one. Per loop, in program
    order: its instructions per iteration (`instructions`, nested loops counted once), those outside its nested
    loops (`own`), whether it issues a tensor-core dot (HGMMA/HMMA) outside them (`dot`), and its register spill
    loads and stores (LDL/STL, nested loops included: `spills`). Instructions per warp per iteration are what an
    issue-bound loop's time follows: a CPU proxy for a kernel change before a GPU times it. A loop is the span
    from a branch target to the backward branch that reaches it; the compiler may place blocks so that two
    spans overlap without nesting, or a rarely run block of a loop outside its span, so the counts are of
    spans: static, comparable between versions of one loop, not exact per iteration."""
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    at = {addr: i for i, (addr, _) in enumerate(code)}
    spans = []
    for i, (addr, text) in enumerate(code):
        target = re.search(r"\bBRA\b[^;]*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) <= addr and int(target.group(1), 16) in at:
            spans.append((at[int(target.group(1), 16)], i))
    loops = []
    for start, end in sorted(spans):
        nested = [(s, e) for s, e in spans if start <= s and e <= end and (s, e) != (start, end)]
        inner = {i for s, e in nested for i in range(s, e + 1)}
        body = [text for i, (_, text) in enumerate(code[start:end + 1], start) if i not in inner]
        loops.append(dict(instructions=end - start + 1, own=len(body), dot=any("MMA" in t for t in body),
                          spills=sum(bool(re.search(r"\b(LDL|STL)\b", t)) for _, t in code[start:end + 1])))
    return loops


def _wgmma_groups(sass: str) -> tuple[int, int]:
    """(HGMMA instructions, groups) in a kernel's SASS: a tl.dot of depth K is K/16 HGMMAs issued back to back, the
    last marked gsb0 (its group's end, which a WARPGROUP.DEPBAR then waits for). When ptxas cannot keep a chain's
    registers apart it puts every HGMMA in a group of its own and waits for each (no warning printed): each k-step
    then waits for the one before, not only each dot for the one it needs. Groups == HGMMAs (above one per dot) is
    that case."""
    hgmma = [ln for ln in sass.splitlines() if re.search(r"\bHGMMA\.", ln)]
    return len(hgmma), sum("gsb0" in ln for ln in hgmma)


def _loop_text(loop: dict) -> str:
    """One loop of the --sass-loops table: instructions (outside nested loops), * for a dot, [n spill] for spills."""
    spills = f" [{loop['spills']} spill]" if loop["spills"] else ""
    return f"{loop['instructions']} ({loop['own']}){'*' if loop['dot'] else ''}{spills}"


def _sass(cubin: bytes) -> str:
    proc = _cuobjdump(cubin, "-sass")
    if proc.returncode != 0 or "/*0000*/" not in proc.stdout:  # no listing: the loop checks would see nothing
        raise RuntimeError(f"cuobjdump -sass failed (exit {proc.returncode}): {proc.stderr[-500:]}")
    return proc.stdout


_LAUNCHES: list = []  # (arch, scenario, name, fn, args, kwargs); filled before the worker pool forks
_SASS_LOOPS: set | None = set()  # --sass-loops: the archs whose SASS loops are counted (None: every one)
_SASS_CHECKED_ONLY = False  # --sass-checked-only: ... and of those, the launches the compile tests check


def _compile_one(i):
    arch, scenario, name, fn, args, kwargs = _LAUNCHES[i]
    import triton
    from triton.compiler import ASTSource

    res = dict(scenario=scenario, kernel=name, arch=arch, triton=triton.__version__,
               constexprs={k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages", "enable_fp_fusion")})
    t0 = time.time()
    try:
        target, options, signature, constexprs, attrs = _specialize(fn, args, kwargs, arch)
        kern = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
        res.update(ok=True, shared=kern.metadata.shared, num_warps=options.num_warps,
                   # FMA contraction as compiled: the launch's request, else Triton's default (TRITON_DEFAULT_FP_FUSION)
                   fp_fusion=bool(options.enable_fp_fusion),
                   # a programmatic dependent launch, and whether the kernel waits for the launch before it
                   launch_pdl=bool(getattr(kern.metadata, "launch_pdl", False)),
                   waits_for_previous_launch=_waits_before_memory(kern.asm["ptx"]),
                   # global atomics by width: 4-wide (one instruction per 16 bytes) and scalar
                   atomics_v4=len(re.findall(r"\b(?:red|atom)\.global\S*\.v4\.", kern.asm["ptx"])),
                   atomics_scalar=len(re.findall(r"\b(?:red|atom)\.global(?:(?!\.v[248]\.)\S)*\s", kern.asm["ptx"])),
                   **dict(zip(("dot_loops", "unpipelined_dot_loops", "exposed_dot_loops"),
                              _loop_pipelining(kern.asm["ttgir"]))),
                   **_resources(kern.asm["cubin"]))
        # --sass-checked-only: a disassembly costs ~0.6 CPU-s whatever the kernel's size, so only where
        # tests/test_triton_compile.py reads it (a dot's loops and HGMMA groups, or a stack frame's spills)
        checked = _has_dot(kern.asm["ttgir"]) or res.get("stack", 0) + res.get("local", 0) > 0
        if (_SASS_LOOPS is None or arch in _SASS_LOOPS) and (checked or not _SASS_CHECKED_ONLY):
            sass = _sass(kern.asm["cubin"])
            res["sass_loops"] = _sass_loops(sass)
            res["hgmma"], res["hgmma_groups"] = _wgmma_groups(sass)
    except Exception as exc:  # reported per launch, so the failing kernel and shape are named
        res.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[-2000:]}")
    res["seconds"] = round(time.time() - t0, 2)
    return res


# Integer kernels without dots or shared-memory tiles (the per-query intervals, the dK/dV query ranges, the pair
# index): their code depends on a few sizes only, so they compile at the 125M layout's two shapes (one query chunk
# and one pair-index pass; several of each) and not again at every layout (CI time)
METADATA_KERNELS = {"_layout_kernel", "_range_scan_kernel", "_range_search_kernel", "_sel_pair_key_kernel",
                    "_sel_pair_offsets_kernel", "_sel_heavy_keys_kernel", "_sel_heavy_pieces_kernel"}
METADATA_SCENARIOS = ("125M-G6-d64-bf16", "125M-G6-d64-bf16-long")


def collect(arch: int, scenarios=None) -> list:
    """Unique launches the launchers make on an sm_<arch> device over the scenarios: one per (kernel,
    specialization) signature; METADATA_KERNELS at METADATA_SCENARIOS only, the opt-in variants on
    OPT_IN_VARIANT_ARCHS only."""
    launches, seen = [], set()
    with as_arch(arch):
        for sname in scenarios or SCENARIOS:
            if sname in OPT_IN_VARIANT_SCENARIOS and arch not in OPT_IN_VARIANT_ARCHS:
                continue
            for name, fn, args, kwargs in capture_launches(SCENARIOS[sname]):
                if name in METADATA_KERNELS and sname not in METADATA_SCENARIOS:
                    continue
                key_args = tuple((str(a.dtype), a.dim()) if torch.is_tensor(a) else type(a).__name__ for a in args)
                key = (name, key_args, tuple(sorted(kwargs.items())))
                if key not in seen:
                    seen.add(key)
                    launches.append((sname, name, fn, args, kwargs))
    return launches


# Ampere's two targets: sm_86 (and sm_89's launches, the same) lowers a launch exactly as sm_80 does (mma.sync,
# cp.async; the PTX differs in its .target line), so a launch the launchers size identically on both (same
# constexprs, warps, stages and argument specialization: the tiles the 99 KiB of shared memory did not shrink) has
# the same TTGIR, PTX and shared memory, and the sm_80 compile stands for both. Its row is the sm_80 row under
# sm_86's arch and scenario, with same_as_arch = 80 and without what ptxas decides per target (registers, stack:
# nothing checks them on sm_86). On 2026-12-02, 118 of sm_86's 132 launches were such twins; compiled separately,
# every one had the same shared memory, loops and pipelining as its sm_80 twin (registers and 3 stack frames
# differed), and skipping them cut this job from 1,048 to 864 CPU-s.
SAME_CODE_AS = {86: 80}
PER_TARGET_FIELDS = ("reg", "stack", "local")


def _specialization(launch) -> str | None:
    """What triton compiles a launch from besides the target: the kernel, its argument specialization (dtypes,
    16-divisibility, constants), constexprs and options, bound for sm_80 (the same for every Ampere target). None
    where the binding fails: the launch then compiles on its own, which reports the error with its name and shape."""
    _, _, name, fn, args, kwargs = launch
    try:
        _, options, signature, constexprs, attrs = _specialize(fn, args, kwargs, 80)
    except Exception:
        return None
    return repr((name, signature, sorted(constexprs.items(), key=repr), sorted(attrs.items(), key=repr),
                 sorted(options.__dict__.items())))


def _ampere_twins(launches) -> tuple[list[int], dict[int, int]]:
    """(indices to compile, {index: the index whose compile stands for it}): an sm_86 launch with the specialization
    of a requested sm_80 launch is not compiled again (SAME_CODE_AS)."""
    by_spec = {}
    for i, launch in enumerate(launches):
        if launch[0] in SAME_CODE_AS.values() and (spec := _specialization(launch)) is not None:
            by_spec.setdefault((launch[0], spec), i)
    same_as = {}
    for i, launch in enumerate(launches):
        twin_arch = SAME_CODE_AS.get(launch[0])
        if twin_arch is not None and (spec := _specialization(launch)) is not None and (twin_arch, spec) in by_spec:
            same_as[i] = by_spec[(twin_arch, spec)]
    return [i for i in range(len(launches)) if i not in same_as], same_as


def _seconds_text(row: dict) -> str:
    """The table's last column: the compile's seconds, or which architecture's compile stands for the launch."""
    return f"(sm_{row['same_as_arch']}'s code)" if "same_as_arch" in row else str(row["seconds"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, nargs="*", default=[90, 80, 86],
                    help="compute capabilities (90 H100, 80 A100, 86 RTX 3090 / A10: 99 KiB shared memory)")
    ap.add_argument("--scenarios", nargs="*", default=None, choices=list(SCENARIOS))
    ap.add_argument("--kernels", nargs="*", default=None, help="only these kernel names (default: all)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--sass-loops", nargs="*", type=int, default=None, metavar="ARCH",
                    help="also print each kernel's SASS instructions per loop iteration (in program order; in "
                         "parentheses those outside nested loops; * issues a tensor-core dot; [n spill]: spill loads "
                         "and stores in the loop), for the archs named (none named: every --arch)")
    ap.add_argument("--sass-checked-only", action="store_true",
                    help="--sass-loops only for the launches with a dot or a stack frame (what the CI checks read)")
    args = ap.parse_args()
    global _SASS_LOOPS
    _SASS_LOOPS = set() if args.sass_loops is None else set(args.sass_loops) or None
    global _SASS_CHECKED_ONLY
    _SASS_CHECKED_ONLY = args.sass_checked_only
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("triton_aot.py compiles real kernels: unset TRITON_INTERPRET")
    for arch in args.arch:
        _LAUNCHES.extend((arch, *x) for x in collect(arch, args.scenarios) if not args.kernels or x[1] in args.kernels)
    compiled, same_as = _ampere_twins(_LAUNCHES)
    import multiprocessing

    with ProcessPoolExecutor(max_workers=args.workers, mp_context=multiprocessing.get_context("fork")) as pool:
        results = dict(zip(compiled, pool.map(_compile_one, compiled)))
    for i, twin in same_as.items():  # the sm_86 launches the sm_80 compile stands for
        arch, scenario = _LAUNCHES[i][:2]
        shared_code = {k: v for k, v in results[twin].items() if k not in PER_TARGET_FIELDS}
        results[i] = dict(shared_code, arch=arch, scenario=scenario, seconds=0.0, same_as_arch=_LAUNCHES[twin][0])
    results = [results[i] for i in range(len(_LAUNCHES))]
    print("| arch | kernel | scenario | warps | regs | spill (stack/local B) | smem KiB | dot loops (unpipelined, "
          "loads exposed) | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if r["ok"]:
            print(f"| sm_{r['arch']} | {r['kernel']} | {r['scenario']} | {r['num_warps']} | {r.get('reg', '?')} | "
                  f"{r.get('stack', '?')}/{r.get('local', '?')} | {r['shared'] / 1024:.0f} | "
                  f"{r['dot_loops']} ({r['unpipelined_dot_loops']}, {r['exposed_dot_loops']}) | "
                  f"{_seconds_text(r)} |")
        else:
            print(f"| sm_{r['arch']} | {r['kernel']} | {r['scenario']} | FAILED: {r['error'][:300]} |")
    if args.sass_loops is not None:
        print("\n| arch | kernel | scenario | SASS instructions per loop iteration |\n|---|---|---|---|")
        for r in results:
            if r["ok"] and r.get("sass_loops"):
                loops = ", ".join(_loop_text(lp) for lp in r["sass_loops"])
                print(f"| sm_{r['arch']} | {r['kernel']} | {r['scenario']} | {loops} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("RESULTS_JSON=" + json.dumps(results))


if __name__ == "__main__":
    main()
