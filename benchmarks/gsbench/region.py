"""The counted region of the cost gate: a tiny C library compiled at run time,
the valgrind command line that counts only inside it, and the reader of
callgrind's output files.

NOTE [ The counted region ]
callgrind runs the whole process but counts nothing (``--collect-atstart=no``)
until a function named :data:`REGION` is entered, and stops when it returns
(``--toggle-collect=graphscale_cost_region``); as it returns, callgrind writes
what it counted to a file of its own (``--dump-after``: ``<out>.1``,
``<out>.2``, ...), so one process measures every backward of every case, one
file each.  That function lives in a C library compiled here with the system
C compiler (into a cache directory, keyed by a hash of the source) and loaded
by ctypes: ``graphscale_cost_region(callback)`` calls the Python callback (one
backward), so exactly what the callback runs is counted.

It is not called from Python directly: ctypes enters C through libffi's
``ffi_call_unix64``, which moves the stack pointer in a way that callgrind's
call tracking does not follow (a function entered straight from it is never
seen entered, and nothing was counted: valgrind 3.19).  ctypes calls
``graphscale_cost_enter``, which makes an ordinary C call into
``graphscale_cost_region``.  The callback's way back into Python (a libffi
closure) is inside the region, the same in every arm, and cancels in the
difference the gate reads.

Where valgrind's header is installed, the library also turns callgrind's
instrumentation on (``CALLGRIND_START_INSTRUMENTATION``) once the process is
set up, and valgrind starts with it off (``--instr-atstart=no``): importing
torch and DeepSpeed and building the engines then runs several times faster
(about a minute less per run here).  What the regions count is the same
either way.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

REGION = "graphscale_cost_region"  # callgrind counts inside it (--toggle-collect), a file per call (--dump-after)
CACHE_ENV = "GSBENCH_CACHE"

SOURCE = r"""
/* benchmarks/gsbench/region.py: NOTE [ The counted region ]. */
#if defined(__has_include)
#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#define GRAPHSCALE_COST_CAN_INSTRUMENT 1
#endif
#endif
typedef int (*graphscale_cost_callback)(void);
static volatile int graphscale_cost_sink;

__attribute__((noinline)) int graphscale_cost_region(graphscale_cost_callback callback) {
    int result = callback();
    graphscale_cost_sink = result;
    return result;
}

/* ctypes' entry: an ordinary C call into the function callgrind watches. */
__attribute__((noinline)) int graphscale_cost_enter(graphscale_cost_callback callback) {
    int result = graphscale_cost_region(callback);
    graphscale_cost_sink = result;
    return result;
}

/* Instrumentation on from here (valgrind --instr-atstart=no until then: the
   imports and the engines' set-up run several times faster); 0 where
   valgrind's header was not found and the whole run is instrumented. */
int graphscale_cost_can_instrument(void) {
#ifdef GRAPHSCALE_COST_CAN_INSTRUMENT
    return 1;
#else
    return 0;
#endif
}

void graphscale_cost_instrument(void) {
#ifdef GRAPHSCALE_COST_CAN_INSTRUMENT
    CALLGRIND_START_INSTRUMENTATION;
#endif
}
"""
CFLAGS = ("-O0", "-fno-optimize-sibling-calls", "-fno-inline", "-shared", "-fPIC")
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int)


def cache_dir() -> Path:
    """``$GSBENCH_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/graphscale-bench``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "graphscale-bench"


def compiler() -> str | None:
    """The system C compiler ($CC, cc, gcc or clang), or None."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def build() -> Path:
    """The region's library, compiled once per source and flags into :func:`cache_dir`."""
    key = hashlib.sha256((SOURCE + repr(CFLAGS)).encode()).hexdigest()[:16]
    lib = cache_dir() / f"cost_region-{key}.so"
    if lib.exists():
        return lib
    cc = compiler()
    if cc is None:
        raise RuntimeError("benchmarks/cost.py: no C compiler (cc, gcc or clang) to build the counted region")
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        src, out = Path(tmp) / "cost_region.c", Path(tmp) / lib.name
        src.write_text(SOURCE)
        run = subprocess.run([cc, *CFLAGS, "-o", str(out), str(src)], capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"benchmarks/cost.py: {cc} could not build the counted region:\n{run.stderr}")
        os.replace(out, lib)  # atomic: a concurrent build finds a whole file or none
    return lib


