"""One library for every CPU kernel (kernels/cpu_build.load_part), and its first build shown as a load stage."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from specchat.engine import loading
from specchat.kernels import cpu_attention, cpu_block, cpu_build, cpu_gemv, cpu_gemv_i8, cpu_ops

pytestmark = pytest.mark.skipif(not cpu_block.available(), reason="the CPU kernels do not build here")


def test_every_kernel_module_uses_the_one_library():
    """Five builds were two copies of the attention's source (~18 s each to compile)."""
    lib = cpu_block._library()
    assert cpu_ops._library() is lib
    assert cpu_gemv._library() is lib
    assert cpu_attention._library() is lib
    if cpu_gemv_i8.available():
        assert cpu_gemv_i8._library() is lib
    assert cpu_build.library_path("cpu_block", cpu_block._sources(), cpu_ops.CFLAGS).exists()  # what built() reads


def test_the_cache_key_follows_the_c_files_text(tmp_path, monkeypatch):
    """A library is keyed by the text of its C files (kernels/csrc/, read by c_source): a copy of them keys the same
    library, an edit of one (a blank line) a new one."""

    def key() -> Path:
        return cpu_build.library_path("cpu_ops", cpu_build.c_source("cpu_ops.h", "cpu_ops.c"), cpu_ops.CFLAGS)

    before = key()
    assert before == cpu_build.library_path("cpu_ops", cpu_ops.C_SOURCE, cpu_ops.CFLAGS)
    monkeypatch.setattr(cpu_build, "CSRC", shutil.copytree(cpu_build.CSRC, tmp_path / "csrc"))
    assert key() == before
    header = tmp_path / "csrc" / "cpu_ops.h"
    header.write_text(header.read_text() + "\n")
    assert key() != before


def test_every_c_file_is_in_the_library():
    """Each file of kernels/csrc/ is built: the one library's units hold its text."""
    units = "".join(cpu_block._sources())
    files = sorted(cpu_build.CSRC.iterdir())
    assert files and all(f.read_text() in units for f in files)


def test_other_flags_build_their_own_library():
    assert cpu_block.combined(("-O2",)) is None


def test_a_first_build_is_a_load_stage(monkeypatch):
    """The stage while the compiler runs, heard every beat (a log's "still running" line), then its end."""
    calls, built = [], []
    monkeypatch.setattr(cpu_block, "built", lambda: bool(built))
    monkeypatch.setattr(cpu_block, "available", lambda: time.sleep(0.2) or built.append(1) or True)
    loading.build_cpu_kernels(lambda what, done, total: calls.append((what, done, total)), beat_s=0.05)
    assert built == [1]
    assert calls[-1] == (loading.KERNEL_STAGE, 1, 1)
    assert len(calls) >= 3 and set(calls[:-1]) == {(loading.KERNEL_STAGE, 0, 0)}
    calls.clear()
    loading.build_cpu_kernels(lambda *a: calls.append(a))  # built: nothing to show
    assert calls == [] and built == [1]


def test_the_first_build_runs_while_the_model_downloads(monkeypatch):
    """load_parts starts the kernels' build before fetching the model, so the compiler and the download overlap; a
    model that cannot be fetched fails at once, not after the build."""
    from specchat.config import EngineConfig
    from specchat.errors import OfflineError

    compiling, release = threading.Event(), threading.Event()
    monkeypatch.setattr(cpu_block, "built", lambda: False)  # as on a fresh machine
    monkeypatch.setattr(cpu_block, "available", lambda: compiling.set() or release.wait(10) or True)
    seen = []

    def fetch(spec, progress=None):
        seen.append(compiling.wait(5))  # the build has started before the download ends
        raise OfflineError("no network")

    monkeypatch.setattr(loading, "fetch", fetch)
    start = time.perf_counter()
    try:
        with pytest.raises(OfflineError):
            loading.load_parts(EngineConfig(device="cpu"), progress=lambda *a: None)
        assert seen == [True] and time.perf_counter() - start < 5  # not held up by the build
    finally:
        release.set()
    calls = []
    started = loading.start_cpu_kernels(lambda *a: None)
    loading.build_cpu_kernels(lambda *a: calls.append(a), beat_s=0.05, started=started)
    assert started.is_set() and calls[-1] == (loading.KERNEL_STAGE, 1, 1)


