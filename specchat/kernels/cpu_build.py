"""Compile-once C kernels for the CPU: a C source built by the system compiler, cached, and loaded through ctypes.

Shared by kernels/cpu_gemv.py (block-quantized linears) and kernels/cpu_ops.py (norms, RoPE, SiLU, paged
attention), whose C lies in kernels/csrc/ (`c_source`). A library is built the first time it is needed with `cc`
(or $CC) into $SPECCHAT_HOME/kernels/, keyed by its source text, flags, OpenMP runtime and torch version, then
loaded from there. Where that fails (no compiler, not Linux, or SPECCHAT_CPU_KERNELS=0), `load` returns None and
callers keep their plain torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from contextlib import suppress
from functools import cache
from pathlib import Path

import torch

from specchat.errors import note_not_saved

log = logging.getLogger(__name__)

# Module attributes where the engine keeps these kernels' bindings of a module's tensors (ctypes views:
# engine/cpu_weights.py's BlockLinear "_bound" and Int8BlockLinear "_bound_i8", engine/cpu_fusion.py's CpuBlock
# "_block_weights"). Each is rebuilt at first use where absent, so a copy of a module leaves them out (quant.gptq):
# ctypes objects holding pointers cannot be copied.
KERNEL_CACHES = ("_bound", "_bound_i8", "_block_weights")


def kernel_dir() -> Path:
    """$SPECCHAT_HOME/kernels (the same home as registry.py's; kernels/ imports nothing else of specchat)."""
    root = os.environ.get("SPECCHAT_HOME")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "specchat") / "kernels"


def torch_openmp() -> Path | None:
    """The OpenMP runtime bundled with torch, so the kernels' threads are torch's threads (one pool, not two)."""
    lib = Path(torch.__file__).parent / "lib"
    found = sorted(lib.glob("libgomp*.so*"))
    return found[0] if found else None


OMP_PAUSE_SOFT = 1  # omp_pause_resource_t (OpenMP 5.0)


def release_openmp_threads() -> bool:
    """End the calling thread's OpenMP worker threads (libgomp keeps a pool per thread that opened a parallel
    region); True where there was a runtime to ask. Call it on a thread that hands the kernels to another one.

    libgomp's threads wait for the next region by spinning, but only while the threads of every pool together
    fit the CPUs. A second pool, left by the thread that loaded the model and ran its warm-up before the engine's
    own thread took over, makes them more than the CPUs: every barrier of every step then sleeps and wakes through
    a futex. On 2 cores a decode step in the engine's thread ran at 0.25x the same step run by the loading thread
    (65 against 260 tok/s; the ThreadGovernor, seeing the threads wait, dropped to one thread: 146); see
    docs/benchmarks.md, thirty-seventh session."""
    pause = _openmp_pause()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0


def release_free_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim); True where there was one to ask.

    Call it after large buffers were freed: the first load of a GGUF dequantizes every tensor (and drops the
    linears' float32 copies again, engine/cpu_weights.release_unread_weights), and glibc keeps what was freed inside
    its heap. After the default model's first load the process held 1,099 MB, 773 MB after the trim (a later
    load, from the converted files, 546 MB either way)."""
    trim = _malloc_trim()
    return trim is not None and trim(0) == 1


MADV_PAGEOUT = 21  # linux/mman.h (Linux 5.4+): reclaim these pages now; never loses data


def page_out(tensors: Iterable[torch.Tensor]) -> int:
    """Ask the kernel to reclaim the whole pages of these CPU tensors, which nothing is about to read; returns the
    bytes asked for (0 where madvise or MADV_PAGEOUT is missing). Pages mapped from a file (the CPU weight blocks
    read from their cached safetensors) leave the resident set and are read from the file again at their next
    access; anonymous ones go to swap, where there is one, else stay. The values never change."""
    advise = _madvise()
    if advise is None:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for t in tensors:
        start = -(-t.data_ptr() // page) * page  # whole pages inside the tensor only
        end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
        if end > start and advise(start, end - start, MADV_PAGEOUT) == 0:
            total += end - start
    return total


@cache
def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        advise = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return None
    advise.argtypes, advise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return advise


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


@cache
def _openmp_pause() -> Callable[[int], int] | None:
    """omp_pause_resource_all of the runtime torch and the kernels share, or None where there is none."""
    runtime = torch_openmp()
    if runtime is None:
        return None
    try:
        pause = ctypes.CDLL(str(runtime)).omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause


Sources = str | tuple[str, ...]  # one C source, or the translation units of one library
BUILD_TIMEOUT_S = 120  # per compiler command
CSRC = Path(__file__).with_name("csrc")  # the kernels' C files (package data: pyproject.toml)


def c_source(*names: str) -> str:
    """The text of these files of kernels/csrc/, one after the other: a translation unit as `load` builds and keys
    it (by this text, so an edit to any of the files is a new build). Each module names the files it builds on
    before its own."""
    return "".join((CSRC / name).read_text(encoding="utf-8") for name in names)


def _run_all(commands: list[list[str]]) -> None:
    """Run the compiler commands side by side; CalledProcessError (with its stderr) for the first that failed."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for cmd in commands]
    try:
        results = [proc.communicate(timeout=BUILD_TIMEOUT_S) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for cmd, proc, (out, err) in zip(commands, procs, results, strict=True):
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd, out, err)


