"""Random cases of the Triton NSA kernels against the PyTorch reference: a seeded, replayable fuzzer.

    python bench/fuzz_kernels.py [--seed 0] [--start 0] [--cases 20] [--budget-s SECONDS] [--kind mixed]
                                 [--size full] [--case-limit-s 300] [--log FILE.jsonl] [--device auto]
    python bench/fuzz_kernels.py --case '<json>'      # replay one case an earlier run printed or logged

The suite's kernel cases (tests/test_triton_kernels.py) are chosen by hand; this draws them at random over what
the kernels accept, to find the combinations nobody thought of (one such search found a top-n read past the
compressed keys: the case "found by a randomized search" there). A case varies:

- G in {1, ..., 8, 16} query heads per KV head (3, 5, 6 and 7 not powers of two), 1-3 KV heads, head_dim 16-128,
  1-3 rows; odd and even lengths, one document per row, packed documents ("varlen": position ids restarting) or
  padding on both sides ("pad"); fp32 and fp16 (bf16 and fp16 on a GPU);
- the NSA parameters: l' in {16, 32, 64}, any power-of-two stride d dividing l', l a multiple of d up to l',
  n from 1 to 16 with 0 to n forced initial and local blocks, windows from 1 key to none at all; and, in a few
  cases, values off that grid (l not a multiple of d, more forced blocks than n), which NSAConfig or the kernels
  must refuse;
- on a CPU, A100's launch tiles in some cases (the launchers take sm_80's configuration: `arch` 80);
- in a fifth of the fp16 training cases, gates near 5e-5 (the backward's gate-scaled products below fp16's normal
  range), their gradients judged relative to a floor as small as the gates;
- in 35% of the cases, one to three launch choices forced (modeling_nsa's LaunchOverrides, as the suite's cases
  force them: the untimed opt-in schedules, the orders and index widths kept from before, small chunks, splits
  and tiles), which change how the work is scheduled and must not change the result;
- decoding after a cache (`--kind decode`, or 30% of `mixed`): one query per step, eager or on a static
  cache (NSACache(static=True)'s layout: full-length buffers, the window a ring), or a chunk of 3 or 5 queries
  (chunked prefill, speculative verification); the window cache holding the last w + chunk - 1 keys or every key
  (an assisted-decoding crop), and the cache's tensors as views of larger buffers.

Two profiles share the cases: "wide" spreads every choice as above; "many_blocks" takes small selection blocks
(l' in {16, 32}), windows at key-tile and block edges (15-17, 31-33, 63-65, 127-129) and, where the heads are
cheap, rows of 151-299 tokens, so that a row holds many blocks and the top-n lists and the window's tile runs
are exercised. Decoding cases take rows 8 times longer (a step is one query, or a chunk, against its cache):
compressed slots over several of the decode kernels' splits, top-n over several block ranges.

A case is drawn from (seed, index) alone, so index I of a run is drawn again by `--seed S --start I --cases 1`
with the same --kind, --size and --device, and any case runs again from the JSON the run prints (`--case`).

Each case runs tests/triton_helpers.py's run_case (forward, top-n selection and the eight input gradients
against the fp32 reference run on the kernel's selection) or run_decode_case (every step against the reference),
with the suite's interpreter checks (every load and store inside its tensors, no race between programs,
launcher buffers poisoned with NaN), and is judged by tests/test_triton_kernels._check at the suite's
tolerances (CPU: 1e-4 in fp32, 2e-3 in fp16; GPU: 1e-2, the GPU tests'). A low-precision attention case that
fails gets a second look: its gradients against the exact ones plus what the backward's rounding of each branch's
stored output adds (triton_helpers.flash_rounding_terms: delta = dout . o from the rounded o, as FlashAttention's
backward takes it, moves the dQ of a query with a few nearly equal keys past the tolerance), measured in the same
run; only the gradient checks are relaxed, and a pass there is named on its line and counted at the end.
Verdicts: pass; FAIL (a check failed or the op raised); refused (NSAConfig or triton_unsupported_reason rejects the
parameters: nothing runs); timeout (over --case-limit-s). The exit status is 1 if a case FAILed (each FAIL's
replay command is printed), 0 otherwise: timeouts are listed with their replay commands but do not fail the run.

Device: without CUDA (or with TRITON_INTERPRET=1 set) the kernels run under Triton's interpreter on the CPU, the
way the suite runs them. With CUDA the cases run on the GPU (run_case's "device": "cuda", as the suite's GPU
tests do), in bf16 and fp16 at the GPU tests' tolerance and on the GPU's own launch configuration. The GPU path
has not been run yet: the session that wrote this had no GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shlex
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import triton_helpers  # noqa: E402  (imports torch only: the kernels load after the device is chosen)

KINDS = ("attention", "decode", "mixed")
SIZES = ("full", "small")
DECODE_SHARE = 0.3  # of --kind mixed
PROFILES = {"wide": 1, "many_blocks": 1}  # profile -> weight

HEAD_GROUPS = (1, 2, 3, 4, 5, 6, 7, 8, 16)  # G
HEAD_DIMS = {16: 6, 32: 2, 64: 2, 128: 1}  # head_dim -> weight
BATCHES = {1: 2, 2: 1, 3: 1}
LAYOUTS = ("single", "varlen", "pad")
ODD_LENGTH_SHARE = 0.8  # odd lengths end inside every tile and block; the rest take any length
FP16_SHARE = 0.25  # on a CPU; on a GPU bf16 and fp16 half each
# fp16 cases with gates near 5e-5 (logits N(-10, 1)): the backward's products of gates and probabilities fall
# below fp16's normal range unless the kernels scale them (nsa_triton_common.FP16_DV_SCALE). The gradients are then
# as small as the gates, so their errors are taken relative to a floor as small (rel_floor: the suite's 1e-2 RMS
# floor times the gate), not to the suite's absolute one, which they would pass whatever the kernels computed
SMALL_GATE_SHARE = 0.2  # of fp16 cases
SMALL_GATE_LOGIT = -10.0
SMALL_GATE_REL_FLOOR = 1e-2 / (1 + math.exp(-SMALL_GATE_LOGIT))  # 1e-2 x sigmoid(-10) = 4.5e-7

# The interpreter's cost grows with rows x heads x head_dim x length: a case's length is capped by its "work"
# (rows x query heads x head_dim), so that most cases take seconds and the largest about a minute on one core.
LENGTH_CAPS = ((128, 300), (512, 160), (2048, 90), (float("inf"), 48))  # (work up to, longest length)
SMALL_LENGTH_CAP = 40  # --size small: head_dim 16, at most 2 rows and 2 KV heads, a second or two a case
MANY_BLOCKS_MAX_WORK = 64  # "many_blocks" rows of 151-299 tokens where the work is at most this
MANY_BLOCKS_LENGTHS = (151, 299)  # (odd lengths from, to)
# a decoding step runs one query (or a chunk) against its cache, so decode cases afford rows this many times longer:
# compressed slots over several of the decode kernels' splits, top-n over several block ranges
DECODE_LENGTH_FACTOR = 8

SEL_BLOCK_SIZES = {16: 2, 32: 1, 64: 1}  # l' -> weight ("wide")
MANY_BLOCKS_SEL_BLOCK_SIZES = {16: 2, 32: 1}
STRIDES = (1, 2, 4, 8, 16, 32, 64)  # d: those dividing l' (powers of two, l'/d a power of two)
MANY_BLOCKS_MAX_STRIDE = 16  # "many_blocks": several compressed tokens per block
BLOCKS_PER_COMPRESSED_TOKEN = {1: 2, 2: 2, 3: 1, 4: 1, 8: 1}  # l / d -> weight (capped by l <= l')
WHOLE_BLOCK_COMPRESSION_SHARE = 0.15  # l = l'
SEL_NUM_BLOCKS = {1: 2, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 8: 1, 16: 1}  # n -> weight ("wide")
MANY_BLOCKS_SEL_NUM_BLOCKS = (1, 2, 4, 5, 7, 8, 12, 16)
NO_WINDOW_LIMIT = 10**6  # a window longer than any row: every earlier key of the document
TILE_EDGE_WINDOWS = (15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129)
OFF_GRID_SHARE = 0.08  # cases whose parameters may be invalid: the validation must refuse them, not crash

DECODE_CHUNKS = {1: 3, 3: 1, 5: 1}  # queries per step -> weight
STATIC_CACHE_SHARE = 0.3  # of one-query decoding whose window ring is small enough (below)
STATIC_RING_MAX = 512  # a static cache's window ring holds w slots: no ring for windows past this
ALL_KEYS_WINDOW_CACHE_SHARE = 0.5  # eager decoding whose window cache holds every key, not the last w + chunk - 1
CACHE_VIEWS_SHARE = 0.5  # eager decoding on views of larger buffers (as NSACache passes them)
DECODE_STEPS = {"full": 3, "small": 2}  # random cache lengths per case, besides the full row
A100_TILES_SHARE = 0.2  # CPU cases run with sm_80's launch configuration

# Launch choices (modeling_nsa's LaunchOverrides, as the suite's cases force them): they change how the work is
# scheduled, never the result, so a case run under them must pass as under the defaults. In LAUNCH_CHOICE_SHARE of
# the cases, 1 to LAUNCH_CHOICES_MAX of them, each at a value the launchers take at any shape: the opt-in
# schedules not yet timed (pair-wise selected dQ and forward, split dQ), the orders and index widths kept from
# before, and small chunks, splits and tiles that give tiny rows many of them.
LAUNCH_CHOICE_SHARE = 0.35
LAUNCH_CHOICES_MAX = 3
ATTENTION_LAUNCH_CHOICES = {  # case key -> values (bj, split: tests/triton_helpers.CASE_KEY_FIELDS)
    "sel_dq_in_dkdv": (True,), "sel_fwd_pairs": (True,), "sel_fwd_pair_queries": (7, 9, 13),
    "sel_dq_pairs": (True,), "sel_dq_split": (True,), "sel_union_wide_keys": (True,), "query_tiles_light_first": (True,),
    "offsets_int64": (True,), "sel_pairs_int64": (True,), "sel_dkdv_ranges_first": (True,),
    "dkdv_key_tiles_fast": (True,), "sel_dkdv_chunk_pairs": (0, 12, 20), "range_chunk": (16, 32),
    "topn_insert_max": (0, 1, 8), "bj": (2, 4), "split": (2, 3), "sel_pieces": ([5, 3, 64, 32], [5, 3, 2, 1]),
}  # fmt: skip
DECODE_LAUNCH_CHOICES = {
    "decode_parts": (True, False), "decode_fused_combine": (1,), "decode_split": (16, 32), "decode_topn_blocks": (3, 16),
    "decode_topn_offsets": (1,), "decode_sel_step": (2, 4), "decode_win_tile": (16,), "decode_sel_part": (4,),
    "decode_win_part": (32,), "decode_merge_splits": (2,), "decode_merge_lists": (2,),
}  # fmt: skip
GPU_DECODE_LAUNCH_CHOICES = {"decode_pdl": (1,)}  # (programmatic dependent launches: a GPU's, from sm_90)
# a choice that acts only with another: the second is set with it
LAUNCH_CHOICE_NEEDS = {"sel_fwd_pair_queries": ("sel_fwd_pairs", True), "decode_fused_combine": ("decode_parts", True)}

CPU_TOLERANCE = {"float32": 1e-4, "float16": 2e-3}  # tests/test_triton_kernels.py's interpreter cases
GPU_TOLERANCE = 1e-2  # its GPU cases (bf16 and fp16)
DEFAULT_CASES = 20  # without --budget-s
DEFAULT_CASE_LIMIT_S = 300.0  # the slowest cases take about a minute on one core


@dataclasses.dataclass
class FuzzCase:
    seed: int | None  # None: a replayed case (--case)
    index: int | None
    profile: str | None
    case: dict  # what triton_helpers.run_case / run_decode_case take


@dataclasses.dataclass
class Outcome:
    verdict: str  # "pass", "FAIL", "refused", "timeout"
    message: str  # why it FAILed, was refused or timed out ("" for a pass)
    errors: dict  # the runner's relative errors (empty unless it ran to the end)
    seconds: float


def _weighted(rng: random.Random, table: dict):
    values, weights = zip(*table.items())
    return rng.choices(values, weights)[0]


def _draw_length(rng: random.Random, work: int, profile: str, kind: str, size: str) -> int:
    """A row length for a case of this work (rows x query heads x head_dim)."""
    factor = DECODE_LENGTH_FACTOR if kind == "decode" else 1
    if size == "small":
        cap = SMALL_LENGTH_CAP
    elif profile == "many_blocks" and work <= MANY_BLOCKS_MAX_WORK:
        first, last = MANY_BLOCKS_LENGTHS
        return rng.randint(first * factor, last * factor) | 1  # odd: the row ends inside a block
    else:
        cap = factor * next(cap for most_work, cap in LENGTH_CAPS if work <= most_work)
    return rng.randrange(1, cap + 1, 2) if rng.random() < ODD_LENGTH_SHARE else rng.randint(1, cap)


def _draw_params(rng: random.Random, length: int, profile: str) -> dict:
    """NSA parameters on the grid the kernels take (triton_unsupported_reason), valid for NSAConfig; then, in
    OFF_GRID_SHARE of the cases, one value moved off that grid (which may still be valid: l = d, say)."""
    many_blocks = profile == "many_blocks"
    sel_block = _weighted(rng, MANY_BLOCKS_SEL_BLOCK_SIZES if many_blocks else SEL_BLOCK_SIZES)
    largest_stride = min(sel_block, MANY_BLOCKS_MAX_STRIDE) if many_blocks else sel_block
    stride = rng.choice([d for d in STRIDES if d <= largest_stride])
    fitting = {k: weight for k, weight in BLOCKS_PER_COMPRESSED_TOKEN.items() if stride * k <= sel_block}
    cmp_block = stride * _weighted(rng, fitting)
    if rng.random() < WHOLE_BLOCK_COMPRESSION_SHARE:
        cmp_block = sel_block
    if many_blocks:
        num_blocks = rng.choice(MANY_BLOCKS_SEL_NUM_BLOCKS)
        init = min(rng.choice((0, 1, 2)), num_blocks)
        local = min(rng.choice((0, 1, 2, 3)), num_blocks - init)
        window = rng.choice(TILE_EDGE_WINDOWS + (1, rng.randint(1, length)))
    else:
        num_blocks = _weighted(rng, SEL_NUM_BLOCKS)
        init = min(rng.choice((0, 0, 1, 1, 2, num_blocks)), num_blocks)  # (num_blocks: every slot forced)
        local = min(rng.choice((0, 0, 1, 2, 3, num_blocks)), num_blocks - init)
        # tiny windows, one key short of a compressed token and of half a selection block, short ones, any up to
        # past the row's end, the row exactly, none
        window = rng.choice((1, 2, 3, max(1, cmp_block - 1), max(1, sel_block // 2 - 1), rng.randint(1, 40),
                             rng.randint(1, length + 20), length, NO_WINDOW_LIMIT))
    if rng.random() < OFF_GRID_SHARE:
        off_grid = rng.choice(("cmp_block_size", "sel_block_size", "forced_blocks"))
        if off_grid == "cmp_block_size":  # not a multiple of d, or longer than l'
            cmp_block = rng.randint(1, 2 * sel_block)
        elif off_grid == "sel_block_size":  # not a power of two
            sel_block = rng.choice((24, 48, 96))
        else:  # more forced blocks than n
            local = num_blocks - init + 1
    return dict(cmp_block_size=cmp_block, cmp_stride=stride, sel_block_size=sel_block, sel_num_blocks=num_blocks,
                sel_init_blocks=init, sel_local_blocks=local, window_size=window)


def _draw_decode(rng: random.Random, case: dict, size: str) -> None:
    """Make `case` a decoding case (run_decode_case's keys)."""
    length = case["T"] = max(case["T"], 2)
    chunk = _weighted(rng, DECODE_CHUNKS)
    if chunk > length:
        chunk = 1
    steps = {length} | {rng.randint(chunk, length) for _ in range(DECODE_STEPS[size])}
    case.update(kind="decode", steps=sorted(steps))
    window = case["param_overrides"]["window_size"]
    if chunk > 1:
        case["chunk"] = chunk
    elif window <= STATIC_RING_MAX and rng.random() < STATIC_CACHE_SHARE:
        case["static"] = True  # (the helper's ring has w slots, as NSACache(static=True)'s)
        return
    if rng.random() < ALL_KEYS_WINDOW_CACHE_SHARE:
        case["Tw"] = length
    if rng.random() < CACHE_VIEWS_SHARE:
        case["cache_views"] = True


def draw_case(seed: int, index: int, kind: str = "mixed", size: str = "full", device: str = "cpu") -> FuzzCase:
    """Case `index` of seed `seed`: a function of (seed, index, kind, size, device) alone (a string-seeded
    random.Random, which hashes the same in every process), whatever was drawn before it."""
    if kind not in KINDS or size not in SIZES:
        raise ValueError(f"kind must be one of {KINDS} and size one of {SIZES}, got {kind!r}, {size!r}")
    rng = random.Random(f"fuzz_kernels:{seed}:{index}")
    if kind == "mixed":
        kind = "decode" if rng.random() < DECODE_SHARE else "attention"
    profile = _weighted(rng, PROFILES)
    small = size == "small"
    group = rng.choice(HEAD_GROUPS)
    if group >= 8:
        kv_heads = 1
    else:
        kv_heads = rng.choice((1, 1, 2, 3) if group <= 4 else (1, 2))
    if small:
        kv_heads = min(kv_heads, 2)
    head_dim = 16 if small else _weighted(rng, HEAD_DIMS)
    batch = min(_weighted(rng, BATCHES), 2 if small else 3)
    length = _draw_length(rng, batch * group * kv_heads * head_dim, profile, kind, size)
    layout = rng.choice(LAYOUTS)
    if device == "cuda":
        dtype = rng.choice(("bfloat16", "float16"))
    else:
        dtype = "float16" if rng.random() < FP16_SHARE else "float32"
    case = dict(B=batch, T=length, H=group * kv_heads, Hkv=kv_heads, D=head_dim, layout=layout, dtype=dtype,
                param_overrides=_draw_params(rng, length, profile), seed=rng.randrange(10**6))
    small_gates = rng.random() < SMALL_GATE_SHARE  # (drawn for every case: the draws after it stay in step)
    if dtype == "float16" and small_gates and kind != "decode":
        case.update(gate_logit=SMALL_GATE_LOGIT, rel_floor=SMALL_GATE_REL_FLOOR)
    if device == "cuda":
        case["device"] = "cuda"
    elif rng.random() < A100_TILES_SHARE:
        case["arch"] = 80
    if kind == "decode":
        _draw_decode(rng, case, size)
    if rng.random() < LAUNCH_CHOICE_SHARE:
        _draw_launch_choices(rng, case)
    return FuzzCase(seed, index, profile, case)


def _draw_launch_choices(rng: random.Random, case: dict) -> None:
    """Force 1 to LAUNCH_CHOICES_MAX launch choices in `case`: a decoding step's, or (a training case, or a chunk of
    queries after a cache, which runs the training forward's kernels) the training kernels'."""
    table = {}
    if case.get("kind") == "decode":
        table |= DECODE_LAUNCH_CHOICES | (GPU_DECODE_LAUNCH_CHOICES if case.get("device") == "cuda" else {})
    if case.get("kind") != "decode" or case.get("chunk", 1) > 1:
        table |= ATTENTION_LAUNCH_CHOICES
    for key in rng.sample(sorted(table), rng.randint(1, LAUNCH_CHOICES_MAX)):
        case[key] = rng.choice(table[key])
        if key in LAUNCH_CHOICE_NEEDS:
            needed, value = LAUNCH_CHOICE_NEEDS[key]
            case[needed] = value


def refusal(case: dict) -> str | None:
    """Why the case is not run (None: it runs): its parameters fail NSAConfig's validation, or the kernels do not
    take them (triton_unsupported_reason, for the case's GPU where it has one)."""
    from modeling_nsa import NSAConfig

    layout, _, tri = triton_helpers.import_nsa()
    base = triton_helpers.TINY if case.get("params", "tiny") == "tiny" else triton_helpers.DEFAULT  # (case_setup's)
    params = {**base, **case.get("param_overrides", {})}
    try:
        NSAConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=64, vocab_size=128,
                  num_attention_heads=case["H"], num_key_value_heads=case["Hkv"], head_dim=case["D"], **params)
    except ValueError as exc:
        return f"NSAConfig: {exc}"
    device = torch.device(case["device"]) if case.get("device", "cpu") != "cpu" else None
    reason = tri.triton_unsupported_reason(layout.NSAParams(**params), case["D"], device)
    return f"kernels: {reason}" if reason else None


