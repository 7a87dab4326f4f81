#!/usr/bin/env python3
"""kvattn side by side with FlashInfer and PyTorch on the SPEC section 6 grid, in one process and
one device call (issue 5), plus speculative-decoding rows against FlashInfer (issue 19:
TARGET_VERIFY with a random tree mask, DRAFT_EXTEND, multi-step draft). bench/peers/README.md has
the device command.

Pass A runs kvattn, torch SDPA (FLASH_ATTENTION, CUDNN_ATTENTION) and flex_attention on every
row while a subprocess JIT-compiles the FlashInfer modules the grid needs (CPU work only); pass B
rebuilds the same inputs from the same seeds and runs FlashInfer's wrappers the way SGLang's
FlashInfer backend calls them. Each implementation's output is checked against a float64
reference on sampled queries, and FlashInfer's and torch's full outputs against kvattn's.
Results are rewritten after every row, so a run cut short still leaves its table.

Timing: CUDA events around CUDA-graph replays of many calls (eager loops where a call cannot be
captured), median of many replays, inputs rotated over enough sets that one round touches four
times the L2. The ceilings (read and copy bandwidth, cuBLAS bf16 GEMM) are measured in the same
run.

`--self-test` checks the torch-free parts (grid, arithmetic, JSON / table / plot writers) on any
machine.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from typing import Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers_report as report  # noqa: E402
from peers_report import GROUP, HEAD_DIM, KV_HEADS, KVATTN, Q_HEADS, Case  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_AOT_DIR = os.path.join(REPO_ROOT, ".whl", "peers", "aot")
MIB = 1 << 20
GIB = 1 << 30
L2_FALLBACK_BYTES = 60 * MIB  # H200 (DEVICE-NOTES.md), used when torch does not report it
MAX_SETS = 32  # as the kvattn bench: more input sets add memory, not accuracy
MIN_REPLAY_MS = 1.0  # one timed replay covers at least this much GPU time ...
MAX_CALLS_PER_REPLAY = 256  # ... with at most this many calls in it
MIN_REPS, MAX_REPS = 7, 200
JIT_END_RESERVE_S = 20.0  # pass B stops waiting for a JIT module this long before the budget
FLASHINFER_WORKSPACE_BYTES = 512 * MIB  # as SGLang's largest FlashInfer workspace
FI_WORKER_LOST_RC = 3  # a pass-B worker exits with this after a measurement lost its CUDA context
FI_WORKER_MAX_FAILED_STARTS = 2  # workers that died before measuring anything, then give up
FI_WORKER_START_S = 8.0  # python + torch + CUDA + FlashInfer imports of a worker, generously
# Errors after which a CUDA context is unusable (sticky): the worker stops and a fresh one goes on.
STICKY_CUDA_ERROR = re.compile(r"illegal memory access|unspecified launch failure|misaligned "
                               r"address|illegal instruction|device-side assert|uncorrectable ECC"
                               r"|context is destroyed|launch timed out", re.IGNORECASE)


# ---- pure helpers (covered by --self-test) ----------------------------------------------------

def choose_sets(bytes_per_set: float, l2_bytes: float, free_bytes: float,
                resident_bytes_per_set: float) -> int:
    """Input sets to rotate: one round touches 4x the L2, capped by MAX_SETS and by half the free
    device memory (resident_bytes_per_set counts every copy a set keeps on the device)."""
    wanted = max(1, math.ceil(4.0 * l2_bytes / max(bytes_per_set, 1.0)))
    fit = max(1, int(0.5 * free_bytes // max(resident_bytes_per_set, 1.0)))
    return int(min(wanted, MAX_SETS, fit))


def calls_per_replay(per_call_ms: float, sets: int) -> int:
    """Calls captured in one replay: whole rounds over the sets, at least MIN_REPLAY_MS of work,
    at most MAX_CALLS_PER_REPLAY calls (one round when a round alone exceeds that)."""
    rounds = max(1, math.ceil(MIN_REPLAY_MS / max(per_call_ms * sets, 1e-4)))
    rounds = min(rounds, max(1, MAX_CALLS_PER_REPLAY // sets))
    return rounds * sets


def replay_count(per_call_ms: float, calls: int, target_s: float) -> int:
    """Timed replays: about target_s of GPU time, between MIN_REPS and MAX_REPS."""
    per_replay_s = max(per_call_ms * calls, 1e-4) * 1e-3
    return int(min(MAX_REPS, max(MIN_REPS, round(target_s / per_replay_s))))


class GpuSampler:
    """The GPU's SM clock, board power and clock-event reasons sampled every `period_s` on a
    thread while a measurement runs (issue 12: under sustained load the board's power cap lowers
    the clock, and whether kvattn loses more to it than FlashInfer is a question of clock and
    power per row, read here, not assumed). Through NVML (the `pynvml` module of nvidia-ml-py);
    without it, or without a GPU, every method is a no-op and summary() is empty."""

    SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap
    HW_SLOWDOWN = 0x8 | 0x40 | 0x80  # HW slowdown, thermal, power brake
    SW_THERMAL = 0x20

    def __init__(self, period_s: float = 0.01, nvml=None, handle=None):
        self.period_s = period_s
        self.nvml = nvml
        self.handle = handle
        self.samples: List[Tuple[float, float, int]] = []  # (MHz, W, reasons)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def for_device(cls, pci_bus_id: str = "", period_s: float = 0.01) -> "GpuSampler":
        """A sampler of the GPU with this PCI bus id (or NVML's device 0), or a no-op one."""
        try:
            import pynvml  # nvidia-ml-py
            pynvml.nvmlInit()
            handle = None
            if pci_bus_id:
                try:
                    handle = pynvml.nvmlDeviceGetHandleByPciBusId(pci_bus_id)
                except Exception:  # noqa: BLE001  (formats differ: fall back to the index)
                    handle = None
            if handle is None:
                handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            return cls(period_s, pynvml, handle)
        except Exception:  # noqa: BLE001  (no NVML, no GPU: sample nothing)
            return cls(period_s)

    def _read(self) -> Tuple[float, float, int]:
        n = self.nvml
        clock = float(n.nvmlDeviceGetClockInfo(self.handle, n.NVML_CLOCK_SM))
        power = n.nvmlDeviceGetPowerUsage(self.handle) / 1000.0
        getter = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            getattr(n, "nvmlDeviceGetCurrentClocksThrottleReasons")
        return clock, power, int(getter(self.handle))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self._read())
            except Exception:  # noqa: BLE001  (a failed read ends the sampling quietly)
                return
            self._stop.wait(self.period_s)

    def start(self) -> None:
        self.samples = []
        if self.nvml is None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> dict:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        return self.summary()

    def summary(self) -> dict:
        """Mean SM clock (MHz) and power (W) of the samples, the fraction of samples under the
        software power cap and under any hardware / thermal slowdown; {} without samples."""
        if not self.samples:
            return {}
        count = len(self.samples)
        return {"sm_clock_mhz": round(sum(s[0] for s in self.samples) / count, 1),
                "power_w": round(sum(s[1] for s in self.samples) / count, 1),
                "power_capped": round(sum(1 for s in self.samples
                                          if s[2] & self.SW_POWER_CAP) / count, 3),
                "slowdown": round(sum(1 for s in self.samples
                                      if s[2] & (self.HW_SLOWDOWN | self.SW_THERMAL)) / count,
                                  3),
                "clock_samples": count}