def test_a_kernel_folder_that_cannot_be_written_loads_the_build_with_a_note(tmp_path, monkeypatch, caplog):
    """A read-only $SPECCHAT_HOME had every start build the kernels, fail to save them and run the torch path."""
    import logging

    (tmp_path / "kernels").write_text("a file where the folder should be")
    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path))
    source = "int specchat_answer(void) { return 42; }"
    with caplog.at_level(logging.WARNING):
        lib = cpu_build.load("unwritable_home_test", source, ("-O1", "-shared", "-fPIC"))
    assert lib is not None and lib.specchat_answer() == 42
    [note] = [r.getMessage() for r in caplog.records]
    assert note.startswith("specchat: note: cannot save ") and "loading without it" in note
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels"]


@pytest.mark.parametrize(
    ("compiler", "why"),
    [("no-such-cc", "no C compiler 'no-such-cc' on PATH; install gcc or clang"), ("false", "the compiler failed")],
)
def test_kernels_that_cannot_be_built_are_told_once(tmp_path, monkeypatch, caplog, compiler, why):
    """Without a compiler the default model decoded 60 tok/s on the torch path (~360 on the kernels) and nothing
    said why."""
    import logging

    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path))
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setattr(cpu_build, "_noted", False)
    with caplog.at_level(logging.WARNING):
        for name in (f"{compiler}_a", f"{compiler}_b"):  # two libraries, one note (`load` keeps each answer)
            assert cpu_build.load(name, "int specchat_answer(void) { return 42; }", ("-O1", "-shared", "-fPIC")) is None
    [note] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert note.startswith("specchat: note: no CPU kernels (" + why)
    assert note.endswith("decoding runs on the slower torch path")


def test_a_platform_without_the_kernels_is_told_once_and_turning_them_off_is_not(monkeypatch, caplog):
    import logging

    monkeypatch.setattr(cpu_build, "_noted", False)
    monkeypatch.setenv("SPECCHAT_CPU_KERNELS", "0")
    source = "int specchat_answer(void) { return 42; }"
    with caplog.at_level(logging.WARNING):
        assert cpu_build.load("turned_off", source, ("-O1",)) is None
        assert not caplog.records
        monkeypatch.delenv("SPECCHAT_CPU_KERNELS")
        monkeypatch.setattr(cpu_build.sys, "platform", "darwin")
        assert cpu_build.load("on_macos_a", source, ("-O1",)) is None
        assert cpu_build.load("on_macos_b", source, ("-O1",)) is None
    [note] = [r.getMessage() for r in caplog.records]
    assert (
        note
        == "specchat: note: no CPU kernels (they are built on Linux only, not darwin); decoding runs on the slower torch path"
    )


def test_kernels_turned_off_build_nothing(monkeypatch):
    monkeypatch.setenv("SPECCHAT_CPU_KERNELS", "0")
    assert not cpu_build.enabled()
    calls, built = [], []
    monkeypatch.setattr(cpu_block, "built", lambda: False)  # as on a fresh machine
    monkeypatch.setattr(cpu_block, "available", lambda: built.append(1) or True)
    loading.build_cpu_kernels(lambda *a: calls.append(a))
    assert calls == [] and built == []


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(cpu_build.torch_openmp() is None, reason="torch bundles no OpenMP runtime here")
def test_release_ends_the_calling_threads_openmp_workers():
    """A thread that ran a parallel region keeps its OpenMP workers (libgomp's pool for it) until it exits; release
    ends them now. (Left behind by the loading thread, they made the engine thread's barriers sleep.)"""
    seen = {}

    def work() -> None:
        x = torch.ones(1 << 22)
        (x * 2).sum()  # a parallel region opened by this thread: its pool gets worker threads
        seen["busy"] = thread_count()
        seen["released"] = cpu_build.release_openmp_threads()
        deadline = time.monotonic() + 5
        while thread_count() >= seen["busy"] and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["after"] = thread_count()

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(threads)
    assert seen["released"] and seen["after"] < seen["busy"]