def tolerance(case: dict) -> float:
    if "tol" in case:
        return case["tol"]
    if case.get("device", "cpu") != "cpu":
        return GPU_TOLERANCE
    return CPU_TOLERANCE[case.get("dtype", "float32")]


class CaseTimeout(BaseException):
    """Raised by the per-case alarm. A BaseException, so that the interpreter's `except Exception` (which wraps
    a kernel's error in an InterpreterError) lets it through, while its `finally` still restores triton.language
    for the next case."""


def run_one(case: dict, limit_s: float) -> Outcome:
    """Run and judge one case that passed `refusal`."""
    from test_triton_kernels import _check  # (imports triton: only once the device is chosen)

    runner = triton_helpers.run_decode_case if case.get("kind") == "decode" else triton_helpers.run_case
    alarm = {"rang": False}

    def on_alarm(signum, frame):
        alarm["rang"] = True  # (raised inside an autograd backward, it may come out of torch re-typed)
        raise CaseTimeout

    started = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    # a low-precision attention case is also measured against the exact gradients plus what the backward's rounding
    # of the stored outputs adds (triton_helpers.flash_rounding_terms: <grad>_rounded), for the second look below
    low_precision = case.get("dtype", "float32") != "float32" and case.get("kind") != "decode"
    try:
        result = runner(dict(case, judge_rounding=True) if low_precision else case)
    except (CaseTimeout, Exception) as exc:  # the op raising is the case's FAIL, not the fuzzer's
        if alarm["rang"]:
            return Outcome("timeout", f"over {limit_s:g} s", {}, round(time.perf_counter() - started, 2))
        result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    seconds = round(time.perf_counter() - started, 2)
    errors = {name: (round(value, 8) if isinstance(value, float) else value)
              for name, value in result.items() if name not in ("error", "trace")}
    exact = {name: value for name, value in result.items() if not name.endswith("_rounded")}
    try:
        _check(exact, case, tolerance(case))
    except AssertionError as exc:
        # the second look, on the same run: a gradient outside the tolerance of the exact one but within it of the
        # exact one plus the rounding's terms (a few-key query's dQ is a difference that rounding moves); _check
        # relaxes nothing else (the output, the selection)
        if exact != result:
            try:
                _check(result, case, tolerance(case))
            except AssertionError:
                pass
            else:
                return Outcome("pass", "within the rounding of the stored outputs (flash_rounding_terms)", errors,
                               seconds)
        return Outcome("FAIL", str(exc)[-3000:] or "a check failed", errors, seconds)
    return Outcome("pass", "", errors, seconds)