def pci_bus_id(torch) -> str:
    """CUDA device 0's PCI bus id as NVML names it (domain:bus:device.0), or ""."""
    try:
        props = torch.cuda.get_device_properties(0)
        return (f"{int(props.pci_domain_id):08X}:{int(props.pci_bus_id):02X}:"
                f"{int(props.pci_device_id):02X}.0")
    except Exception:  # noqa: BLE001  (older torch: NVML's device 0)
        return ""


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def sample_queries(case: Case) -> List[Tuple[int, int, int]]:
    """(request, output row, absolute position) of the queries checked against float64: decode,
    four requests' single query; prefill/extend/DRAFT_EXTEND, the first, middle and last new
    token of the first and last request (as the kvattn bench samples); verify, every tree token
    of the first, middle and last request (position = prefix + tree index); multi-step draft,
    branches 0 and topk - 1 of the first and last request in every step (output rows step-major,
    then request, then branch; position = the draft token's own, prefix + step x topk + branch)."""
    samples = []
    if case.is_verify:
        for r in sorted({0, case.batch // 2, case.batch - 1}):
            for j in range(case.qo_len):
                samples.append((r, r * case.qo_len + j, case.prefix_len + j))
    elif case.is_multistep:
        rows_per_step = case.batch * case.topk
        for t in range(case.num_steps):
            for r in sorted({0, case.batch - 1}):
                for b in sorted({0, case.topk - 1}):
                    samples.append((r, t * rows_per_step + r * case.topk + b,
                                    case.prefix_len + t * case.topk + b))
    elif case.is_decode:
        for r in (0, case.batch // 3, 2 * case.batch // 3, case.batch - 1):
            samples.append((r, r, case.kv_len - 1))
    else:
        for r in (0, case.batch - 1):
            for j in (0, case.qo_len // 2 + 1, case.qo_len - 1):
                samples.append((r, r * case.qo_len + j, case.prefix_len + j))
    unique = sorted(set(samples), key=lambda s: s[1])
    return unique


def tree_parents(seed: int, batch: int, tree_tokens: int) -> List[List[int]]:
    """A random draft tree per request, as EAGLE's verify step sees it: token 0 hangs off the
    prefix (parent -1, the root), every later token off an earlier tree token (uniform)."""
    rng = random.Random(seed)
    return [[-1] + [rng.randrange(i) for i in range(1, tree_tokens)] for _ in range(batch)]


def tree_ancestors(parents: Sequence[int], token: int) -> List[int]:
    """The tree tokens `token` attends to: itself and its ancestors, ascending."""
    chain = []
    while token >= 0:
        chain.append(token)
        token = parents[token]
    return sorted(chain)


def tree_depths(parents: Sequence[int]) -> List[int]:
    """Depth of each tree token (0: a child of the prefix): its position is prefix + depth."""
    depths: List[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def visible_positions(case: Case, position: int,
                      parents: Optional[Sequence[int]] = None) -> List[int]:
    """Key positions (in the request's req_to_token row) a verify or multi-step-draft query
    sees: the whole prefix, then (verify, query = tree token position - prefix) its ancestors
    and itself, as the mask row allows; (multi-step draft, query = draft token of step t,
    branch b) that branch's draft tokens of steps 0..t, at prefix + s x topk + b."""
    prefix = list(range(case.prefix_len))
    if case.is_verify:
        token = position - case.prefix_len
        return prefix + [case.prefix_len + a for a in tree_ancestors(parents, token)]
    if case.is_multistep:
        step, branch = divmod(position - case.prefix_len, case.topk)
        return prefix + [case.prefix_len + s * case.topk + branch for s in range(step + 1)]
    raise ValueError(f"visible_positions: not a verify / multi-step row: {case.label}")


def module_name(module: tuple) -> str:
    kind, kv_dtype, swa = module
    if kind in ("cascade", "quantization"):
        return kind
    return f"{kind}-{kv_dtype}" + ("-swa" if swa else "")


def modules_of_impl(case: Case, impl: str) -> List[str]:
    """FlashInfer JIT modules one implementation of one case needs."""
    swa = case.window >= 0
    if impl == "flashinfer-decode":
        mods = [("decode", case.kv_dtype, swa)]
    elif impl == "flashinfer-decode-tc" or impl.startswith("flashinfer-fa2"):
        mods = [("fa2", case.kv_dtype, swa)]
    elif impl == "flashinfer-cascade":  # a paged prefill wrapper a level, merge_state_in_place
        mods = [("fa2", case.kv_dtype, swa), ("cascade", "", False)]
    elif impl.startswith("flashinfer-fa3"):
        mods = [("fa3", case.kv_dtype, swa)]
    else:
        return []
    if impl.endswith("+merge"):
        mods.append(("cascade", "", False))
    if case.is_verify:
        mods.append(("quantization", "", False))  # plan() packs the mask (segment_packbits)
    return [module_name(m) for m in mods]


def short_error(exc: BaseException, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    text = re.sub(r"\s+", " ", text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def describe_rc(rc: Optional[int]) -> str:
    """A subprocess's exit status in words ('signal 6 (SIGABRT)', 'exit code 1')."""
    if rc is None:
        return "still running"
    if rc < 0:
        import signal
        try:
            return f"signal {-rc} ({signal.Signals(-rc).name})"
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"


def settle_worker_events(items: Sequence[Tuple[str, str]], events: Sequence[dict]) -> tuple:
    """What one pass-B worker did with its (label, impl) items, from its event lines:
    (rows {item: row}, the item it had started and left without a row (it died there) or None,
    the items it never reached, notes). The worker runs items in order and reports each one
    ('start', then 'row'), so everything after the last item it reported is still to do."""
    rows: Dict[Tuple[str, str], dict] = {}
    started = None
    notes: List[str] = []
    for event in events:
        key = (event.get("label"), event.get("impl"))
        kind = event.get("event")
        if kind == "start":
            started = key
        elif kind == "row":
            rows[key] = event["row"]
            if started == key:
                started = None
        elif kind == "note":
            notes.append(event.get("text", ""))
    last = -1
    for i, item in enumerate(items):
        if tuple(item) in rows or tuple(item) == started:
            last = i
    return rows, started, [tuple(i) for i in items[last + 1:]], notes


def parse_test_hook(text: str) -> Optional[Tuple[str, str, str]]:
    """PEERS_TEST_CRASH='MODE:IMPL:LABEL_REGEX' (MODE 'abort': the worker process aborts when it
    reaches that measurement, as a CUDA abort would end it; 'lost': the measurement fails with
    an illegal-memory-access error and the context counts as lost; 'hang': it never returns, so
    the parent kills the worker at the end of the budget; 'start': every worker exits before
    measuring anything). For checking the pass-B isolation without a GPU."""
    if not text:
        return None
    parts = text.split(":", 2)
    if len(parts) != 3 or parts[0] not in ("abort", "lost", "hang", "start"):
        raise ValueError("PEERS_TEST_CRASH must be 'abort|lost|hang|start:IMPL:LABEL_REGEX', not "
                         f"{text!r}")
    return parts[0], parts[1], parts[2]


# ---- arguments ---------------------------------------------------------------------------------

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="the quick subset: decode b<=64 kv<=4096, prefill b1 len<=4096, "
                             "extend, the fp8 and window rows, verify b1 and b16")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="wall-clock budget of the whole run in seconds (default 480); work "
                             "that would start past it is recorded as skipped")
    parser.add_argument("--out-dir", default=os.environ.get("OUT") or
                        os.path.join(REPO_ROOT, "bench", "results"),
                        help="where the JSON, table, plot and JIT log go (default $OUT, else "
                             "bench/results)")
    parser.add_argument("--date", default=datetime.date.today().isoformat())
    parser.add_argument("--commit", default="", help="commit to record when git is not there")
    parser.add_argument("--rows", default="", help="regex on row labels to keep")
    parser.add_argument("--impls", default="",
                        help="comma list of implementations to run (default: all)")
    parser.add_argument("--no-flashinfer", action="store_true")
    parser.add_argument("--flex", choices=("all", "prefill", "none"), default="all",
                        help="rows to run torch flex_attention on (each new shape compiles)")
    parser.add_argument("--target-s", type=float, default=0.25,
                        help="GPU seconds timed per implementation and row")
    parser.add_argument("--jit-workers", type=int, default=2,
                        help="FlashInfer modules compiled at once by the prebuild subprocess")
    parser.add_argument("--jit-jobs", type=int, default=7, help="ninja jobs per module (MAX_JOBS)")
    parser.add_argument("--aot-dir", default=DEFAULT_AOT_DIR if os.path.isdir(DEFAULT_AOT_DIR)
                        else "",
                        help="prebuilt FlashInfer modules (<name>/<name>.so, built for sm_90a by "
                             "build_flashinfer_aot.sh) copied into FlashInfer's AOT folder so "
                             "that nothing is compiled on the device (default: .whl/peers/aot "
                             "when present; '' to compile everything on the device)")
    parser.add_argument("--jit-cache-in", default="",
                        help="a tar.gz of a FlashInfer JIT workspace to unpack first")
    parser.add_argument("--jit-cache-out", default="",
                        help="write the FlashInfer JIT workspace (no object files) to this tar.gz")
    parser.add_argument("--self-test", action="store_true",
                        help="check the torch-free parts and exit")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run tiny rows on the CPU (kvattn CPU backend, torch on CPU, no "
                             "FlashInfer, no ceilings): checks the pipeline without a GPU")
    # internal: the JIT prebuild subprocess
    parser.add_argument("--jit-prebuild", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--jit-status", default="", help=argparse.SUPPRESS)
    parser.add_argument("--modules", default="", help=argparse.SUPPRESS)
    # internal: a pass-B FlashInfer worker (run_peers.py starts it; JOB is a JSON file)
    parser.add_argument("--fi-worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--aot-out", default="",
                        help="with --jit-prebuild: copy each built module to "
                             "DIR/<name>/<name>.so (what --aot-dir takes)")
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error("--budget-s must be positive")
    return args


def select_cases(args: argparse.Namespace) -> List[Case]:
    cases = report.make_grid(quick=args.quick)
    if args.cpu_dry_run:
        cases = [report.tiny_case(c) for c in cases]
    if args.rows:
        pattern = re.compile(args.rows)
        cases = [c for c in cases if pattern.search(c.label)]
    return cases


def impl_wanted(args: argparse.Namespace, impl: str) -> bool:
    if args.impls:
        return impl in [s.strip() for s in args.impls.split(",")]
    if args.no_flashinfer and impl.startswith("flashinfer"):
        return False
    return True


def runs_impl(case: Case, impl: str) -> bool:
    """kvattn runs on every row, a peer on the rows whose peers() name it (the speculative rows
    have no torch peers)."""
    return impl == KVATTN or impl in case.peers()


def flex_wanted(args: argparse.Namespace, case: Case) -> bool:
    return args.flex == "all" or (args.flex == "prefill" and not case.is_decode)


# ---- FlashInfer JIT prebuild (a subprocess: compiles, never touches the GPU) ------------------

def jit_prebuild_main(args: argparse.Namespace) -> int:
    """Compiles the FlashInfer modules named in --modules, --jit-workers at a time, in the given
    order, appending one JSON line per module to --jit-status."""
    if args.modules:
        modules = [tuple(m) for m in json.loads(args.modules)]
    else:
        modules = report.needed_flashinfer_modules(report.make_grid())
    lock = threading.Lock()
    if not args.jit_status:
        args.jit_status = os.path.join(tempfile.mkdtemp(prefix="peers-jit-"), "status.jsonl")

    def status(**fields):
        with lock, open(args.jit_status, "a") as f:
            f.write(json.dumps(fields) + "\n")

    start = time.monotonic()
    try:
        import importlib
        import torch
        importlib.import_module("flashinfer")
        from flashinfer.jit import gen_batch_decode_module, gen_batch_prefill_module
        from flashinfer.jit.cascade import gen_cascade_module
        from flashinfer.jit.quantization import gen_quantization_module
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which compiles itself
        status(module="*", status="failed", error="import: " + short_error(e, 2000))
        return 1
    status(module="*", status="imported", seconds=round(time.monotonic() - start, 1))
    dtypes = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}

    def spec_of(module):
        kind, kv_dtype, swa = module
        if kind == "cascade":
            return gen_cascade_module()
        if kind == "quantization":  # packbits / segment_packbits (verify's custom mask)
            return gen_quantization_module()
        kv = dtypes[kv_dtype]
        if kind == "decode":
            return gen_batch_decode_module(torch.bfloat16, kv, torch.bfloat16, torch.int32,
                                           HEAD_DIM, HEAD_DIM, 0, bool(swa), False)
        return gen_batch_prefill_module(kind, torch.bfloat16, kv, torch.bfloat16, torch.int32,
                                        HEAD_DIM, HEAD_DIM, 0, bool(swa), False, False)

    def usable_aot(spec) -> bool:
        """A carried prebuilt module is used when every symbol resolves now (RTLD_NOW), so a
        bad one fails here, not as a lazy-binding abort mid-run; else it is removed and the
        module is compiled."""
        if not spec.is_aot:
            return False
        try:
            ctypes.CDLL(str(spec.aot_path), mode=os.RTLD_NOW | os.RTLD_LOCAL)
            return True
        except OSError as e:
            print(f"jit: prebuilt {spec.aot_path} unusable ({e}): compiling instead", flush=True)
            os.remove(spec.aot_path)
            return False

    def build(module):
        name = module_name(module)
        t0 = time.monotonic()
        status(module=name, status="started", at=round(t0 - start, 1))
        try:
            spec = spec_of(module)
            if usable_aot(spec):
                print(f"jit: {name}: prebuilt {spec.aot_path}", flush=True)
                status(module=name, status="done", aot=True, seconds=0.0)
                return
            print(f"jit: building {name}", flush=True)
            spec.build(verbose=False)
        except BaseException as e:  # noqa: BLE001
            text = f"{type(e).__name__}: {e}"
            print(f"jit: {name} failed after {time.monotonic() - t0:.0f} s:\n{text}", flush=True)
            status(module=name, status="failed", seconds=round(time.monotonic() - t0, 1),
                   error=re.sub(r"\s+", " ", text)[-1500:])
            return
        print(f"jit: {name} built in {time.monotonic() - t0:.0f} s", flush=True)
        status(module=name, status="done", seconds=round(time.monotonic() - t0, 1))
        if args.aot_out:
            import shutil
            target = os.path.join(args.aot_out, spec.name)
            os.makedirs(target, exist_ok=True)
            shutil.copy2(spec.get_library_path(), os.path.join(target, f"{spec.name}.so"))
            print(f"jit: {name} -> {target}", flush=True)

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=max(1, args.jit_workers)) as pool:
        list(pool.map(build, modules))
    status(module="*", status="finished", seconds=round(time.monotonic() - start, 1))
    return 0


class JitTracker:
    """The parent's view of the prebuild subprocess: which modules are done or failed."""

    def __init__(self, status_path: str, process: Optional[subprocess.Popen]):
        self.status_path = status_path
        self.process = process
        self.waited_s = 0.0

    def read(self) -> Dict[str, dict]:
        states: Dict[str, dict] = {}
        try:
            with open(self.status_path) as f:
                for line in f:
                    line = line.strip()
                    if line:
                        entry = json.loads(line)
                        states[entry["module"]] = entry
        except (OSError, ValueError):
            pass
        return states

    def wait(self, names: List[str], deadline: float) -> Optional[str]:
        """None when every module is built (or the prebuild is gone and the caller should build
        in-process), else why the implementation cannot run."""
        start = time.monotonic()
        try:
            while True:
                states = self.read()
                failed = [n for n in names if states.get(n, {}).get("status") == "failed"]
                if failed:
                    return f"FlashInfer JIT of {failed[0]} failed: " + \
                        states[failed[0]].get("error", "?")
                if all(states.get(n, {}).get("status") == "done" for n in names):
                    return None
                if self.process is None or self.process.poll() is not None:
                    return None  # no prebuild running: build in-process (time-checked by caller)
                if states.get("*", {}).get("status") == "failed":
                    return None
                if time.monotonic() > deadline:
                    return "skipped: FlashInfer JIT not finished within the budget"
                time.sleep(0.5)
        finally:
            self.waited_s += time.monotonic() - start

    def all_done(self) -> bool:
        """The prebuild has finished (or is gone)."""
        if self.process is None or self.process.poll() is not None:
            return True
        return self.read().get("*", {}).get("status") == "finished"

    def summary(self) -> dict:
        return {name: {k: v for k, v in entry.items() if k != "module"}
                for name, entry in self.read().items()}

    def mark_gone(self) -> None:
        """The prebuild exited without writing 'finished' (killed, crashed): say so in the
        status file, so that pass-B workers (which only see the file) stop waiting for it."""
        if self.process is None or self.process.poll() is None:
            return
        if self.read().get("*", {}).get("status") in ("finished", "failed", "gone"):
            return
        with open(self.status_path, "a") as f:
            f.write(json.dumps({"module": "*", "status": "gone",
                                "rc": self.process.poll()}) + "\n")


class PrebuildStatus:
    """The prebuild subprocess as a pass-B worker sees it (through the status file only): ended
    once the file says 'finished', 'failed' or 'gone'."""

    def __init__(self, status_path: str):
        self.status_path = status_path

    def poll(self) -> Optional[int]:
        state = JitTracker(self.status_path, None).read().get("*", {}).get("status")
        return 0 if state in ("finished", "failed", "gone") else None


def start_prebuild(args: argparse.Namespace, modules: List[tuple], log_path: str,
                   status_path: str) -> Optional[subprocess.Popen]:
    env = dict(os.environ)
    env["MAX_JOBS"] = str(args.jit_jobs)
    cmd = [sys.executable, os.path.abspath(__file__), "--jit-prebuild", "--jit-status",
           status_path, "--modules", json.dumps(modules), "--jit-workers", str(args.jit_workers)]
    log = open(log_path, "w")
    try:
        # Lowest CPU priority: the parent's launches and torch.compile come first.
        return subprocess.Popen(["nice", "-n", "19"] + cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=env, cwd=REPO_ROOT)
    except OSError:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)


def install_aot(aot_dir: str) -> List[str]:
    """Copies prebuilt modules into the installed FlashInfer's data/aot, where JitSpec looks
    before compiling (found without importing flashinfer, which the prebuild does in parallel)."""
    import importlib.util
    import shutil
    try:
        spec = importlib.util.find_spec("flashinfer")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return ["not installed: flashinfer not found"]
    target = os.path.join(list(spec.submodule_search_locations)[0], "data", "aot")
    names = sorted(n for n in os.listdir(aot_dir) if os.path.isdir(os.path.join(aot_dir, n)))
    try:
        shutil.copytree(aot_dir, target, dirs_exist_ok=True)
    except OSError as e:
        return [f"not installed: {short_error(e)}"]
    return names


def flashinfer_workspace_base() -> str:
    return os.environ.get("FLASHINFER_WORKSPACE_BASE", os.path.expanduser("~"))


def unpack_jit_cache(path: str) -> str:
    """Unpacks a saved JIT workspace and marks every file as new, so that ninja (which compares
    times against the freshly installed headers) treats the modules as up to date."""
    import tarfile
    base = flashinfer_workspace_base()
    with tarfile.open(path) as tar:
        tar.extractall(base)
    now = time.time()
    for root, _, files in os.walk(os.path.join(base, ".cache", "flashinfer")):
        for name in files:
            os.utime(os.path.join(root, name), (now, now))
    return base


def pack_jit_cache(path: str) -> int:
    import tarfile
    base = flashinfer_workspace_base()
    root = os.path.join(base, ".cache", "flashinfer")

    def keep(info):
        return None if info.name.endswith((".o", ".lock")) else info

    with tarfile.open(path, "w:gz") as tar:
        tar.add(root, arcname=os.path.relpath(root, base), filter=keep)
    return os.path.getsize(path)


# ---- the device run ----------------------------------------------------------------------------

class Mode:
    """SGLang's ForwardMode, the predicates KvattnAttnBackend asks."""

    def __init__(self, name: str):
        self.name = name

    def is_idle(self):
        return False

    def is_decode(self):
        return self.name == "DECODE"

    def is_target_verify(self):
        return self.name == "TARGET_VERIFY"

    def is_draft_extend(self):
        return self.name == "DRAFT_EXTEND"

    def is_mixed(self):
        return False

    def is_extend(self):
        return self.name in ("EXTEND", "TARGET_VERIFY", "DRAFT_EXTEND")


class Data:
    """The logical inputs of one data group, per input set: q [tokens, 32, 128] bf16, K and V
    [batch, kv_len, 8, 128] (bf16, or float8_e4m3fn), and the new tokens' k/v [tokens, 8, 128]
    (prefill/extend/DRAFT_EXTEND). Verify, one for all sets (a step's tree, shared by the
    layers): the tree (parents per request), the mask and the tree positions."""

    def __init__(self):
        self.q, self.k, self.v, self.k_new, self.v_new = [], [], [], [], []
        self.checksum = 0.0
        self.parents: Optional[List[List[int]]] = None  # verify: [batch][tree token]
        # verify: bool [sum over requests of tree x (prefix + tree)], each request's
        # [tree, prefix + tree] matrix row-major (SGLang's spec_info.custom_mask layout)
        self.custom_mask = None
        self.tree_positions = None  # verify: int64 [batch * tree], prefix + depth


class Layout:
    """Where one case's KV pool puts the tokens: shuffled pages (page 0 reserved, as SGLang
    reserves slot 0), NaN in every slot nobody owns."""

    def __init__(self):
        self.slots = None  # [batch, kv_len] int64, device
        self.pages = None  # [batch, pages_per_request] int64, device
        self.k_pool, self.v_pool = [], []  # per set [num_slots, 8, 128] bf16 or uint8 (fp8)
        self.num_pages = 0


class _HostEvent:
    """A wall-clock stand-in for torch.cuda.Event in the CPU dry run."""

    def __init__(self):
        self.at = 0.0

    def record(self, stream=None) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end.at - self.at) * 1e3


class Runner:
    """Everything that needs torch (and, but for the CPU dry run, the GPU)."""

    def __init__(self, args: argparse.Namespace, cases: List[Case], start: float):
        import torch
        self.torch = torch
        self.args = args
        self.cases = cases
        self.start = start
        self.deadline = start + args.budget_s
        # A CPU dry run (--cpu-dry-run, tiny rows) exercises everything but CUDA streams,
        # graphs and FlashInfer on a machine without a GPU.
        self.cuda = torch.cuda.is_available() and not args.cpu_dry_run
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.stream = torch.cuda.Stream() if self.cuda else None
        if self.cuda:
            props = torch.cuda.get_device_properties(0)
            self.l2_bytes = float(getattr(props, "L2_cache_size", 0) or L2_FALLBACK_BYTES)
            self.device_name = torch.cuda.get_device_name(0)
        else:
            self.l2_bytes = 1.0 * MIB
            self.device_name = "cpu (dry run)"
        self.scale = HEAD_DIM ** -0.5
        self.ceilings: Dict[str, float] = {}
        self.rows: Dict[tuple, dict] = {}  # (case label, impl) -> row
        self.kvattn_out: Dict[str, object] = {}  # case label -> set-0 output [tokens, 32, 128], host
        self.references: Dict[tuple, tuple] = {}  # data key -> (samples, float64 [n, 32, 128])
        self.checksums: Dict[tuple, float] = {}
        self.versions: Dict[str, str] = {"torch": torch.__version__,
                                         "cuda": str(torch.version.cuda)}
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if cudnn:
            self.versions["cudnn"] = str(cudnn)
        self.kvattn = None
        self.kvattn_error = ""
        self.flashinfer = None
        self.flashinfer_error = ""
        self.flex = None
        self.flex_error = ""
        self.jit: Optional[JitTracker] = None
        self.fi_workspace = None
        self.notes: List[str] = []
        self.log_prefix = ""
        self.context_lost = ""  # "label / impl" of the measurement after which CUDA was unusable
        # Clock and power during each timed measurement (rows' sm_clock_mhz, power_w, ...).
        self.sampler = GpuSampler.for_device(pci_bus_id(torch)) if self.cuda else GpuSampler()

    # ---- time ----

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, text: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {self.log_prefix}{text}", flush=True)

    # ---- device helpers (CUDA, or the CPU dry run) ----

    def on_stream(self):
        """Context: work goes to the benchmark stream."""
        if self.cuda:
            return self.torch.cuda.stream(self.stream)
        return contextlib.nullcontext()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def event(self):
        if self.cuda:
            return self.torch.cuda.Event(enable_timing=True)
        return _HostEvent()

    def mark(self, event) -> None:
        """Records a timing event on the benchmark stream."""
        if self.cuda:
            event.record(self.stream)
        else:
            event.record()

    def empty_cache(self) -> None:
        if self.cuda and not self.context_lost:
            self.torch.cuda.empty_cache()

    def context_alive(self, error: str = "") -> bool:
        """False when the CUDA context can no longer be used: a sticky error (an illegal memory
        access ends the context) named in `error`, or a synchronize / tiny kernel that fails."""
        if self.context_lost:
            return False
        if STICKY_CUDA_ERROR.search(error or ""):
            return False
        if not self.cuda:
            return True
        try:
            self.torch.cuda.synchronize()
            return float(self.torch.ones(1, device=self.device).add_(1).item()) == 2.0
        except BaseException:  # noqa: BLE001
            return False

    def free_bytes(self) -> float:
        if self.cuda:
            return float(self.torch.cuda.mem_get_info()[0])
        return 4.0 * GIB

    # ---- imports ----

    def import_peers(self, with_kvattn: bool = True) -> None:
        try:
            if not with_kvattn:
                raise ImportError("not imported in a FlashInfer worker")
            import kvattn
            from kvattn.torch_backend import KvattnAttnBackend
            if not kvattn.cuda_compiled() and not self.args.cpu_dry_run:
                raise RuntimeError("kvattn was built without CUDA")
            self.kvattn = (kvattn, KvattnAttnBackend)
            self.versions["kvattn"] = getattr(kvattn, "__version__", "?")
        except BaseException as e:  # noqa: BLE001
            self.kvattn_error = "import kvattn: " + short_error(e)
        if not self.args.no_flashinfer:
            try:
                import flashinfer
                self.flashinfer = flashinfer
                self.versions["flashinfer"] = getattr(flashinfer, "__version__", "?")
                try:
                    import tvm_ffi
                    self.versions["tvm_ffi"] = getattr(tvm_ffi, "__version__", "?")
                except ImportError:
                    pass
            except BaseException as e:  # noqa: BLE001
                self.flashinfer_error = "import flashinfer: " + short_error(e)
        try:
            import triton
            self.versions["triton"] = triton.__version__
        except ImportError:
            pass

    # ---- ceilings ----

    def measure_ceilings(self) -> None:
        torch = self.torch
        if not self.cuda:
            self.notes.append("CPU dry run: no ceilings")
            return
        read = self._measure_read_gbps()
        if read:
            self.ceilings["read_gbps"] = read
        try:
            src = torch.empty(4 * GIB, dtype=torch.uint8, device=self.device)
            dst = torch.empty_like(src)
            src.fill_(1)
            ms = self._event_median(lambda: dst.copy_(src), reps=20, warmup=3)
            self.ceilings["copy_gbps"] = 2 * 4 * GIB / (ms * 1e-3) / 1e9
            src = dst = None
        except BaseException as e:  # noqa: BLE001
            self.notes.append("copy ceiling failed: " + short_error(e))
        self.ceilings["gemm_bf16_tflops"] = self._measure_gemm_tflops() or 0.0
        self.empty_cache()
        self.log("ceilings: " + ", ".join(f"{k} {v:.0f}" for k, v in self.ceilings.items()))

    def _event_median(self, fn: Callable[[], object], reps: int, warmup: int) -> float:
        with self.on_stream():
            for _ in range(warmup):
                fn()
            events = [(self.event(), self.event()) for _ in range(reps)]
            for a, b in events:
                self.mark(a)
                fn()
                self.mark(b)
        self.sync()
        return median([a.elapsed_time(b) for a, b in events])

    def _measure_read_gbps(self) -> Optional[float]:
        """Read-only streaming over 4 GiB: a Triton kernel in which each program sums one 32 KiB
        block (enough blocks in flight to saturate HBM); torch's sum if Triton fails."""
        torch = self.torch
        n = GIB  # int32 elements: 4 GiB
        x = torch.ones(n, dtype=torch.int32, device=self.device)
        try:
            import triton
            import triton.language as tl

            @triton.jit
            def read_blocks(x_ptr, out_ptr, BLOCK: tl.constexpr):
                pid = tl.program_id(0)
                offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
                tl.store(out_ptr + pid, tl.sum(tl.load(x_ptr + offsets), axis=0))

            block = 8192
            out = torch.empty(n // block, dtype=torch.int32, device=self.device)
            grid = (n // block,)
            ms = self._event_median(lambda: read_blocks[grid](x, out, BLOCK=block, num_warps=8),
                                    reps=20, warmup=3)
            if int(out[:4].sum().item()) != 4 * block:
                raise RuntimeError("read kernel summed wrong")
            self.ceilings_method = "triton block sums"
        except BaseException as e:  # noqa: BLE001
            self.notes.append("Triton read ceiling failed, torch.sum used: " + short_error(e))
            ms = self._event_median(lambda: x.sum(), reps=20, warmup=3)
            self.ceilings_method = "torch.sum"
        x = None
        return 4 * GIB / (ms * 1e-3) / 1e9

    def _measure_gemm_tflops(self) -> Optional[float]:
        torch = self.torch
        size = 8192
        try:
            a = torch.randn(size, size, dtype=torch.bfloat16, device=self.device)
            b = torch.randn(size, size, dtype=torch.bfloat16, device=self.device)
            c = torch.empty(size, size, dtype=torch.bfloat16, device=self.device)
            ms = self._event_median(lambda: torch.matmul(a, b, out=c), reps=20, warmup=3)
            a = b = c = None
            return 2.0 * size ** 3 / (ms * 1e-3) / 1e12
        except BaseException as e:  # noqa: BLE001
            self.notes.append("GEMM ceiling failed: " + short_error(e))
            return None

    # ---- inputs ----

    def sets_for(self, case: Case) -> int:
        kv = case.batch * case.kv_len * KV_HEADS * HEAD_DIM * 2.0 * case.kv_elem_bytes
        q = case.tokens * Q_HEADS * HEAD_DIM * 2.0
        per_call = (case.kv_bytes() if case.is_decode else kv) + 2 * q
        resident = 2 * kv + 4 * q + 2 * case.tokens * KV_HEADS * HEAD_DIM * 2.0
        return choose_sets(per_call, self.l2_bytes, self.free_bytes(), resident)

    def build_data(self, case: Case, sets: int) -> Data:
        """Same case.data_key, same seed: same tensors in pass A and pass B."""
        torch = self.torch
        gen = torch.Generator(device=self.device)
        gen.manual_seed(case.seed())
        data = Data()
        shape = (case.batch, case.kv_len, KV_HEADS, HEAD_DIM)
        for _ in range(sets):
            k = torch.randn(shape, dtype=torch.bfloat16, device=self.device, generator=gen)
            v = torch.randn(shape, dtype=torch.bfloat16, device=self.device, generator=gen)
            q = torch.randn((case.tokens, Q_HEADS, HEAD_DIM), dtype=torch.bfloat16,
                            device=self.device, generator=gen)
            if case.is_shared_prefix:  # one prompt: request 0's first tokens for every request
                k[:, :case.shared_prefix] = k[:1, :case.shared_prefix]
                v[:, :case.shared_prefix] = v[:1, :case.shared_prefix]
            if case.kv_dtype == "fp8_e4m3":
                k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
            data.k.append(k)
            data.v.append(v)
            data.q.append(q)
            if case.workload in ("prefill", "extend") or case.is_draft_extend:
                data.k_new.append(k[:, case.prefix_len:].reshape(-1, KV_HEADS, HEAD_DIM)
                                  .contiguous())
                data.v_new.append(v[:, case.prefix_len:].reshape(-1, KV_HEADS, HEAD_DIM)
                                  .contiguous())
        if case.is_verify:
            self._build_tree(case, data)
        data.checksum = float(data.q[0][:64].float().sum() + data.k[0][:, :64].float().sum())
        # Built on the default stream; every implementation runs on self.stream, a non-blocking
        # stream that does not wait for the default one: finish here.
        self.sync()
        return data

    def _build_tree(self, case: Case, data: Data) -> None:
        """The verify step's random tree (from the row's seed: the same in both passes), its
        mask (each request's [tree, prefix + tree] rows: the whole prefix, then the token's
        ancestors and itself) and the tree tokens' positions."""
        torch = self.torch
        tree, prefix = case.qo_len, case.prefix_len
        data.parents = tree_parents(case.seed(), case.batch, tree)
        part = torch.zeros((case.batch, tree, tree), dtype=torch.bool)
        for r, parents in enumerate(data.parents):
            for j in range(tree):
                part[r, j, tree_ancestors(parents, j)] = True
        mask = torch.cat([torch.ones((case.batch, tree, prefix), dtype=torch.bool), part], dim=2)
        data.custom_mask = mask.reshape(-1).to(self.device)
        depths = torch.tensor([tree_depths(p) for p in data.parents], dtype=torch.int64)
        data.tree_positions = (prefix + depths).reshape(-1).to(self.device)

    def build_layout(self, case: Case, data: Data, sets: int) -> Layout:
        torch = self.torch
        ps = case.page_size
        per_request = -(-case.kv_len // ps)
        layout = Layout()
        gen = torch.Generator(device="cpu")
        gen.manual_seed(case.seed() ^ (ps * 7919))
        if case.is_shared_prefix:
            # The prompt's pages once (whole pages: its length is a multiple of the page), in
            # every request's row, then the request's own pages; all of them shuffled.
            if case.shared_prefix % ps:
                raise ValueError(f"{case.label}: shared prefix {case.shared_prefix} is not a "
                                 f"multiple of page size {ps}")
            shared_pages = case.shared_prefix // ps
            own_pages = per_request - shared_pages
            layout.num_pages = 1 + shared_pages + case.batch * own_pages
            order = torch.randperm(layout.num_pages - 1, generator=gen) + 1
            shared = order[:shared_pages].expand(case.batch, shared_pages)
            pages = torch.cat([shared, order[shared_pages:].view(case.batch, own_pages)], dim=1)
        else:
            layout.num_pages = 1 + case.batch * per_request
            pages = (torch.randperm(layout.num_pages - 1, generator=gen) + 1).view(case.batch,
                                                                                   per_request)
        position = torch.arange(case.kv_len)
        slots = pages[:, position // ps] * ps + position % ps
        layout.pages = pages.to(self.device)
        layout.slots = slots.to(self.device)
        num_slots = layout.num_pages * ps
        flat = layout.slots.reshape(-1)
        for s in range(sets):
            for source, pool in ((data.k[s], layout.k_pool), (data.v[s], layout.v_pool)):
                if case.kv_dtype == "fp8_e4m3":
                    buffer = torch.full((num_slots, KV_HEADS, HEAD_DIM), 0x7F, dtype=torch.uint8,
                                        device=self.device)  # 0x7F: NaN in e4m3
                    buffer[flat] = source.view(torch.uint8).reshape(-1, KV_HEADS, HEAD_DIM)
                else:
                    buffer = torch.full((num_slots, KV_HEADS, HEAD_DIM), float("nan"),
                                        dtype=torch.bfloat16, device=self.device)
                    buffer[flat] = source.reshape(-1, KV_HEADS, HEAD_DIM)
                pool.append(buffer)
        # The scatter above is ~1 GiB of default-stream work for the largest rows; the
        # implementations (and FlashInfer's plan, which reads indptr on self.stream) must not
        # start before it ends.
        self.sync()
        return layout

    def kv_torch_dtype(self, case: Case):
        return self.torch.float8_e4m3fn if case.kv_dtype == "fp8_e4m3" else self.torch.bfloat16

    # ---- correctness ----

    def reference(self, case: Case, data: Data) -> tuple:
        """float64 attention of the sampled queries of set 0: [n, 32, 128]."""
        torch = self.torch
        samples = sample_queries(case)
        outs = []
        for request, row, position in samples:
            if case.is_verify or case.is_multistep:
                parents = data.parents[request] if case.is_verify else None
                keys = torch.tensor(visible_positions(case, position, parents),
                                    device=data.k[0].device)
                k = data.k[0][request].index_select(0, keys).double()  # [n, 8, 128]
                v = data.v[0][request].index_select(0, keys).double()
            else:
                low = max(0, position - case.window) if case.window >= 0 else 0
                k = data.k[0][request, low:position + 1].double()  # [n, 8, 128]
                v = data.v[0][request, low:position + 1].double()
            q = data.q[0][row].double().view(KV_HEADS, GROUP, HEAD_DIM)
            scores = torch.einsum("gqd,ngd->gqn", q, k) * self.scale
            out = torch.einsum("gqn,ngd->gqd", torch.softmax(scores, dim=-1), v)
            outs.append(out.reshape(Q_HEADS, HEAD_DIM))
        return samples, torch.stack(outs)

    def sampled_error(self, out, case: Case) -> float:
        """Max over sampled queries and heads of max |out - ref| / max |ref|."""
        torch = self.torch
        samples, ref = self.references[case.data_key]
        rows = torch.tensor([s[1] for s in samples], device=out.device)
        got = out.reshape(-1, Q_HEADS, HEAD_DIM)[rows].double()
        if not torch.isfinite(got).all():
            return float("inf")
        diff = (got - ref).abs().amax(-1)
        scale = ref.abs().amax(-1)
        return float(torch.where(scale > 0, diff / scale, diff).max())

    def full_rel_diff(self, a, b) -> float:
        """Max over rows and heads of max |a - b| / max |b| (b: kvattn's output)."""
        torch = self.torch
        a = a.reshape(-1, Q_HEADS, HEAD_DIM)
        b = b.reshape(-1, Q_HEADS, HEAD_DIM).to(a.device)
        worst = 0.0
        for lo in range(0, a.shape[0], 4096):
            x, y = a[lo:lo + 4096].float(), b[lo:lo + 4096].float()
            if not torch.isfinite(x).all():
                return float("inf")
            diff = (x - y).abs().amax(-1)
            scale = y.abs().amax(-1)
            worst = max(worst, float(torch.where(scale > 0, diff / scale, diff).max()))
        return worst

    # ---- timing ----

    def time_calls(self, call: Callable[[int], object], sets: int,
                   allow_graph: bool = True) -> dict:
        """Median µs per call. call(i) runs one forward on input set i on the current stream.
        Captures whole rounds over the sets in a CUDA graph and times its replays; where capture
        fails, times eager loops (which can be host-bound for short calls: 'timing' says)."""
        torch = self.torch
        stream = self.stream
        with self.on_stream():
            for i in range(sets):
                call(i)
            a, b = self.event(), self.event()
            self.mark(a)
            for i in range(sets):
                call(i)
            self.mark(b)
        b.synchronize()
        per_call_ms = a.elapsed_time(b) / sets
        calls = calls_per_replay(per_call_ms, sets)
        graph = None
        graph_error = ""
        allow_graph = allow_graph and self.cuda
        if allow_graph:
            try:
                graph = torch.cuda.CUDAGraph()
                # Thread-local capture, as the kvattn bench captures (cudaStreamCaptureMode-
                # ThreadLocal): work other threads start cannot invalidate it.
                with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                    for i in range(calls):
                        call(i % sets)
                with torch.cuda.stream(stream):
                    graph.replay()
                stream.synchronize()
            except BaseException as e:  # noqa: BLE001
                if isinstance(e, KeyboardInterrupt):
                    raise
                graph = None
                graph_error = short_error(e, 160)
                try:
                    torch.cuda.synchronize()
                except RuntimeError:
                    pass  # a failed capture's error surfaces here once; the eager loop decides
        reps = replay_count(per_call_ms, calls, self.args.target_s)
        events = [(self.event(), self.event()) for _ in range(reps)]
        # The host's time to enqueue the timed calls (no sync inside): about time_us when the
        # calls are host-bound (an eager loop of short calls), far below it when the GPU is.
        host_start = time.perf_counter()
        self.sampler.start()
        with self.on_stream():
            for start, end in events:
                self.mark(start)
                if graph is not None:
                    graph.replay()
                else:
                    for i in range(calls):
                        call(i % sets)
                self.mark(end)
        host_us = (time.perf_counter() - host_start) * 1e6 / max(1, reps * calls)
        self.sync()
        clocks = self.sampler.stop()
        times = [start.elapsed_time(end) * 1e3 / calls for start, end in events]
        del graph
        result = {"time_us": median(times), "timing": "graph" if allow_graph and not graph_error
                  else "eager", "sets": sets, "calls_per_replay": calls, "reps": reps,
                  "spread": (max(times) - min(times)) / median(times) if times else None,
                  "host_us": host_us, **clocks}
        if graph_error:
            result["graph_error"] = graph_error
        return result

    def output_of(self, call: Callable[[int], object]):
        """Set 0's output from one eager call."""
        with self.on_stream():
            out = call(0)
        self.sync()
        if isinstance(out, (tuple, list)):
            out = out[0]
        return out

    def run_impl(self, case: Case, impl: str, setup: Callable[[], tuple], *,
                 allow_graph: bool = True) -> dict:
        """setup() -> (call, finish): call(i) runs input set i, finish(out) maps an output to
        [tokens, 32, 128]. Any failure becomes the row's error; the run goes on."""
        t0 = time.monotonic()
        try:
            call, finish = setup()
            timing = self.time_calls(call, self._sets, allow_graph=allow_graph)
            out = finish(self.output_of(call))
            err = self.sampled_error(out, case)
            extra = {k: v for k, v in timing.items() if k != "time_us"}
            if callable(getattr(call, "extra_timing", None)):
                extra.update(call.extra_timing())
            row = report.make_row(case, impl, timing["time_us"], self.ceilings,
                                  max_rel_err=err, **extra)
            row["_out"] = out
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, KeyboardInterrupt):
                raise
            self.log(f"  {impl}: FAILED {short_error(e, 500)}")
            traceback.print_exc(limit=3)
            row = report.make_row(case, impl, None, self.ceilings, error=short_error(e))
            if not self.context_alive(str(e)):
                self.context_lost = f"{case.label} / {impl}"
                row["error"] += " [CUDA context lost]"
        row["wall_s"] = round(time.monotonic() - t0, 2)
        if row.get("time_us") is not None:
            rate = (f"{row['gbps']:.0f} GB/s" if case.memory_bound else
                    f"{row['tflops']:.0f} TFLOP/s")
            self.log(f"  {impl}: {row['time_us']:.1f} us ({rate}, {row['timing']}), err "
                     f"{row['max_rel_err']}")
        return row

    def record(self, case: Case, row: dict) -> None:
        """Keeps a result row (without the tensors riding along under '_' keys)."""
        self.rows[(case.label, row["impl"])] = {k: v for k, v in row.items()
                                                if not k.startswith("_")}

    def skip(self, case: Case, impl: str, why: str) -> None:
        self.record(case, report.make_row(case, impl, None, self.ceilings, error=why))

    def skip_unrecorded(self, group: List[Case], impls: Sequence[str], why: str) -> None:
        for case in group:
            for impl in impls:
                if impl_wanted(self.args, impl) and runs_impl(case, impl) and \
                        (case.label, impl) not in self.rows:
                    self.skip(case, impl, why)

    def lost_why(self) -> str:
        return f"not run: CUDA context of the main process lost at {self.context_lost}"

    def group_failed(self, group: List[Case], impls: Sequence[str], e: BaseException) -> None:
        """A failure outside a measurement (inputs, layout): the group's rows not yet recorded
        get it as their error; a lost context stops this process's CUDA work."""
        self.log(f"  {group[0].label}: FAILED {short_error(e, 500)}")
        traceback.print_exc(limit=3)
        if not self.context_alive(str(e)):
            self.context_lost = self.context_lost or f"{group[0].label} / inputs"
        self.skip_unrecorded(group, impls, "inputs failed: " + short_error(e))

    # ---- kvattn ----

    def kvattn_setup(self, case: Case, data: Data, layout: Layout, sets: int):
        torch = self.torch
        _, KvattnAttnBackend = self.kvattn
        fp8 = case.kv_dtype == "fp8_e4m3"
        pool = types.SimpleNamespace(
            k_buffer=layout.k_pool, v_buffer=layout.v_pool, page_size=case.page_size,
            dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, start_layer=0, layer_num=sets)
        req_to_token = layout.slots.to(torch.int32).contiguous()
        self.sync()  # default-stream work above; the backend works on self.stream
        req_pool = types.SimpleNamespace(req_to_token=req_to_token)
        window = case.window if case.window >= 0 else None
        layers = [types.SimpleNamespace(
            layer_id=s, tp_q_head_num=Q_HEADS, tp_k_head_num=KV_HEADS, tp_v_head_num=KV_HEADS,
            head_dim=HEAD_DIM, qk_head_dim=HEAD_DIM, v_head_dim=HEAD_DIM, scaling=self.scale,
            logit_cap=0.0, sliding_window_size=-1 if window is None else window,
            is_cross_attention=False, k_scale=None, v_scale=None) for s in range(sets)]
        if case.is_multistep:
            return self._kvattn_multistep_setup(case, data, pool, req_pool, layers, req_to_token)
        with self.on_stream():
            backend = KvattnAttnBackend(pool, req_pool, num_q_heads=Q_HEADS,
                                        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                        q_dtype=torch.bfloat16, sliding_window_size=window)
            # Verify and decode as an engine's CUDA-graph mode runs them: fixed buffers for
            # batches of up to max_bs requests and max_num_tokens query tokens (the tree's, for
            # verify), on which the tensor-core paths capture. A decode step that declares
            # shared-prefix groups runs eagerly (kvattn refuses to capture it).
            graph_buffers = case.is_verify or (case.is_decode and not (
                case.is_shared_prefix and case.declares_groups))
            if graph_buffers:
                backend.init_cuda_graph_state(case.batch, case.tokens)
        if fp8 and hasattr(backend.kv_cache, "set_scales"):
            for s in range(sets):
                backend.kv_cache.set_scales(s, 1.0, 1.0)
        b = case.batch
        # TARGET_VERIFY: seq_lens are the committed prefix (SGLang); the tree comes on top.
        seq = torch.full((b,), case.prefix_len if case.is_verify else case.kv_len,
                         dtype=torch.int64)
        mode = ("DECODE" if case.is_decode else "TARGET_VERIFY" if case.is_verify else
                "DRAFT_EXTEND" if case.is_draft_extend else "EXTEND")
        fields = dict(
            forward_mode=Mode(mode), batch_size=b,
            req_pool_indices=torch.arange(b, dtype=torch.int64, device=self.device),
            seq_lens=seq.to(self.device), seq_lens_cpu=seq, seq_lens_sum=int(seq.sum()),
            extend_prefix_lens=None, extend_prefix_lens_cpu=None, extend_seq_lens=None,
            extend_seq_lens_cpu=None, encoder_lens=None, spec_info=None,
            token_to_kv_pool=pool, req_to_token_pool=req_pool)
        if case.is_decode:
            fields["out_cache_loc"] = layout.slots[:, -1].contiguous()
            fields["positions"] = torch.full((b,), case.kv_len - 1, dtype=torch.int64,
                                             device=self.device)
            if case.is_shared_prefix:
                # Shared-prefix groups (README.md, "Shared-prefix (cascade) attention"): every
                # request in group 0, or (no-cascade) the groups declared as none at all.
                fields["shared_prefix_group_cpu"] = [0 if case.declares_groups else -1] * b
                fields["shared_prefix_lens_cpu"] = [case.shared_prefix] if \
                    case.declares_groups else None
        elif case.is_verify:
            # The tree's slots, positions (prefix + depth) and mask, as SGLang's verify batch
            # holds them (spec_info.custom_mask / draft_token_num).
            fields["out_cache_loc"] = layout.slots[:, case.prefix_len:].reshape(-1).contiguous()
            fields["positions"] = data.tree_positions
            fields["spec_info"] = types.SimpleNamespace(custom_mask=data.custom_mask,
                                                        draft_token_num=case.qo_len)
        else:
            fields["out_cache_loc"] = layout.slots[:, case.prefix_len:].reshape(-1).contiguous()
            fields["positions"] = (torch.arange(case.prefix_len, case.kv_len, device=self.device)
                                   .repeat(b))
            fields["extend_prefix_lens"] = torch.full((b,), case.prefix_len, dtype=torch.int32,
                                                      device=self.device)
            fields["extend_prefix_lens_cpu"] = [case.prefix_len] * b
            fields["extend_seq_lens"] = torch.full((b,), case.qo_len, dtype=torch.int32,
                                                   device=self.device)
            fields["extend_seq_lens_cpu"] = [case.qo_len] * b
            fields["extend_num_tokens"] = case.tokens
        batch = types.SimpleNamespace(**fields)
        self.sync()  # the batch fields were made on the default stream
        with self.on_stream():
            if graph_buffers:
                # An engine's capture: out_graph (host plan, outside the graph; in_capture
                # checks that the step runs on the graph buffers), then in_graph (the index
                # build, device work an engine records in the graph; run once here, it is
                # per step, not per layer: timed apart below) and the layers' forward.
                backend.init_forward_metadata_out_graph(batch, in_capture=True)
                backend.init_forward_metadata_in_graph(batch)
            else:
                backend.init_forward_metadata(batch)
        self.sync()
        keep = (backend, batch, layers, req_to_token)  # alive as long as the closure

        if case.is_decode or case.is_verify:
            def call(i, keep=keep):
                return keep[0].forward(data.q[i], None, None, keep[2][i], keep[1],
                                       save_kv_cache=False)
            if case.is_verify:
                call.extra_timing = lambda keep=keep: self._timed_extra(
                    "in_graph", lambda i: keep[0].init_forward_metadata_in_graph(keep[1]))
        else:
            def call(i, keep=keep):
                return keep[0].forward(data.q[i], data.k_new[i], data.v_new[i], keep[2][i],
                                       keep[1], save_kv_cache=False)
        return call, lambda out: out.view(-1, Q_HEADS, HEAD_DIM)

    def _kvattn_multistep_setup(self, case: Case, data: Data, pool, req_pool, layers,
                                req_to_token):
        """KvattnMultiStepDraftBackend as an engine's draft worker runs it in CUDA-graph mode:
        init_cuda_graph_state(max_bs), init_forward_metadata (every step's index set, seq_lens =
        the committed prefix), then attn_backends[t].forward for step t. One call = all steps
        (the K/V of the draft tokens are in the pool already: save_kv_cache=False)."""
        torch = self.torch
        from kvattn.torch_backend import KvattnMultiStepDraftBackend
        b = case.batch
        with self.on_stream():
            draft = KvattnMultiStepDraftBackend(pool, req_pool, case.topk, case.num_steps,
                                                num_q_heads=Q_HEADS, num_kv_heads=KV_HEADS,
                                                head_dim=HEAD_DIM, q_dtype=torch.bfloat16)
            draft.init_cuda_graph_state(b)
        seq = torch.full((b,), case.prefix_len, dtype=torch.int64)
        batch = types.SimpleNamespace(
            forward_mode=Mode("DECODE"), batch_size=b,
            req_pool_indices=torch.arange(b, dtype=torch.int64, device=self.device),
            seq_lens=seq.to(self.device), seq_lens_cpu=seq, seq_lens_sum=int(seq.sum()),
            extend_prefix_lens=None, extend_prefix_lens_cpu=None, extend_seq_lens=None,
            extend_seq_lens_cpu=None, encoder_lens=None, out_cache_loc=None, positions=None,
            spec_info=types.SimpleNamespace(topk=case.topk, num_steps=case.num_steps),
            token_to_kv_pool=pool, req_to_token_pool=req_pool)
        self.sync()
        with self.on_stream():
            draft.init_forward_metadata(batch)
        self.sync()
        rows = b * case.topk
        queries = [[q[t * rows:(t + 1) * rows] for t in range(case.num_steps)] for q in data.q]
        steps = draft.attn_backends
        keep = (draft, batch, layers, req_to_token)

        def call(i, keep=keep):
            return _StepOutputs([steps[t].forward(queries[i][t], None, None, keep[2][i],
                                                  keep[1], save_kv_cache=False)
                                 for t in range(case.num_steps)])
        return call, lambda out: torch.cat(out.parts).view(-1, Q_HEADS, HEAD_DIM)

    def _timed_extra(self, name: str, call: Callable[[int], object]) -> dict:
        """Row fields `<name>_us` / `<name>_timing` of one more timed call (set-independent),
        or `<name>_error`."""
        try:
            timing = self.time_calls(call, 1)
            return {f"{name}_us": timing["time_us"], f"{name}_timing": timing["timing"]}
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, KeyboardInterrupt):
                raise
            return {f"{name}_error": short_error(e, 200)}

    # ---- torch peers ----

    def sdpa_setup(self, case: Case, data: Data, backend_name: str):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend = {"torch-sdpa-flash": SDPBackend.FLASH_ATTENTION,
                   "torch-sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
        b = case.batch
        keys = [self._contiguous_kv(case, k) for k in data.k]
        values = [self._contiguous_kv(case, v) for v in data.v]
        if case.is_decode:
            # GQA folded into the query length: the 4 q heads of a KV head are 4 queries of it
            # (exact for decode, and needs no enable_gqa support).
            queries = [q.view(b, KV_HEADS, GROUP, HEAD_DIM) for q in data.q]

            def call(i):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(queries[i], keys[i], values[i],
                                                          scale=self.scale)
            return call, lambda out: out.reshape(b, Q_HEADS, HEAD_DIM)
        queries = [q.view(b, case.qo_len, Q_HEADS, HEAD_DIM).transpose(1, 2) for q in data.q]
        mask = None
        if case.prefix_len:
            from torch.nn.attention.bias import causal_lower_right
            mask = causal_lower_right(case.qo_len, case.kv_len)
        note = {}

        def attend(i, k, v, gqa):
            with sdpa_kernel([backend]):
                if mask is None:
                    return F.scaled_dot_product_attention(queries[i], k, v, is_causal=True,
                                                          scale=self.scale, enable_gqa=gqa)
                return F.scaled_dot_product_attention(queries[i], k, v, attn_mask=mask,
                                                      scale=self.scale, enable_gqa=gqa)
        try:
            attend(0, keys[0], values[0], True)
            self.sync()

            def call(i):
                return attend(i, keys[i], values[i], True)
        except RuntimeError as e:
            # enable_gqa refused: repeat the KV heads outside the timed call (reads 4x the KV).
            note["note"] = "enable_gqa refused (" + short_error(e, 120) + "): KV heads repeated"
            keys = [k.repeat_interleave(GROUP, dim=1) for k in keys]
            values = [v.repeat_interleave(GROUP, dim=1) for v in values]

            def call(i):
                return attend(i, keys[i], values[i], False)
        self._sdpa_note = note.get("note", "")
        self.sync()  # repeated KV heads (default stream) before the calls on self.stream
        return call, lambda out: out.transpose(1, 2).reshape(-1, Q_HEADS, HEAD_DIM)

    def _contiguous_kv(self, case: Case, kv):
        """[batch, kv_len, 8, 128] -> [batch, 8, kv_len, 128] view; the window's last
        window + 1 tokens for a sliding-window decode."""
        view = kv.transpose(1, 2)
        if case.window >= 0:
            view = view[:, :, -case.attended_kv_len:]
        return view

    def flex_setup(self, case: Case, data: Data):
        torch = self.torch
        if self.flex is None:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                         "accumulated_recompile_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, 512)
            self.flex = (torch.compile(flex_attention, dynamic=False), create_block_mask)
        flex, create_block_mask = self.flex
        b = case.batch
        keys = [self._contiguous_kv(case, k) for k in data.k]
        values = [self._contiguous_kv(case, v) for v in data.v]
        if case.is_decode:
            queries = [q.view(b, Q_HEADS, 1, HEAD_DIM) for q in data.q]
            block_mask = None
        else:
            queries = [q.view(b, case.qo_len, Q_HEADS, HEAD_DIM).transpose(1, 2) for q in data.q]
            prefix = case.prefix_len

            def causal(batch, head, q_idx, kv_idx):
                return q_idx + prefix >= kv_idx
            try:  # compiled mask building: the eager one materializes q_len x kv_len
                block_mask = create_block_mask(causal, None, None, case.qo_len, case.kv_len,
                                               device=self.device, _compile=True)
            except TypeError:
                block_mask = create_block_mask(causal, None, None, case.qo_len, case.kv_len,
                                               device=self.device)

        def call(i):
            return flex(queries[i], keys[i], values[i], block_mask=block_mask, scale=self.scale,
                        enable_gqa=True)
        self.sync()  # the block mask (default stream) before the calls on self.stream
        return call, lambda out: out.transpose(1, 2).reshape(-1, Q_HEADS, HEAD_DIM)

    # ---- FlashInfer ----

    def flashinfer_setup(self, case: Case, data: Data, layout: Layout, impl: str, sets: int):
        torch = self.torch
        fi = self.flashinfer
        if not self.cuda:
            raise RuntimeError("FlashInfer needs CUDA (CPU dry run)")
        if self.fi_workspace is None:
            # Zeroed: FlashInfer asks for a float workspace "initialized to 0 for its first use".
            self.fi_workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8,
                                            device=self.device)
        ws = self.fi_workspace
        b, ps = case.batch, case.page_size
        kv_dtype = self.kv_torch_dtype(case)
        pages_4d = lambda pool: pool.view(kv_dtype).view(layout.num_pages, ps, KV_HEADS,
                                                         HEAD_DIM)
        kv_caches = [(pages_4d(layout.k_pool[s]), pages_4d(layout.v_pool[s]))
                     for s in range(sets)]
        i32 = dict(dtype=torch.int32, device=self.device)
        per_request = layout.pages.shape[1]
        kv_indptr = torch.arange(b + 1, **i32) * per_request
        kv_indices = layout.pages.reshape(-1).to(torch.int32)
        last_page_len = torch.full((b,), case.kv_len - (per_request - 1) * ps, **i32)
        window = case.window
        outs = [torch.empty((case.tokens, Q_HEADS, HEAD_DIM), dtype=torch.bfloat16,
                            device=self.device) for _ in range(sets)]
        finish = lambda out: out
        keep = []
        # Everything above ran on the default stream; plan() copies indptr to the host on
        # self.stream and the kernels read indices, pools and q there. Without this the plan
        # can read indptr before it is written (the cause of the illegal memory access at
        # b64 x 4096 page 1: a ~1 GiB pool scatter still queued on the default stream).
        self.sync()

        with self.on_stream():
            if case.is_verify:
                return self._flashinfer_verify(case, data, impl, kv_caches, kv_indptr,
                                               kv_indices, last_page_len, outs, keep)
            if case.is_multistep:
                return self._flashinfer_multistep(case, data, layout, impl, kv_caches, outs,
                                                  keep)
            if impl == "flashinfer-cascade":
                return self._flashinfer_cascade(case, data, layout, kv_caches, keep)
            if impl in ("flashinfer-decode", "flashinfer-decode-tc"):
                tc = impl.endswith("-tc")
                wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_tensor_cores=tc, backend="fa2" if tc else "auto")
                wrapper.plan(kv_indptr, kv_indices, last_page_len, Q_HEADS, KV_HEADS, HEAD_DIM,
                             ps, window_left=window, q_data_type=torch.bfloat16,
                             kv_data_type=kv_dtype, sm_scale=self.scale)
                keep.append(wrapper)

                def call(i):
                    return wrapper.run(data.q[i], kv_caches[i], out=outs[i])
                return call, finish

            backend = "fa3" if "fa3" in impl else "fa2"
            qo_indptr = torch.arange(b + 1, **i32) * case.qo_len
            if impl in ("flashinfer-fa2", "flashinfer-fa3"):
                wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
                wrapper.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, Q_HEADS, KV_HEADS,
                             HEAD_DIM, ps, causal=True, sm_scale=self.scale, window_left=window,
                             q_data_type=torch.bfloat16, kv_data_type=kv_dtype)

                def call(i):
                    return wrapper.run(data.q[i], kv_caches[i], out=outs[i])
                return call, finish

            ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
            ragged.plan(qo_indptr, qo_indptr, Q_HEADS, KV_HEADS, HEAD_DIM, causal=True,
                        sm_scale=self.scale, q_data_type=torch.bfloat16,
                        kv_data_type=torch.bfloat16)
            if impl.endswith("-ragged"):
                def call(i):
                    return ragged.run(data.q[i], data.k_new[i], data.v_new[i], out=outs[i])
                return call, finish

            # "+merge": the reference backend's extend (ragged new tokens, paged prefix,
            # merge_state).
            prefix_pages = -(-case.prefix_len // ps)
            prefix_indptr = torch.arange(b + 1, **i32) * prefix_pages
            prefix_indices = layout.pages[:, :prefix_pages].reshape(-1).to(torch.int32)
            prefix_last = torch.full((b,), case.prefix_len - (prefix_pages - 1) * ps, **i32)
            paged = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
            paged.plan(qo_indptr, prefix_indptr, prefix_indices, prefix_last, Q_HEADS, KV_HEADS,
                       HEAD_DIM, ps, causal=False, sm_scale=self.scale,
                       q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
            merge_state = fi.merge_state

            def call(i):
                o1, s1 = ragged.run(data.q[i], data.k_new[i], data.v_new[i], return_lse=True)
                o2, s2 = paged.run(data.q[i], kv_caches[i], return_lse=True)
                return merge_state(o1, s1, o2, s2)[0]
            return call, finish

    def _flashinfer_cascade(self, case: Case, data: Data, layout: Layout, kv_caches,
                            keep: list):
        """A shared-prefix row through FlashInfer's MultiLevelCascadeAttentionWrapper, 2 levels
        over the same paged cache: level 0 all b queries (one qo segment) over the prompt's
        pages, level 1 each query over its request's own pages; run() merges the two states
        (merge_state_in_place). Planned once, as the decode wrappers."""
        torch = self.torch
        fi = self.flashinfer
        b, ps = case.batch, case.page_size
        i32 = dict(dtype=torch.int32, device=self.device)
        shared_pages = case.shared_prefix // ps
        own_pages = layout.pages.shape[1] - shared_pages
        own = case.kv_len - case.shared_prefix
        wrapper = fi.MultiLevelCascadeAttentionWrapper(2, self.fi_workspace, "NHD")
        wrapper.plan(
            [torch.tensor([0, b], **i32), torch.arange(b + 1, **i32)],
            [torch.tensor([0, shared_pages], **i32), torch.arange(b + 1, **i32) * own_pages],
            [layout.pages[0, :shared_pages].to(torch.int32).contiguous(),
             layout.pages[:, shared_pages:].reshape(-1).to(torch.int32)],
            [torch.tensor([ps], **i32), torch.full((b,), own - (own_pages - 1) * ps, **i32)],
            Q_HEADS, KV_HEADS, HEAD_DIM, ps, causal=False, sm_scale=self.scale,
            q_data_type=torch.bfloat16, kv_data_type=self.kv_torch_dtype(case))
        keep.append(wrapper)

        def call(i):
            return wrapper.run(data.q[i], kv_caches[i])
        return call, lambda out: out

    def _flashinfer_verify(self, case: Case, data: Data, impl: str, kv_caches, kv_indptr,
                           kv_indices, last_page_len, outs, keep: list):
        """TARGET_VERIFY as SGLang's FlashInfer backend runs it: the paged prefill wrapper over
        prefix + tree, the tree as `custom_mask` (bool, flattened per request; plan() packs it
        with segment_packbits), causal off. 'flashinfer-fa2': a plain wrapper planned once;
        'flashinfer-fa2-graph': the reference's captured verify, a use_cuda_graph=True wrapper
        over fixed index / mask buffers (its plan pads for graph replay). FA3 takes no custom
        mask in 0.6.13 (prefill_sm90.cuh: MaskMode::kCustom -> cudaErrorNotSupported)."""
        torch = self.torch
        fi = self.flashinfer
        ws = self.fi_workspace
        b = case.batch
        i32 = dict(dtype=torch.int32, device=self.device)
        qo_indptr = torch.arange(b + 1, **i32) * case.qo_len
        if impl == "flashinfer-fa2":
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
        elif impl == "flashinfer-fa2-graph":
            # Sized as the reference sizes them for one bucket of b requests (its mask buffer:
            # max_bs x max_context_len bytes; the packed mask needs an eighth of the bits).
            mask_bytes = b * ((case.qo_len * case.kv_len + 7) // 8)
            buffers = dict(
                qo_indptr_buf=torch.empty(b + 1, **i32),
                paged_kv_indptr_buf=torch.empty(b + 1, **i32),
                paged_kv_indices_buf=torch.empty(kv_indices.numel(), **i32),
                paged_kv_last_page_len_buf=torch.empty(b, **i32),
                custom_mask_buf=torch.empty(mask_bytes, dtype=torch.uint8, device=self.device),
                mask_indptr_buf=torch.empty(b + 1, **i32))
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True,
                                                             backend="fa2", **buffers)
            keep.append(buffers)
        else:
            raise ValueError(f"not a verify implementation: {impl}")
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, Q_HEADS, KV_HEADS,
                     HEAD_DIM, case.page_size, custom_mask=data.custom_mask, causal=False,
                     sm_scale=self.scale, q_data_type=torch.bfloat16,
                     kv_data_type=self.kv_torch_dtype(case))
        keep.append(wrapper)

        def call(i):
            return wrapper.run(data.q[i], kv_caches[i], out=outs[i])
        return call, lambda out: out

    def _flashinfer_multistep(self, case: Case, data: Data, layout: Layout, impl: str,
                              kv_caches, outs, keep: list):
        """The multi-step draft as SGLang's FlashInfer draft backend runs it: one decode wrapper
        per step over batch x topk rows (request-major, branch-minor), step t's row reading the
        prefix and its branch's draft tokens of steps 0..t (at prefix + s x topk + branch, the
        layout of generate_draft_decode_kv_indices). Each wrapper planned once; a call runs every
        step (CUDA cores, or tensor cores with backend fa2 for '-tc')."""
        torch = self.torch
        fi = self.flashinfer
        if case.page_size != 1:
            raise ValueError("the multi-step draft rows use page size 1")
        b, topk, steps, prefix = case.batch, case.topk, case.num_steps, case.prefix_len
        rows = b * topk
        tc = impl.endswith("-tc")
        slots = layout.pages.to(torch.int32)  # page 1: a page index is a slot
        prefix_slots = slots[:, :prefix].unsqueeze(1).expand(b, topk, prefix)
        draft_slots = slots[:, prefix:].reshape(b, steps, topk).transpose(1, 2)  # [b, topk, t]
        i32 = dict(dtype=torch.int32, device=self.device)
        last_page_len = torch.ones(rows, **i32)
        wrappers = []
        for t in range(steps):
            indices = torch.cat([prefix_slots, draft_slots[:, :, :t + 1]], dim=2).reshape(-1)
            indptr = torch.arange(rows + 1, **i32) * (prefix + t + 1)
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                self.fi_workspace, "NHD", use_tensor_cores=tc, backend="fa2" if tc else "auto")
            wrapper.plan(indptr, indices.contiguous(), last_page_len, Q_HEADS, KV_HEADS,
                         HEAD_DIM, 1, q_data_type=torch.bfloat16,
                         kv_data_type=self.kv_torch_dtype(case), sm_scale=self.scale)
            wrappers.append(wrapper)
            keep.append((wrapper, indices, indptr))
        queries = [[q[t * rows:(t + 1) * rows] for t in range(steps)] for q in data.q]
        parts = [[out[t * rows:(t + 1) * rows] for t in range(steps)] for out in outs]

        def call(i):
            for t in range(steps):
                wrappers[t].run(queries[i][t], kv_caches[i], out=parts[i][t])
            return outs[i]
        return call, lambda out: out

    # ---- passes ----

    def pass_a(self, groups: List[List[Case]]) -> None:
        """kvattn and torch SDPA on every row, while FlashInfer compiles elsewhere."""
        torch_deadline = self.start + 0.62 * self.args.budget_s
        sdpa = [p for p in report.TORCH_PEERS if p != "torch-flex"]
        for group in groups:
            if self.context_lost:
                self.skip_unrecorded(group, [KVATTN] + sdpa, self.lost_why())
                continue
            if self.left() < 30:
                for case in group:
                    for impl in [KVATTN] + sdpa:
                        if runs_impl(case, impl):
                            self.skip(case, impl, "skipped: budget")
                continue
            try:
                self._pass_a_group(group, sdpa, torch_deadline)
            except BaseException as e:  # noqa: BLE001
                if isinstance(e, KeyboardInterrupt):
                    raise
                self.group_failed(group, [KVATTN] + sdpa, e)
            self.empty_cache()
            self.write_outputs(final=False)

    def _pass_a_group(self, group: List[Case], sdpa: List[str], torch_deadline: float) -> None:
        first = group[0]
        sets = self.sets_for(first)
        self._sets = sets
        self.log(f"pass A: {first.label} ({len(group)} layout(s), {sets} input set(s))")
        data = self.build_data(first, sets)
        self.checksums[first.data_key] = data.checksum
        self.references[first.data_key] = self.reference(first, data)
        torch_rows: Dict[str, dict] = {}
        for case in group:
            if self.context_lost:
                self.skip_unrecorded([case], [KVATTN] + sdpa, self.lost_why())
                continue
            layout = self.build_layout(case, data, sets)
            if not impl_wanted(self.args, KVATTN):
                pass
            elif self.kvattn is None:
                self.skip(case, KVATTN, self.kvattn_error)
            else:
                row = self.run_impl(case, KVATTN, lambda: self.kvattn_setup(
                    case, data, layout, sets), allow_graph=case.kvattn_graph)
                out = row.get("_out")
                if out is not None:
                    self.kvattn_out[case.label] = out.to("cpu")
                self.record(case, row)
            layout = None
            if self.context_lost:
                self.skip_unrecorded([case], sdpa, self.lost_why())
                continue
            for impl in sdpa:
                if not impl_wanted(self.args, impl) or not runs_impl(case, impl):
                    continue
                if impl in torch_rows:
                    self.record(case, self._reuse_torch_row(case, torch_rows[impl]))
                    continue
                row = self._run_torch_peer(case, data, impl, torch_deadline)
                torch_rows[impl] = row
                self.record(case, dict(row))
            self.empty_cache()
            self.write_outputs(final=False)
        data = None
        self.empty_cache()

    def _run_torch_peer(self, case: Case, data: Data, impl: str, deadline: float) -> dict:
        if case.kv_dtype != "bf16":
            return report.make_row(case, impl, None, self.ceilings,
                                   error="not run: torch SDPA / flex take no fp8 KV")
        if impl == "torch-flex":
            if not flex_wanted(self.args, case):
                return report.make_row(case, impl, None, self.ceilings,
                                       error="not run: --flex " + self.args.flex)
            if time.monotonic() > deadline:
                return report.make_row(case, impl, None, self.ceilings,
                                       error="skipped: budget (flex compiles per shape)")
            row = self.run_impl(case, impl, lambda: self.flex_setup(case, data))
            row["note"] = "torch.compile(flex_attention), contiguous KV"
        else:
            if time.monotonic() > deadline:
                return report.make_row(case, impl, None, self.ceilings, error="skipped: budget")
            self._sdpa_note = ""
            row = self.run_impl(case, impl, lambda: self.sdpa_setup(case, data, impl))
            row["note"] = "contiguous KV" + (
                ", GQA folded into q_len" if case.is_decode else "") + (
                "; " + self._sdpa_note if self._sdpa_note else "")
        out = row.get("_out")
        ref = self.kvattn_out.get(case.label)
        if out is not None and ref is not None:
            row["rel_diff_vs_kvattn"] = self.full_rel_diff(out, ref)
        if out is not None:
            row["_out_host"] = out.to("cpu")
        row.pop("_out", None)
        return row

    def _reuse_torch_row(self, case: Case, measured: dict) -> dict:
        """The torch peers read a contiguous KV copy, the same for every page layout: the first
        layout's measurement stands for the others (compared against this layout's kvattn)."""
        row = {k: v for k, v in measured.items() if k != "_out_host"}
        row.update(page_size=case.page_size, variant=case.variant)
        row["note"] = (row.get("note", "") + "; measured once for all page layouts").lstrip("; ")
        out = measured.get("_out_host")
        ref = self.kvattn_out.get(case.label)
        if out is not None and ref is not None:
            row["rel_diff_vs_kvattn"] = self.full_rel_diff(out.to(self.device), ref)
        return row

    def pass_c(self, groups: List[List[Case]], deadline: float) -> None:
        """torch flex_attention, one torch.compile per shape, with the time that is left:
        prefill and extend first, then decode (starts nothing past `deadline`)."""
        if not impl_wanted(self.args, "torch-flex"):
            return
        groups = [g for g in groups if runs_impl(g[0], "torch-flex")]
        order = [g for g in groups if not g[0].is_decode] + [g for g in groups if g[0].is_decode]
        for group in order:
            first = group[0]
            if self.context_lost:
                self.skip_unrecorded(group, ["torch-flex"], self.lost_why())
                continue
            try:
                if first.kv_dtype != "bf16" or not flex_wanted(self.args, first) or \
                        time.monotonic() > deadline:
                    row = self._run_torch_peer(first, None, "torch-flex", deadline)
                else:
                    sets = self.sets_for(first)
                    self._sets = sets
                    self.log(f"pass C: {first.label} ({sets} input set(s))")
                    data = self.build_data(first, sets)
                    if first.data_key not in self.references:
                        self.references[first.data_key] = self.reference(first, data)
                    row = self._run_torch_peer(first, data, "torch-flex", deadline)
                    data = None
                self.record(first, dict(row))
                for case in group[1:]:
                    self.record(case, self._reuse_torch_row(case, row))
            except BaseException as e:  # noqa: BLE001
                if isinstance(e, KeyboardInterrupt):
                    raise
                self.group_failed(group, ["torch-flex"], e)
            self.empty_cache()
            self.write_outputs(final=False)

    def pass_b(self, groups: List[List[Case]]) -> None:
        """FlashInfer on every row, in a worker subprocess (`--fi-worker`, fi_worker_main) with
        its own CUDA context: a device fault there (an illegal memory access ends a context)
        costs that one measurement. The worker runs the (row, impl) items in order on inputs
        rebuilt from the same seeds and reports each one to an event file; when it dies or
        stops after a lost context, a fresh worker takes the items it never reached."""
        items = [(case.label, impl) for group in groups for case in group
                 for impl in case.peers()
                 if impl.startswith("flashinfer") and impl_wanted(self.args, impl)]
        if not items:
            return
        by_label = {case.label: case for case in self.cases}
        if self.flashinfer is None:
            for label, impl in items:
                self.skip(by_label[label], impl, self.flashinfer_error or "not run")
            return
        workdir = tempfile.mkdtemp(prefix="peers-fi-")
        kvattn_files: Dict[str, str] = {}
        for label in dict.fromkeys(label for label, _ in items):
            out = self.kvattn_out.get(label)
            if out is not None:
                path = os.path.join(workdir, f"kvattn-{len(kvattn_files)}.pt")
                self.torch.save(out, path)
                kvattn_files[label] = path
        checksums = {case.label: self.checksums[case.data_key] for case in self.cases
                     if case.data_key in self.checksums}
        self.empty_cache()
        remaining = items
        failed_starts = 0
        worker = 0
        while remaining:
            if self.left() < JIT_END_RESERVE_S + FI_WORKER_START_S:  # the worker needs both
                for label, impl in remaining:
                    self.skip(by_label[label], impl, "skipped: budget")
                break
            worker += 1
            events_path = os.path.join(workdir, f"events-{worker}.jsonl")
            job_path = os.path.join(workdir, f"job-{worker}.json")
            with open(job_path, "w") as f:
                json.dump({"items": remaining, "ceilings": self.ceilings, "checksums": checksums,
                           "kvattn": kvattn_files, "budget_left_s": self.left() - 1.0,
                           "events": events_path, "worker": worker,
                           "jit_status": self.jit.status_path if self.jit else ""}, f)
            if self.jit is not None:
                self.jit.mark_gone()
            cmd = [sys.executable, os.path.abspath(__file__), "--fi-worker", job_path,
                   "--target-s", str(self.args.target_s)]
            cmd += ["--quick"] if self.args.quick else []
            cmd += ["--cpu-dry-run"] if self.args.cpu_dry_run else []
            self.log(f"pass B: FlashInfer worker {worker} for {len(remaining)} measurement(s)")
            process = subprocess.Popen(cmd, cwd=REPO_ROOT)  # its log goes to ours
            seen = 0
            killed = False
            while True:
                rc = process.poll()
                events = read_events(events_path)
                for event in events[seen:]:
                    self._take_worker_event(by_label, event)
                seen = len(events)
                if rc is not None:
                    break
                if self.jit is not None:
                    self.jit.mark_gone()
                if self.left() < 1.0:
                    process.kill()  # our own child, by its Popen handle
                    process.wait()
                    killed = True
                time.sleep(0.2)
            rows, died_in, rest, notes = settle_worker_events(remaining, read_events(events_path))
            self.notes.extend(notes)
            if died_in is not None:
                label, impl = died_in
                why = ("killed at the end of the budget" if killed else
                       f"FlashInfer worker died ({describe_rc(rc)}) during this measurement")
                self.skip(by_label[label], impl, why)
                self.log(f"  {impl}: {why}")
            if killed:
                for label, impl in rest:
                    self.skip(by_label[label], impl, "skipped: budget")
                break
            if rc != 0 and not rows and died_in is None:
                failed_starts += 1
                if failed_starts >= FI_WORKER_MAX_FAILED_STARTS:
                    self._pass_b_here(by_label, rest, kvattn_files, checksums,
                                      f"FlashInfer workers failed to start ({describe_rc(rc)})")
                    break
            elif rc == 0 and rest:
                for label, impl in rest:
                    self.skip(by_label[label], impl, "not run: the FlashInfer worker ended early")
                break
            remaining = rest
            if rest:
                self.log(f"pass B: worker {worker} ended ({describe_rc(rc)}); "
                         f"{len(rest)} measurement(s) left for a fresh worker")
            self.write_outputs(final=False)
        self.versions.update(getattr(self, "_worker_versions", {}))

    def _pass_b_here(self, by_label: Dict[str, Case], items: List[Tuple[str, str]],
                     kvattn_files: Dict[str, str], checksums: Dict[str, float],
                     why: str) -> None:
        """The old way, when no worker can start (e.g. a GPU in exclusive-process mode): the
        items in this process, unisolated; after a lost context the rest are not run."""
        if self.context_lost:
            for label, impl in items:
                self.skip(by_label[label], impl, f"{why}; {self.lost_why()}")
            return
        self.log(f"pass B: {why}: FlashInfer in the main process, not isolated")
        self.notes.append(f"pass B ran in the main process: {why}")
        events: List[dict] = []

        def emit(**event) -> None:
            events.append(event)
            self._take_worker_event(by_label, event)

        self.worker_pass_b({"items": items, "kvattn": kvattn_files, "checksums": checksums},
                           emit)
        rows, died_in, rest, notes = settle_worker_events(items, events)
        self.notes.extend(notes)
        for label, impl in rest:
            self.skip(by_label[label], impl, self.lost_why())
        self.empty_cache()

    def _take_worker_event(self, by_label: Dict[str, Case], event: dict) -> None:
        """Records a row a pass-B worker reported (and Δ FI on kvattn's row)."""
        if event.get("event") == "versions":
            self._worker_versions = event.get("versions", {})
            return
        if event.get("event") != "row":
            return
        case = by_label[event["label"]]
        row = event["row"]
        diff = row.get("rel_diff_vs_kvattn")
        mine = self.rows.get((case.label, KVATTN))
        if diff is not None and mine is not None:
            previous = mine.get("max_rel_diff_vs_flashinfer")
            mine["max_rel_diff_vs_flashinfer"] = diff if previous is None else max(previous, diff)
        self.record(case, row)
        self.write_outputs(final=False)

    def worker_pass_b(self, job: dict, emit: Callable[..., None]) -> int:
        """The worker's side of pass B: the job's (label, impl) items in order, one 'start' and
        one 'row' event each; returns FI_WORKER_LOST_RC right after a measurement that lost
        the CUDA context (its row says so), 0 when all are done."""
        torch = self.torch
        hook = parse_test_hook(os.environ.get("PEERS_TEST_CRASH", ""))
        by_label = {case.label: case for case in self.cases}
        data = layout = kvattn_out = None
        data_key = label_now = None
        sets = 1
        for label, impl in job["items"]:
            case = by_label[label]
            emit(event="start", label=label, impl=impl)
            try:
                if self.left() < JIT_END_RESERVE_S:
                    raise _Skip("skipped: budget")
                if case.data_key != data_key:
                    data = layout = None
                    data_key = label_now = None
                    self.empty_cache()
                    sets = self.sets_for(case)
                    self._sets = sets
                    self.log(f"pass B: {case.label} ({sets} input set(s))")
                    data = self.build_data(case, sets)
                    self.references[case.data_key] = self.reference(case, data)
                    expected = job["checksums"].get(label)
                    if expected is not None and abs(expected - data.checksum) > 1e-3:
                        emit(event="note", text=f"{label}: pass B inputs differ from pass A's "
                                                f"(checksum {data.checksum} vs {expected})")
                    data_key = case.data_key
                if label != label_now:
                    layout = kvattn_out = None
                    layout = self.build_layout(case, data, sets)
                    path = job["kvattn"].get(label)
                    kvattn_out = torch.load(path) if path else None
                    label_now = label
                if self.jit is not None:
                    why = self.jit.wait(modules_of_impl(case, impl),
                                        self.deadline - JIT_END_RESERVE_S)
                    if why:
                        raise _Skip(why)
            except _Skip as e:
                emit(event="row", label=label, impl=impl,
                     row=report.make_row(case, impl, None, self.ceilings, error=str(e)))
                continue
            except BaseException as e:  # noqa: BLE001 - inputs failed: this item's error
                if isinstance(e, KeyboardInterrupt):
                    raise
                traceback.print_exc(limit=3)
                row = report.make_row(case, impl, None, self.ceilings,
                                      error="inputs failed: " + short_error(e))
                data_key = label_now = None  # rebuilt for the next item
                if not self.context_alive(str(e)):
                    row["error"] += " [CUDA context lost]"
                    emit(event="row", label=label, impl=impl, row=row)
                    return FI_WORKER_LOST_RC
                emit(event="row", label=label, impl=impl, row=row)
                continue

            def setup(case=case, impl=impl):
                if hook and hook[1] == impl and re.search(hook[2], case.label):
                    if hook[0] == "abort":
                        self.log(f"  {impl}: PEERS_TEST_CRASH: aborting this worker")
                        os.abort()
                    if hook[0] == "hang":
                        self.log(f"  {impl}: PEERS_TEST_CRASH: hanging")
                        time.sleep(1e6)
                    raise RuntimeError("CUDA error: an illegal memory access was encountered "
                                       "(PEERS_TEST_CRASH)")
                return self.flashinfer_setup(case, data, layout, impl, sets)

            row = self.run_impl(case, impl, setup)
            out = row.pop("_out", None)
            if out is not None and kvattn_out is not None:
                row["rel_diff_vs_kvattn"] = self.full_rel_diff(out, kvattn_out)
            out = None
            row = {k: v for k, v in row.items() if not k.startswith("_")}
            emit(event="row", label=label, impl=impl, row=row)
            if self.context_lost:
                return FI_WORKER_LOST_RC
        return 0

    # ---- outputs ----

    def ordered_rows(self) -> List[dict]:
        order = {name: i for i, name in enumerate((KVATTN,) + report.PEER_ORDER)}
        rows = []
        for case in self.cases:
            mine = [r for (label, _), r in self.rows.items() if label == case.label]
            rows.extend(sorted(mine, key=lambda r: order.get(r["impl"], 99)))
        return rows

    def header(self) -> dict:
        if not hasattr(self, "_commit"):
            self._commit = git_commit(self.args.commit)
        commit, dirty = self._commit
        return {
            "device": self.device_name, "commit": commit, "dirty": dirty,
            "date": self.args.date, "ceilings": {k: round(v, 2) for k, v in
                                                 self.ceilings.items()},
            "versions": self.versions,
            "run": {"budget_s": self.args.budget_s, "elapsed_s": round(self.elapsed(), 1),
                    "quick": self.args.quick, "target_s": self.args.target_s,
                    "read_ceiling": getattr(self, "ceilings_method", "?"),
                    "jit": self.jit.summary() if self.jit else None,
                    "jit_waited_s": round(self.jit.waited_s, 1) if self.jit else None,
                    "notes": self.notes},
        }

    def paths(self) -> Dict[str, str]:
        stamp = self.args.date.replace("-", "")
        out = self.args.out_dir
        return {"json": os.path.join(out, f"peers-{stamp}.json"),
                "md": os.path.join(out, f"peers-{stamp}.md"),
                "png": os.path.join(out, f"peers-{stamp}.png")}

    def write_outputs(self, final: bool) -> None:
        paths = self.paths()
        header = self.header()
        rows = self.ordered_rows()
        report.write_json(paths["json"], header, rows)
        with open(paths["md"], "w") as f:
            f.write(report.markdown_table(header, rows))
        if final:
            why = report.write_plot(paths["png"], header, rows)
            if why:
                self.log(f"no plot: {why}")


class _Skip(Exception):
    """A pass-B item not measured, for a reason that becomes its row's error."""


class _StepOutputs:
    """The outputs of a multi-step draft call, one per step (not a tuple or list: output_of
    takes the first element of those, FlashInfer's (out, lse))."""

    def __init__(self, parts: list):
        self.parts = parts


def read_events(path: str) -> List[dict]:
    """A worker's event lines so far (a line still being written is left for the next read)."""
    events = []
    try:
        with open(path) as f:
            for line in f:
                if not line.endswith("\n"):
                    break
                try:
                    events.append(json.loads(line))
                except ValueError:
                    pass
    except OSError:
        pass
    return events


def fi_worker_main(args: argparse.Namespace) -> int:
    """A pass-B worker: FlashInfer on the job's (label, impl) items, in its own CUDA context,
    each result appended to the job's event file as it is measured."""
    start = time.monotonic()
    hook = parse_test_hook(os.environ.get("PEERS_TEST_CRASH", ""))
    if hook and hook[0] == "start":
        print("fi-worker: PEERS_TEST_CRASH: exiting before any measurement", flush=True)
        return 1
    with open(args.fi_worker) as f:
        job = json.load(f)
    args.budget_s = max(1.0, float(job["budget_left_s"]))
    events = open(job["events"], "a")

    def emit(**event) -> None:
        events.write(json.dumps(event) + "\n")
        events.flush()

    cases = report.make_grid(quick=args.quick)
    if args.cpu_dry_run:
        cases = [report.tiny_case(c) for c in cases]
    wanted = {label for label, _ in job["items"]}
    cases = [c for c in cases if c.label in wanted]
    runner = Runner(args, cases, start)
    runner.log_prefix = f"fi-worker {job.get('worker', '?')}: "
    runner.ceilings = dict(job["ceilings"])
    runner.import_peers(with_kvattn=False)
    emit(event="versions", versions=runner.versions)
    runner.log(f"started in {runner.elapsed():.1f} s (torch, CUDA, FlashInfer imported); "
               f"{len(job['items'])} measurement(s)")
    if runner.flashinfer is None:
        by_label = {c.label: c for c in cases}
        for label, impl in job["items"]:
            emit(event="row", label=label, impl=impl,
                 row=report.make_row(by_label[label], impl, None, runner.ceilings,
                                     error=runner.flashinfer_error or "not run"))
        return 0
    if job.get("jit_status"):
        runner.jit = JitTracker(job["jit_status"], PrebuildStatus(job["jit_status"]))
    rc = runner.worker_pass_b(job, emit)
    events.close()
    if rc == FI_WORKER_LOST_RC:
        # A lost context can make interpreter teardown (CUDA frees) hang or abort: leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def git_commit(fallback: str) -> Tuple[str, bool]:
    # An explicit --commit wins: the device's copy of the tree may carry a .git of another
    # commit (it recorded the landed main instead of the commit that built the wheel once).
    if fallback:
        return fallback, False
    try:
        found = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "HEAD"],
                               capture_output=True, text=True, timeout=10)
        # Outside a repository rev-parse echoes "HEAD" and fails: only a real sha counts.
        sha = found.stdout.strip() if found.returncode == 0 else ""
        dirty = bool(subprocess.run(["git", "-C", REPO_ROOT, "status", "--porcelain", "-uno"],
                                    capture_output=True, text=True, timeout=10).stdout.strip())
        if sha:
            return sha, dirty
    except (OSError, subprocess.SubprocessError):
        pass
    return fallback or "unknown", False