def compile_library(sources: Sources, cflags: list[str], target: Path, openmp: Path | None) -> ctypes.CDLL:
    """Build `sources` into the shared library `target` (atomically: a concurrent process sees the old file or the
    whole new one) and load it. Several translation units compile side by side, then link. Where `target` cannot be
    written (a read-only $SPECCHAT_HOME, a full disk) the build is loaded from where it was made, with a note: the
    kernels run, only the next start builds them again."""
    cc = os.environ.get("CC", "cc")
    units = (sources,) if isinstance(sources, str) else sources
    with tempfile.TemporaryDirectory() as tmp:
        srcs = [Path(tmp) / f"{target.stem}.{i}.c" for i in range(len(units))]
        for src, text in zip(srcs, units, strict=True):
            src.write_text(text)
        out = Path(tmp) / target.name
        flags = ["-fopenmp", *cflags] if openmp is not None else list(cflags)
        link = [str(openmp), f"-Wl,-rpath,{openmp.parent}"] if openmp is not None else []
        if len(srcs) == 1:
            _run_all([[cc, *flags, str(srcs[0]), "-o", str(out), *link]])
        else:
            objs = [src.with_suffix(".o") for src in srcs]
            _run_all([[cc, *flags, "-c", str(src), "-o", str(obj)] for src, obj in zip(srcs, objs, strict=True)])
            _run_all([[cc, *flags, *map(str, objs), "-o", str(out), *link]])
        partial = target.with_name(f".{target.name}.{os.getpid()}.part")  # beside target: the rename is atomic
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(out, partial)
            os.replace(partial, target)
        except OSError as exc:
            note_not_saved(log, target, exc)
            with suppress(OSError):
                partial.unlink(missing_ok=True)
            return ctypes.CDLL(str(out))  # loaded before the folder goes: the mapping outlives the file
    return ctypes.CDLL(str(target))


def enabled() -> bool:
    """Whether C kernels may be built and loaded here (Linux, and not turned off by SPECCHAT_CPU_KERNELS=0)."""
    return sys.platform == "linux" and os.environ.get("SPECCHAT_CPU_KERNELS", "1") != "0"


def library_path(name: str, source: Sources, cflags: tuple[str, ...]) -> Path:
    """Where the build of `source` with these flags is cached (keyed by them, the OpenMP runtime and torch)."""
    key = hashlib.sha1(f"{source}{list(cflags)}{torch_openmp()}{torch.__version__}".encode()).hexdigest()[:12]
    return kernel_dir() / f"{name}-{key}.so"


@cache
def load(name: str, source: Sources, cflags: tuple[str, ...]) -> ctypes.CDLL | None:
    """The library `name` built from `source` (on first use, then cached on disk), or None where it cannot be."""
    if not enabled():
        if sys.platform != "linux":  # (SPECCHAT_CPU_KERNELS=0 is the user's own choice: nothing to tell)
            _note_torch_path(f"they are built on Linux only, not {sys.platform}")
        return None
    target = library_path(name, source, cflags)
    try:
        if target.exists():
            return ctypes.CDLL(str(target))
        return compile_library(source, list(cflags), target, torch_openmp())
    except (OSError, subprocess.SubprocessError) as exc:
        log.info("specchat: CPU kernels %s unavailable (%s); using the torch path", name, exc)
        _note_torch_path(_why_not_built(exc))
        return None


_noted = False  # whether this process told the user its kernels are not there


def _why_not_built(exc: Exception) -> str:
    if isinstance(exc, FileNotFoundError):
        return f"no C compiler {os.environ.get('CC', 'cc')!r} on PATH; install gcc or clang, or name one in $CC"
    if isinstance(exc, subprocess.CalledProcessError):
        lines = (exc.stderr or b"").decode(errors="replace").strip().splitlines()
        return f"the compiler failed: {lines[0] if lines else exc}"
    return str(exc)


def _note_torch_path(why: str) -> None:
    """Once a process: no C kernels, so decoding runs on the torch path (on the 2-core Xeon the default model decodes
    60 tok/s there against ~360 on the kernels): a user without a compiler, or on macOS, should know why."""
    global _noted
    if not _noted:
        _noted = True
        log.warning("specchat: note: no CPU kernels (%s); decoding runs on the slower torch path", why)


def load_part(name: str, source: str, cflags: tuple[str, ...]) -> ctypes.CDLL | None:
    """A kernel module's library: the one library kernels/cpu_block.py builds from every module's source, where
    it builds with these flags (it holds every function of `source`, compiled alike), else `name` built from
    `source` alone. One build where there were five: the attention's source alone took ~18 s to compile and was
    compiled twice, so a first run on a fresh 2-core Xeon waited ~40 s for its kernels, now ~20."""
    from specchat.kernels import cpu_block  # (imports every kernel module, so not at the top)

    lib = cpu_block.combined(tuple(cflags))
    return lib if lib is not None else load(name, source, tuple(cflags))