def judge(fuzz_case: FuzzCase, limit_s: float) -> Outcome:
    reason = refusal(fuzz_case.case)
    if reason:
        return Outcome("refused", reason, {}, 0.0)
    return run_one(fuzz_case.case, limit_s)


def replay_command(case: dict) -> str:
    script = Path(__file__).resolve()
    try:
        shown = script.relative_to(Path.cwd().resolve())
    except ValueError:
        shown = script
    return f"python {shown} --case {shlex.quote(json.dumps(case))}"


_KERNEL_CHECKS_INSTALLED = False


def prepare_kernels(device: str) -> None:
    """Choose how the kernels run before triton is imported (it reads TRITON_INTERPRET when a kernel is defined),
    then install the suite's checks (poisoned buffers; under the interpreter the access checks), once."""
    global _KERNEL_CHECKS_INSTALLED
    if _KERNEL_CHECKS_INSTALLED:
        return
    if device == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("fuzz_kernels: triton was imported before TRITON_INTERPRET=1 was set; run the CPU "
                             "cases in a process of their own (TRITON_INTERPRET=1 python bench/fuzz_kernels.py)")
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        raise SystemExit("fuzz_kernels: a case on cuda, and no CUDA device here")
    elif os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("fuzz_kernels: cases on cuda with TRITON_INTERPRET=1 (the interpreter runs on the CPU)")
    triton_helpers.check_kernels_as_on_a_gpu()
    _KERNEL_CHECKS_INSTALLED = True