def run(args: argparse.Namespace) -> int:
    start = time.monotonic()
    os.makedirs(args.out_dir, exist_ok=True)
    cases = select_cases(args)
    if not cases:
        print("no rows selected")
        return 2
    groups = report.group_by_data(cases)
    fi_wanted = not args.no_flashinfer and any(
        impl_wanted(args, p) for c in cases for p in c.peers() if p.startswith("flashinfer"))
    process = None
    status_path = os.path.join(tempfile.mkdtemp(prefix="peers-jit-"), "status.jsonl")
    jit_log = os.path.join(args.out_dir, f"peers-jit-{args.date.replace('-', '')}.log")
    if fi_wanted and not args.cpu_dry_run:
        if args.jit_cache_in:
            try:
                print(f"jit cache unpacked into {unpack_jit_cache(args.jit_cache_in)}", flush=True)
            except BaseException as e:  # noqa: BLE001
                print(f"jit cache not used: {short_error(e)}", flush=True)
        if args.aot_dir:
            print(f"FlashInfer prebuilt modules: {install_aot(args.aot_dir)}", flush=True)
        modules = report.needed_flashinfer_modules(cases)
        process = start_prebuild(args, modules, jit_log, status_path)
        print(f"FlashInfer JIT prebuild started: {[module_name(m) for m in modules]} "
              f"(log {jit_log})", flush=True)

    import torch
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print("no CUDA device: nothing to run (--self-test and --cpu-dry-run run without one)")
        return 2
    runner = Runner(args, cases, start)
    runner.jit = JitTracker(status_path, process) if process is not None else None
    runner.import_peers()
    runner.log(f"{runner.device_name}; versions {runner.versions}; "
               f"{len(cases)} rows in {len(groups)} input groups")
    if runner.kvattn_error:
        runner.log(runner.kvattn_error)
    if runner.flashinfer_error:
        runner.log(runner.flashinfer_error)
    try:
        runner.measure_ceilings()
        runner.pass_a(groups)
        runner.log(f"pass A done; JIT: {runner.jit.summary() if runner.jit else None}")
        # flex (pass C) takes what is left after FlashInfer, unless FlashInfer is still compiling:
        # then flex goes first, up to 55% of the budget, while the JIT finishes.
        flex_end = runner.deadline - 25.0
        if runner.jit is not None and not runner.jit.all_done():
            runner.pass_c(groups, min(flex_end, start + 0.55 * args.budget_s))
            runner.pass_b(groups)
        else:
            runner.pass_b(groups)
            runner.pass_c(groups, flex_end)
        if runner.cuda and runner.left() > 5 and not runner.context_lost:
            end_gemm = runner._measure_gemm_tflops()
            if end_gemm:
                runner.ceilings["gemm_bf16_tflops_end"] = end_gemm
    finally:
        if process is not None and process.poll() is None:
            process.terminate()
        runner.write_outputs(final=True)
        if args.jit_cache_out and fi_wanted:
            try:
                size = pack_jit_cache(args.jit_cache_out)
                runner.log(f"JIT cache: {args.jit_cache_out}, {size / MIB:.1f} MiB" +
                           (" (over the 16 MiB a device call returns)" if size > 16 * MIB
                            else ""))
            except BaseException as e:  # noqa: BLE001
                runner.log(f"JIT cache not written: {short_error(e)}")
        paths = runner.paths()
        print("\n" + open(paths["md"]).read(), flush=True)
        runner.log(f"wrote {paths['json']}, {paths['md']}, {paths['png']}")
    return 0