def test_free_heap_pages_go_back_to_the_system():
    """release_free_memory trims glibc's heap: the freed pages of a large buffer made of many small allocations
    (which glibc keeps in its heap, not in a mapping of their own) leave the process's resident set."""
    import platform
    import sys

    from specchat.kernels import cpu_build

    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")

    def resident_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    import ctypes

    malloc, free = ctypes.CDLL(None).malloc, ctypes.CDLL(None).free
    malloc.restype, malloc.argtypes, free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    blocks = [malloc(64 << 10) for _ in range(2048)]  # 128 MB in 64 KB pieces: heap memory, under mmap's threshold
    for b in blocks:
        ctypes.memset(b, 1, 64 << 10)
    held = resident_mb()
    for b in blocks:
        free(b)
    assert cpu_build.release_free_memory()
    assert resident_mb() < held - 64


def test_page_out_releases_a_mapped_files_pages_and_keeps_its_values(tmp_path):
    """page_out on a tensor mapped from a file (as the CPU weight blocks are, from their cached safetensors): its
    pages leave the resident set, and reading it again reads the same values from the file."""
    import sys

    import numpy as np

    from specchat.kernels import cpu_build

    if sys.platform != "linux":
        pytest.skip("madvise(MADV_PAGEOUT) is Linux's")
    path = tmp_path / "blocks.bin"
    values = np.arange(16 << 20, dtype=np.int32)  # 64 MB
    values.tofile(path)
    mapped = torch.from_numpy(np.memmap(path, dtype=np.int32, mode="c"))  # private, as safetensors maps

    def resident_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    assert int(mapped.sum()) == int(values.sum())  # every page read in
    held = resident_mb()
    if cpu_build.page_out([mapped]) == 0:
        pytest.skip("no MADV_PAGEOUT on this kernel")
    assert resident_mb() < held - 32
    assert torch.equal(mapped, torch.from_numpy(values))


def test_a_library_of_two_units_links_them(tmp_path, monkeypatch):
    """The kernels' library compiles as two translation units side by side (cpu_block._sources): a hidden function
    of one is called from the other, and only the exported one is a symbol of the library."""
    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path))
    units = (
        '__attribute__((visibility("hidden"))) int specchat_half(int x);\nint specchat_answer(void) { return specchat_half(84); }',
        '__attribute__((visibility("hidden"))) int specchat_half(int x) { return x / 2; }',
    )
    lib = cpu_build.load("two_units_test", units, ("-O1", "-shared", "-fPIC"))
    assert lib is not None and lib.specchat_answer() == 42
    assert not hasattr(lib, "specchat_half")
    assert cpu_build.library_path("two_units_test", units, ("-O1", "-shared", "-fPIC")).exists()


def test_a_unit_that_fails_is_told_by_its_first_error_line(tmp_path, monkeypatch, caplog):
    import logging

    monkeypatch.setenv("SPECCHAT_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_build, "_noted", False)
    units = ("int specchat_answer(void) { return 42; }", "int specchat_broken(void) { return }")
    with caplog.at_level(logging.WARNING):
        assert cpu_build.load("broken_unit_test", units, ("-O1", "-shared", "-fPIC")) is None
    [note] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert note.startswith("specchat: note: no CPU kernels (the compiler failed: ") and "1.c" in note
    assert not list((tmp_path / "kernels").glob("broken_unit_test*"))