def resolve_device(requested: str) -> str:
    if requested != "auto":
        return requested
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return "cpu"
    return "cuda"


def describe(case: dict) -> str:
    from test_triton_kernels import _case_id  # (the suite's case names)

    return _case_id(case)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Each case is a function of (seed, index, --kind, --size, --device).")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (default: 0)")
    parser.add_argument("--start", type=int, default=0, help="the first case's index (default: 0)")
    parser.add_argument("--cases", type=int, default=None,
                        help=f"how many cases, refused ones included (default: {DEFAULT_CASES}; with --budget-s: "
                             "as many as the budget allows)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no case after this many seconds (default: none, --cases decides)")
    parser.add_argument("--kind", choices=KINDS, default="mixed",
                        help=f"attention (training forward and backward), decode (after a cache) or mixed "
                             f"(decode in {DECODE_SHARE * 100:.0f}%% of the cases) (default: mixed)")
    parser.add_argument("--size", choices=SIZES, default="full",
                        help=f"full: lengths up to {LENGTH_CAPS[0][1]} ({DECODE_LENGTH_FACTOR}x that decoding) and "
                             f"head_dim up to 128; small: head_dim 16, "
                             f"at most 2 rows and 2 KV heads, lengths up to {SMALL_LENGTH_CAP} (default: full)")
    parser.add_argument("--case-limit-s", type=float, default=DEFAULT_CASE_LIMIT_S,
                        help=f"a case still running after this many seconds is stopped and reported as a timeout "
                             f"(default: {DEFAULT_CASE_LIMIT_S:g})")
    parser.add_argument("--log", type=Path, default=None,
                        help="append one JSON line per case (seed, index, profile, case, verdict, message, "
                             "errors, seconds) to this file (default: none)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="cpu: Triton's interpreter; cuda: the GPU; auto: cuda where CUDA is available and "
                             "TRITON_INTERPRET is not 1, else cpu (default: auto)")
    parser.add_argument("--case", type=json.loads, default=None, metavar="JSON",
                        help="run this one case (as printed or logged by a run) instead of drawing cases; "
                             "its own \"device\" key decides where (default: none)")
    args = parser.parse_args(argv)
    if args.cases is None and args.budget_s is None:
        args.cases = DEFAULT_CASES
    return args