class Region:
    """The loaded library: ``region(fn)`` runs ``fn()`` inside the counted
    region (under callgrind, one output file per call).  Outside valgrind it
    is a plain call that counts nothing."""

    def __init__(self) -> None:
        self._lib = ctypes.CDLL(str(build()))
        self._lib.graphscale_cost_enter.argtypes = [_CALLBACK]
        self._lib.graphscale_cost_enter.restype = ctypes.c_int
        self._lib.graphscale_cost_instrument.restype = None
        self.can_instrument = bool(self._lib.graphscale_cost_can_instrument())

    def region(self, fn: Callable[[], None]) -> None:
        failed: list[BaseException] = []

        def body() -> int:
            try:
                fn()
            except BaseException as exc:  # carried out of C and raised below, never lost in ctypes
                failed.append(exc)
                return 1
            return 0

        callback = _CALLBACK(body)  # held until the call returns
        self._lib.graphscale_cost_enter(callback)
        if failed:
            raise failed[0]

    def instrument(self) -> None:
        """Instrumentation on, once, before the first region (a no-op outside
        valgrind, and where :attr:`can_instrument` is False)."""
        self._lib.graphscale_cost_instrument()


# ----------------------------------------------------------------------------- valgrind
def valgrind() -> str | None:
    return shutil.which("valgrind")


def valgrind_version() -> str:
    exe = valgrind()
    if exe is None:
        return "absent"
    return subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()


def callgrind_command(out_file: Path, instrument_late: bool, cache_sim: bool = False) -> list[str]:
    """valgrind's command line (the program's follows): count only inside
    :data:`REGION`, a file per call (NOTE [ The counted region ]);
    ``instrument_late``: no instrumentation until the program turns it on
    (:meth:`Region.instrument`); ``cache_sim``: callgrind's cache simulation
    too (its misses per level beside the instructions: :func:`read_events`)."""
    exe = valgrind()
    if exe is None:
        raise RuntimeError("benchmarks/cost.py: valgrind is not installed (apt-get install valgrind)")
    return [exe, "--tool=callgrind", "--collect-atstart=no", f"--toggle-collect={REGION}",
            f"--dump-after={REGION}", "--dump-line=no", *(["--instr-atstart=no"] if instrument_late else []),
            *(["--cache-sim=yes"] if cache_sim else []), f"--callgrind-out-file={out_file}"]


_TOTAL = re.compile(r"^(?:summary|totals):\s*(\d+)", re.M)
_PART = re.compile(r"^part:\s*(\d+)", re.M)


def read_total(path: Path) -> int:
    """The instructions (Ir) one callgrind output file counted: its
    ``summary:`` line (``totals:`` where a file has no summary)."""
    text = path.read_text()
    found = _TOTAL.search(text)
    if found is None:
        raise ValueError(f"{path}: not a callgrind output file (no summary: or totals: line)")
    return int(found.group(1))


_EVENTS = re.compile(r"^events:\s*(.+)$", re.M)
_SUMMARY = re.compile(r"^(?:summary|totals):\s*([\d ]+)$", re.M)


def read_events(path: Path) -> dict[str, int]:
    """Every event one callgrind output file counted, by name (Ir; with the
    cache simulation also I1mr, D1mr, D1mw, ILmr, DLmr, DLmw, Dr, Dw)."""
    text = path.read_text()
    names, totals = _EVENTS.search(text), _SUMMARY.search(text)
    if names is None or totals is None:
        raise ValueError(f"{path}: not a callgrind output file (no events: or summary: line)")
    values = [int(v) for v in totals.group(1).split()]
    return dict(zip(names.group(1).split(), values + [0] * (len(names.group(1).split()) - len(values))))


def read_parts(out_file: Path) -> list[int]:
    """The instructions of every part callgrind dumped for ``out_file``
    (``<out>.1``, ``<out>.2``, ... in order: one per region; the file without
    a number, written at the program's end, counted outside every region and
    is left out)."""
    return [read_total(path) for path in part_files(out_file)]


def part_files(out_file: Path) -> list[Path]:
    """The files callgrind dumped for ``out_file``, one per region, in order."""
    found = [(int(p.name[len(out_file.name) + 1:]), p) for p in out_file.parent.glob(out_file.name + ".*")
             if p.name[len(out_file.name) + 1:].isdigit()]
    return [p for _, p in sorted(found)]


def counted_parts(out_file: Path, regions: int, prog: str) -> list[int]:
    """:func:`read_parts`, checked: one count per counted region the program
    says it ran (``regions``), else a RuntimeError naming ``prog``."""
    parts = read_parts(out_file)
    if len(parts) != regions:
        raise RuntimeError(f"{prog}: callgrind wrote {len(parts)} counts for {regions} "
                           f"counted backwards (was {REGION} renamed or inlined?)")
    return parts