# ---- self-test (no torch, no GPU) --------------------------------------------------------------

def self_test() -> int:
    passed, failed = [], []

    def check(name: str, condition: bool, detail: str = "") -> None:
        (passed if condition else failed).append(name)
        if not condition:
            print(f"FAIL {name} {detail}")

    args = parse_args(["--quick", "--budget-s", "100", "--out-dir", "/tmp/x", "--rows", "decode",
                       "--impls", "kvattn,torch-flex", "--flex", "prefill"])
    check("args", args.quick and args.budget_s == 100 and args.flex == "prefill" and
          impl_wanted(args, "torch-flex") and not impl_wanted(args, "flashinfer-fa2"))
    check("args no-flashinfer", not impl_wanted(parse_args(["--no-flashinfer"]),
                                                "flashinfer-decode"))
    import contextlib
    import io
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parse_args(["--budget-s", "0"])
        check("args reject zero budget", False)
    except SystemExit:
        check("args reject zero budget", True)

    full = report.make_grid()
    decode = [c for c in full if c.is_decode and c.kv_dtype == "bf16" and c.window < 0 and
              not c.is_shared_prefix]
    check("grid decode rows", len(decode) == 28, str(len(decode)))
    check("grid 32768 only b<=16", all(c.batch <= 16 for c in decode if c.kv_len == 32768))
    check("grid prefill", sorted((c.batch, c.qo_len) for c in full if c.workload == "prefill")
          == [(1, 1024), (1, 4096), (1, 16384), (8, 2048)])
    ext = [c for c in full if c.workload == "extend"]
    check("grid extend", len(ext) == 1 and ext[0].prefix_len == 4096 and ext[0].qo_len == 512 and
          ext[0].batch == 8 and ext[0].kv_len == 4608)
    check("grid fp8 + window", sum(c.kv_dtype == "fp8_e4m3" for c in full) == 1 and
          sum(c.window >= 0 for c in full) == 1)
    check("grid labels unique", len({c.label for c in full}) == len(full))
    quick = report.make_grid(quick=True)
    check("grid quick subset", 0 < len(quick) < len(full) and all(c.in_quick for c in quick))
    groups = report.group_by_data(full)
    check("groups pair page layouts", sum(len(g) == 2 for g in groups) == 14 and
          all(len({c.data_key for c in g}) == 1 for g in groups))
    check("seed depends on data only", decode[0].seed() == decode[1].seed() and
          decode[0].seed() != decode[2].seed())
    mods = [module_name(m) for m in report.needed_flashinfer_modules(full)]
    check("modules", mods[:3] == ["decode-bf16", "fa2-bf16", "fa3-bf16"] and
          "cascade" in mods and "fa3-fp8_e4m3" not in mods and "decode-bf16-swa" in mods, str(mods))
    check("modules of impl", modules_of_impl(ext[0], "flashinfer-fa3-ragged+merge") ==
          ["fa3-bf16", "cascade"] and modules_of_impl(decode[0], "torch-flex") == [])
    fp8 = [c for c in full if c.kv_dtype == "fp8_e4m3"][0]
    check("fp8 has no fa3", not any("fa3" in p for p in fp8.peers()))
    win = [c for c in full if c.window >= 0][0]
    check("window bytes", win.kv_bytes() == 64 * 4097 * 8 * 2 * 128 * 2)
    check("decode bytes", decode[0].kv_bytes() == 1024 * 8 * 2 * 128 * 2)
    pre = [c for c in full if c.workload == "prefill" and c.qo_len == 16384][0]
    check("prefill flops", pre.flops() == 4 * 32 * 128 * 16384 * 8192)
    check("extend flops", ext[0].flops() == 4 * 8 * 32 * 128 * 512 * (4096 + 256))

    # Speculative rows (issue 19): after the SPEC grid, which keeps its rows, keys and seeds;
    # then the shared-prefix rows (issue 16).
    spec = [c for c in full if c.workload in ("verify", "draft")]
    shared = [c for c in full if c.is_shared_prefix]
    check("spec rows after the grid, shared-prefix rows last",
          full[-len(shared):] == shared and full[-len(shared) - len(spec):-len(shared)] == spec
          and len(full) - len(spec) - len(shared) == 35)
    check("spec keys leave the grid's alone", all(len(c.data_key) == 8 for c in full
                                                  if c.workload not in ("verify", "draft")
                                                  and not c.is_shared_prefix))
    # Shared-prefix rows: per page size the cascade row and the same batch without groups, one
    # data group (same inputs); kvattn eager with groups, captured without; FlashInfer's
    # two-level cascade wrapper against kvattn's groups, its decode wrappers against the plain.
    check("shared rows", [c.label for c in shared] == [
        "decode b64 kv8448 shared8192 cascade-page1-shuffled",
        "decode b64 kv8448 shared8192 no-cascade-page1-shuffled",
        "decode b64 kv8448 shared8192 cascade-page16-shuffled",
        "decode b64 kv8448 shared8192 no-cascade-page16-shuffled"], str([c.label for c in shared]))
    check("shared rows one data group", len(report.group_by_data(shared)) == 1 and
          shared[0].seed() != decode[0].seed())
    check("shared rows: groups, graphs, peers",
          [c.declares_groups for c in shared] == [True, False, True, False] and
          [c.kvattn_graph for c in shared] == [False, True, False, True] and
          shared[0].peers() == ["flashinfer-cascade"] and
          shared[1].peers() == ["flashinfer-decode", "flashinfer-decode-tc"] and
          not runs_impl(shared[0], "torch-sdpa-flash") and
          modules_of_impl(shared[0], "flashinfer-cascade") == ["fa2-bf16", "cascade"])
    check("shared bytes: the prompt once",
          shared[0].kv_bytes() == (8192 + 64 * 256) * 8 * 2 * 128 * 2)
    check("shared rows regex", len(select_cases(parse_args(["--rows", "shared8192"]))) == 4 and
          len(select_cases(parse_args(["--rows", "shared", "--quick"]))) == 0)
    tiny_shared = [report.tiny_case(c) for c in shared]
    check("tiny shared rows", all(t.shared_prefix == 128 and t.kv_len == 132 and
                                  t.shared_prefix % t.page_size == 0 for t in tiny_shared))
    verify = [c for c in spec if c.is_verify]
    check("grid verify", [(c.batch, c.prefix_len, c.qo_len, c.kv_len) for c in verify] ==
          [(1, 4096, 8, 4104), (16, 4096, 8, 4104), (64, 4096, 8, 4104), (64, 1024, 16, 1040)])
    check("spec labels", [c.label for c in spec] == [
        "verify b1 prefix4096 tree8 page1-shuffled", "verify b16 prefix4096 tree8 page1-shuffled",
        "verify b64 prefix4096 tree8 page1-shuffled",
        "verify b64 prefix1024 tree16 page1-shuffled",
        "draft-multistep b16 prefix4096 topk4 steps3 page1-shuffled",
        "draft-extend b16 prefix4096 new4 page1-shuffled",
        "draft-extend b64 prefix4096 new4 page1-shuffled"], str([c.label for c in spec]))
    check("spec modules: fa3 last", [module_name(m) for m in report.needed_flashinfer_modules(
        spec)] == ["fa2-bf16", "quantization", "decode-bf16", "fa3-bf16"])
    check("quick: verify b1, b16", [c.label for c in quick if c.workload in ("verify", "draft")]
          == [c.label for c in verify[:2]])
    check("rows regex", len(select_cases(parse_args(["--rows", "verify"]))) == 4 and
          len(select_cases(parse_args(["--rows", "^draft"]))) == 3 and
          len(select_cases(parse_args(["--rows", "verify", "--quick"]))) == 2)
    ms = [c for c in spec if c.is_multistep][0]
    dx = [c for c in spec if c.is_draft_extend][0]
    check("spec kinds", ms.topk == 4 and ms.num_steps == 3 and ms.qo_len == 12 and
          ms.kv_len == 4108 and ms.tokens == 16 * 12 and dx.qo_len == 4 and dx.kv_len == 4100 and
          all(c.kvattn_graph for c in verify + [ms]) and not dx.kvattn_graph)
    check("spec peers", verify[0].peers() == ["flashinfer-fa2", "flashinfer-fa2-graph"] and
          dx.peers() == ["flashinfer-fa2", "flashinfer-fa3"] and
          ms.peers() == ["flashinfer-decode", "flashinfer-decode-tc"] and
          not runs_impl(verify[0], "torch-sdpa-flash") and runs_impl(verify[0], KVATTN) and
          runs_impl(ext[0], "torch-sdpa-cudnn"))
    check("spec modules", modules_of_impl(verify[0], "flashinfer-fa2-graph") ==
          ["fa2-bf16", "quantization"] and modules_of_impl(ms, "flashinfer-decode-tc") ==
          ["fa2-bf16"] and modules_of_impl(dx, "flashinfer-fa3") == ["fa3-bf16"] and
          "quantization" in mods, str(mods))
    per_token = 8 * 2 * 128 * 2
    check("verify bytes", verify[2].kv_bytes() == 64 * 4104 * per_token)
    check("multistep bytes", ms.kv_bytes() == 16 * (4100 + 4104 + 4108) * per_token)
    check("multistep flops", ms.flops() == 4 * 16 * 4 * 32 * 128 * (4097 + 4098 + 4099))
    check("verify flops", verify[3].flops() == 4 * 64 * 32 * 128 * 16 * (1024 + 8))
    samples = sample_queries(verify[1])
    check("samples verify", len(samples) == 24 and samples[8] == (8, 64, 4096) and
          samples[-1] == (15, 127, 4103), str(samples))
    samples = sample_queries(ms)
    check("samples multistep", len(samples) == 12 and samples[-1] == (15, 191, 4107) and
          samples[0] == (0, 0, 4096), str(samples))
    trees = tree_parents(7, 3, 16)
    check("tree parents", trees == tree_parents(7, 3, 16) and
          all(t[0] == -1 and all(0 <= t[i] < i for i in range(1, 16)) for t in trees) and
          trees != tree_parents(8, 3, 16))
    chain = [-1, 0, 0, 1]
    check("tree ancestors", tree_ancestors(chain, 3) == [0, 1, 3] and
          tree_ancestors(chain, 0) == [0] and tree_depths(chain) == [0, 1, 1, 2])
    small = report.Case("verify", 1, 4 + 4, qo_len=4, prefix_len=4)
    check("visible verify", visible_positions(small, 4 + 3, chain) == [0, 1, 2, 3, 4, 5, 7])
    small = report.Case("draft", 1, 3 + 6, qo_len=6, prefix_len=3, topk=2, num_steps=3)
    check("visible multistep", visible_positions(small, 3 + 2 * 2 + 1) == [0, 1, 2, 4, 6, 8])
    tiny = [report.tiny_case(c) for c in spec]
    check("tiny spec rows", len({c.label for c in tiny}) == len(spec) and
          all(t.qo_len == c.qo_len and t.topk == c.topk and t.kv_len == t.prefix_len + t.qo_len
              and t.prefix_len == c.prefix_len // 64 for t, c in zip(tiny, spec)))
    spec_row = report.make_row(verify[2], KVATTN, 100.0, {"read_gbps": 4000.0,
                                                          "gemm_bf16_tflops": 800.0})
    check("verify row rates", abs(spec_row["gbps"] - verify[2].kv_bytes() / 1e-4 / 1e9) < 1e-6
          and abs(spec_row["fraction"] - spec_row["tflops"] / 800.0) < 1e-12 and
          abs(spec_row["read_fraction"] - spec_row["gbps"] / 4000.0) < 1e-12)
    check("rows name their case", all(report.case_of_row(report.make_row(c, KVATTN, 1.0, {}))
                                      .label == c.label for c in full))

    check("sets: L2 rotation", choose_sets(4 * MIB, 60 * MIB, 100 * GIB, 12 * MIB) == 60 // 1 or
          choose_sets(4 * MIB, 60 * MIB, 100 * GIB, 12 * MIB) == MAX_SETS)
    check("sets: big inputs", choose_sets(17 * GIB, 60 * MIB, 100 * GIB, 40 * GIB) == 1)
    check("sets: memory cap", choose_sets(1 * MIB, 60 * MIB, 1 * GIB, 100 * MIB) == 5)
    check("calls: short", calls_per_replay(0.02, 4) == 52)  # 13 rounds of 4 >= 1 ms
    check("calls: long", calls_per_replay(5.0, 1) == 1)
    check("calls: cap", calls_per_replay(0.001, 32) == 256)
    check("reps", replay_count(0.02, 52, 0.25) == 200 and replay_count(5.0, 1, 0.25) == 50 and
          replay_count(100.0, 1, 0.25) == MIN_REPS)
    check("median", median([3, 1, 2]) == 2 and median([4, 1, 2, 3]) == 2.5)
    samples = sample_queries(decode[0])
    check("samples decode b1", samples == [(0, 0, 1023)], str(samples))
    samples = sample_queries(ext[0])
    check("samples extend", len(samples) == 6 and samples[-1] == (7, 7 * 512 + 511, 4607) and
          samples[0] == (0, 0, 4096), str(samples))
    check("short_error", short_error(ValueError("a\n  b")) == "ValueError: a b")

    # Writers, from made-up timings: one failed peer, one skipped row.
    rng = random.Random(5)
    ceilings = {"read_gbps": 4400.0, "copy_gbps": 4250.0, "gemm_bf16_tflops": 780.0}
    rows = []
    for case in full:
        base = rng.uniform(20, 5000)
        rows.append(report.make_row(case, KVATTN, base, ceilings, max_rel_err=3e-3,
                                    timing="graph", max_rel_diff_vs_flashinfer=2e-3))
        for peer in case.peers():
            if peer == "torch-flex" and case.is_decode and case.batch == 256:
                rows.append(report.make_row(case, peer, None, ceilings,
                                            error="skipped: budget"))
            else:
                rows.append(report.make_row(case, peer, base * rng.uniform(0.6, 2.0), ceilings,
                                            max_rel_err=4e-3, rel_diff_vs_kvattn=1e-3,
                                            timing="graph"))
    rows.append(report.make_row(full[0], "flashinfer-decode", None, ceilings,
                                max_rel_err=float("inf")))
    header = {"device": "NVIDIA H200 (fake)", "commit": "0" * 40, "dirty": False,
              "date": "2026-12-01", "ceilings": ceilings, "versions": {"torch": "2.11.0"},
              "run": {"budget_s": 480}}
    spec_keys = {"workload", "impl", "batch", "kv_len", "qo_len", "prefix_len", "page_size",
                 "head_dim", "q_heads", "kv_heads", "kv_dtype", "variant", "time_us", "gbps",
                 "tflops", "fraction", "max_rel_err"}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "peers-20261201.json")
        report.write_json(path, header, rows)
        loaded = json.load(open(path))
        check("json rows", len(loaded["rows"]) == len(rows))
        check("json spec keys", all(spec_keys <= set(r) for r in loaded["rows"]))
        check("json header", loaded["ceilings"]["read_gbps"] == 4400.0 and
              loaded["device"].startswith("NVIDIA"))
        k_row = loaded["rows"][0]
        check("json fraction decode", abs(k_row["fraction"] - k_row["gbps"] / 4400.0) < 1e-5)
        pre_row = [r for r in loaded["rows"] if r["workload"] == "prefill"][0]
        check("json tflops", pre_row["gbps"] is None and pre_row["tflops"] > 0)
        check("json inf is null", any(r["max_rel_err"] is None and r.get("note")
                                      for r in loaded["rows"]))
        table = report.markdown_table(header, rows)
        check("table has every row", all(c.label in table for c in full))
        check("table sections", "## decode" in table and "## prefill" in table and
              "## extend" in table and "## verify" in table and "## draft" in table and
              "slower than the best peer" in table)
        check("table failures listed", "skipped: budget" in table)
        line = [ln for ln in table.splitlines() if ln.startswith("| " + full[0].label)][0]
        check("table columns", line.count("|") ==
              table.splitlines()[[i for i, ln in enumerate(table.splitlines())
                                  if ln.startswith("| row")][0]].count("|"))
        png = os.path.join(tmp, "peers.png")
        why = report.write_plot(png, header, rows)
        if why and why.startswith("no matplotlib"):
            print(f"plot not checked: {why}")
        else:
            check("plot written", why is None and os.path.getsize(png) > 10000, str(why))
        # A partial run: only kvattn rows written so far must still give a table.
        partial = [r for r in rows if r["impl"] == KVATTN][:3]
        check("table partial", "—" in report.markdown_table(header, partial))
    with tempfile.TemporaryDirectory() as tmp:
        status = os.path.join(tmp, "status.jsonl")
        tracker = JitTracker(status, None)
        check("jit: no prebuild -> build in-process", tracker.wait(["fa2-bf16"], 0) is None)
        with open(status, "w") as f:
            f.write(json.dumps({"module": "fa2-bf16", "status": "done"}) + "\n")
            f.write(json.dumps({"module": "fa3-bf16", "status": "failed", "error": "nvcc"}) +
                    "\n")
        tracker.process = types.SimpleNamespace(poll=lambda: None)  # still running
        check("jit: done", tracker.wait(["fa2-bf16"], time.monotonic() + 5) is None)
        check("jit: failed", "failed: nvcc" in (tracker.wait(["fa3-bf16", "fa2-bf16"],
                                                             time.monotonic() + 5) or ""))
        check("jit: deadline", (tracker.wait(["cascade"], time.monotonic() - 1) or "")
              .startswith("skipped"))
        check("jit: summary", tracker.summary()["fa3-bf16"]["status"] == "failed")
        # The pass-B worker's view of the prebuild, through the file only.
        check("jit: worker sees running", PrebuildStatus(status).poll() is None)
        tracker.process = types.SimpleNamespace(poll=lambda: -9)  # killed without 'finished'
        tracker.mark_gone()
        tracker.mark_gone()  # once only
        check("jit: gone", PrebuildStatus(status).poll() == 0 and
              sum('"gone"' in line for line in open(status)) == 1)
        check("jit: worker builds in-process once gone",
              JitTracker(status, PrebuildStatus(status)).wait(["cascade"], time.monotonic() + 5)
              is None)
        # Worker events: partial last line ignored; settle picks up after the last reported item.
        events_path = os.path.join(tmp, "events.jsonl")
        items = [("r1", "a"), ("r1", "b"), ("r2", "a"), ("r2", "b")]
        with open(events_path, "w") as f:
            f.write(json.dumps({"event": "versions", "versions": {}}) + "\n")
            f.write(json.dumps({"event": "start", "label": "r1", "impl": "a"}) + "\n")
            f.write(json.dumps({"event": "row", "label": "r1", "impl": "a",
                                "row": {"impl": "a"}}) + "\n")
            f.write(json.dumps({"event": "start", "label": "r1", "impl": "b"}) + "\n")
            f.write('{"event": "row", "lab')  # the worker died mid-write
        events = read_events(events_path)
        check("events: partial line", len(events) == 4)
        rows, died, rest, _ = settle_worker_events(items, events)
        check("settle: died in r1/b", set(rows) == {("r1", "a")} and died == ("r1", "b") and
              rest == [("r2", "a"), ("r2", "b")], f"{rows} {died} {rest}")
        lost = events[:3] + [{"event": "start", "label": "r1", "impl": "b"},
                             {"event": "row", "label": "r1", "impl": "b", "row": {}},
                             {"event": "note", "text": "n"}]
        rows, died, rest, notes = settle_worker_events(items, lost)
        check("settle: lost context", died is None and len(rows) == 2 and
              rest == [("r2", "a"), ("r2", "b")] and notes == ["n"])
        rows, died, rest, _ = settle_worker_events(items, [])
        check("settle: nothing", not rows and died is None and rest == items)
    check("describe_rc", describe_rc(-6) == "signal 6 (SIGABRT)" and
          describe_rc(3) == "exit code 3")
    check("test hook", parse_test_hook("abort:flashinfer-decode:b64 kv4096") ==
          ("abort", "flashinfer-decode", "b64 kv4096") and parse_test_hook("") is None)
    try:
        parse_test_hook("boom:x")
        check("test hook rejects", False)
    except ValueError:
        check("test hook rejects", True)
    check("sticky errors", bool(STICKY_CUDA_ERROR.search(
        "RuntimeError: CUDA error: an illegal memory access was encountered")) and
        not STICKY_CUDA_ERROR.search("CUDA out of memory"))
    check("speed ratio", report.speed_ratio(100.0, 150.0) == 1.5 and
          report.speed_ratio(None, 1.0) is None)
    # The clock sampler: a no-op without NVML; with a fake NVML, the summary of its samples.
    idle = GpuSampler()
    idle.start()
    check("sampler without nvml", idle.stop() == {})

    class FakeNvml:
        NVML_CLOCK_SM = 1
        def __init__(self):
            self.reads = [(1980, 600_000, 0), (1755, 700_000, 0x4), (1980, 650_000, 0x20)]
        def nvmlDeviceGetClockInfo(self, handle, kind):
            return self.reads[0][0]
        def nvmlDeviceGetPowerUsage(self, handle):
            return self.reads[0][1]
        def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
            value = self.reads[0][2]
            self.reads.append(self.reads.pop(0))
            return value

    fake = GpuSampler(nvml=FakeNvml(), handle=0)
    fake.samples = [fake._read() for _ in range(3)]
    got = fake.summary()
    check("sampler summary", got.get("sm_clock_mhz") == 1905.0 and got.get("power_w") == 650.0 and
          got.get("power_capped") == round(1 / 3, 3) and got.get("slowdown") == round(1 / 3, 3)
          and got.get("clock_samples") == 3, str(got))
    live = GpuSampler(period_s=0.001, nvml=FakeNvml(), handle=0)
    live.start()
    time.sleep(0.02)
    check("sampler thread", live.stop().get("clock_samples", 0) >= 1)
    print(f"self-test: {len(passed)} passed, {len(failed)} failed")
    return 1 if failed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.self_test:
        return self_test()
    if args.jit_prebuild:
        return jit_prebuild_main(args)
    if args.fi_worker:
        return fi_worker_main(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