def _cases_to_run(args, device: str):
    if args.case is not None:
        yield FuzzCase(None, None, None, args.case)
        return
    index = args.start
    while args.cases is None or index < args.start + args.cases:
        yield draw_case(args.seed, index, args.kind, args.size, device)
        index += 1


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.case.get("device", "cpu") if args.case is not None else resolve_device(args.device)
    prepare_kernels(device)
    started = time.monotonic()
    counts = {"pass": 0, "FAIL": 0, "refused": 0, "timeout": 0}
    to_replay = []  # (verdict, case) of the FAILs and timeouts
    second_looks = 0  # low-precision passes within the rounding of the stored outputs only (run_one)
    log = args.log.open("a") if args.log else None
    try:
        for fuzz_case in _cases_to_run(args, device):
            if args.budget_s is not None and time.monotonic() - started >= args.budget_s:
                break
            outcome = judge(fuzz_case, args.case_limit_s)
            counts[outcome.verdict] += 1
            second_looks += outcome.verdict == "pass" and bool(outcome.message)
            where = "case" if fuzz_case.index is None else f"{fuzz_case.index:5d}"
            why = f" ({outcome.message})" if outcome.verdict == "refused" or outcome.message else ""
            print(f"{where} {outcome.verdict:7s} {outcome.seconds:6.1f}s {describe(fuzz_case.case)}{why}", flush=True)
            if outcome.verdict in ("FAIL", "timeout"):
                to_replay.append((outcome.verdict, fuzz_case.case))
                print(f"      {outcome.message[-1500:]}\n      replay: {replay_command(fuzz_case.case)}", flush=True)
            if log:
                log.write(json.dumps(dict(seed=fuzz_case.seed, index=fuzz_case.index, profile=fuzz_case.profile,
                                          case=fuzz_case.case, **dataclasses.asdict(outcome))) + "\n")
                log.flush()
    finally:
        if log:
            log.close()
    print(f"{sum(counts.values())} cases in {time.monotonic() - started:.0f} s: "
          + ", ".join(f"{count} {verdict}" for verdict, count in counts.items())
          + (f" ({second_looks} of the passes on the second look at low precision)" if second_looks else ""))
    for verdict, case in to_replay:
        print(f"{verdict}: {replay_command(case)}")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
