"""Kernels in C++, built on first use with the system's C++ compiler.

``adam_average.h`` holds Keras' Adam update with the step's averages
folded in (one pass over each tensor); ``jax_kernels.cc`` serves it to
JAX's compiled CPU step as an XLA FFI target (``_jax_cpu``), and
``tf_kernels.cc`` to TensorFlow's CPU graph as a custom op (``_tf_cpu``).
Each is compiled, as ``torch.utils.cpp_extension.load`` compiles an
extension, against the framework's own headers, into a temporary file
renamed into a cache keyed by the sources, the framework's version, the
compiler and the CPU (no partial file is ever loaded; processes building
at once each rename a whole one). Where a kernel cannot be built, the
framework's own step runs, and ``status()`` says why.

Environment:

- ``KERAS_EMA_OPT_CPU_KERNELS=0``: do not build or use the kernels.
- ``KERAS_EMA_OPT_CACHE``: where built kernels are kept (by default
  ``$XDG_CACHE_HOME/keras_ema_opt`` or ``~/.cache/keras_ema_opt``).
- ``CXX``: the C++ compiler (by default ``c++``, ``g++`` or ``clang++``;
  a launcher may lead it: ``ccache g++``).
"""

import hashlib
import logging
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import time

HERE = pathlib.Path(__file__).parent
MAX_AVERAGES = 2  # adam_average.h's kMaxAverages
RULE_SCALARS = 6  # adam_average.h's kRuleScalars: alpha, c1, c2, eps, wd, lr
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp-simd",
         "-fno-math-errno", "-ffp-contract=off", "-march=native", "-w")

_log = logging.getLogger("keras_ema_opt")


class Kernel:
    """A kernel loaded once per process by ``load()``; an exception it
    raises is the reason it does not serve."""

    def __init__(self, what, load):
        self._what, self._load = what, load
        self._lock = threading.Lock()
        self.ready, self.reason = None, "not built yet"

    def status(self):
        """``(ready, reason)``: whether the kernel serves this process,
        and why not where it does not."""
        return self.serves(), self.reason

    def serves(self):
        if self.ready is None:
            with self._lock:
                if self.ready is None:
                    self._try()
        return self.ready

    def _try(self):
        reason = _unavailable()
        if reason is None:
            try:
                self._load()
            except Exception as error:  # a failed build serves nothing
                reason = f"{type(error).__name__}: {error}"
        self.ready, self.reason = reason is None, reason
        if reason is not None:
            _log.info("keras_ema_opt: %s runs as the framework's own step "
                      "(the C++ kernel is unavailable: %s)", self._what,
                      reason)


def _unavailable():
    if os.environ.get("KERAS_EMA_OPT_CPU_KERNELS", "1") == "0":
        return "KERAS_EMA_OPT_CPU_KERNELS=0"
    if platform.system() != "Linux":
        return f"built on Linux only, not {platform.system()}"
    if compiler() is None:
        return "no C++ compiler (set CXX)"
    return None


def compiler():
    """The compiler's command as a list, or None."""
    given = shlex.split(os.environ.get("CXX", ""))
    if given:
        found = shutil.which(given[0])
        return [found, *given[1:]] if found else None
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return [found]
    return None


def accepts(flag):
    """Whether the compiler takes ``flag`` (GCC refuses an unknown
    ``-mno-...``)."""
    done = subprocess.run(
        [*compiler(), "-fsyntax-only", "-x", "c++", flag, "-"],
        input="", capture_output=True, text=True, timeout=60)
    return done.returncode == 0


def build(name, sources, flags, versions, load, load_errors=(OSError,)):
    """``load(path)`` of the shared library built from ``sources`` (the
    first is compiled, the others are headers it includes) with ``flags``
    after :data:`FLAGS`: from the cache, or compiled anew; ``versions``:
    what else the build depends on (the framework's version).

    A cached file cut short (its ELF headers name bytes past its end,
    which would kill the process when mapped) or that ``load`` refuses
    (``load_errors``: damaged) is rebuilt once. A library built here that
    ``load`` still refuses (a cache on a file system mounted ``noexec``)
    is marked so, and later processes try it without building it again,
    until one loads it."""
    command = compiler()
    version = subprocess.run([*command, "--version"], capture_output=True,
                             text=True, check=True, timeout=60).stdout
    key = hashlib.sha256()
    for part in (*(HERE.joinpath(s).read_bytes() for s in sources),
                 *(str(v).encode() for v in versions), version.encode(),
                 " ".join((*FLAGS, *flags)).encode(),
                 _cpu_signature().encode()):
        key.update(part)
        key.update(b"\0")
    target = _cache_dir() / f"{name}-{key.hexdigest()[:20]}.so"
    unloadable = target.with_name(target.name + ".unloadable")

    def rebuild():
        target.unlink(missing_ok=True)
        _compile(command, HERE / sources[0], flags, target)

    built = not (target.exists() and whole_elf(target))
    if built:
        rebuild()
    try:
        loaded = load(target)
    except load_errors as error:
        if built or unloadable.exists():
            raise _unloadable(unloadable, error) from error
        rebuild()  # a damaged file in the cache: build it again, once
        try:
            loaded = load(target)
        except load_errors as again:
            raise _unloadable(unloadable, again) from again
    unloadable.unlink(missing_ok=True)
    return loaded


def _unloadable(marker, error):
    """Mark the library ``marker`` is beside as built but not loadable
    here; the error to raise, which says where to build it instead."""
    try:
        marker.write_text(f"{type(error).__name__}: {error}\n")
    except OSError:  # an unwritable cache: the next process builds again
        pass
    return RuntimeError(
        f"{type(error).__name__}: {error} (built in {marker.parent}, which "
        "cannot load it, perhaps a file system mounted noexec: set "
        "KERAS_EMA_OPT_CACHE to another folder)")


def whole_elf(path):
    """Whether ``path`` holds every byte its ELF headers name: its
    segments (mapping one cut short kills the process with SIGBUS) and
    section headers. False for a file that is not ELF."""
    import struct

    try:
        with open(path, "rb") as f:
            head = f.read(64)
            size = os.fstat(f.fileno()).st_size
            if head[:4] != b"\x7fELF" or len(head) < 6 or head[4] not in (
                    1, 2) or head[5] not in (1, 2):
                return False
            wide = head[4] == 2
            # The ELF header's and a program header's sizes.
            if len(head) < (64 if wide else 52):
                return False
            end = "<" if head[5] == 1 else ">"
            if wide:
                phoff, shoff = struct.unpack_from(end + "QQ", head, 0x20)
                phent, phnum, shent, shnum = struct.unpack_from(
                    end + "HHHH", head, 0x36)
            else:
                phoff, shoff = struct.unpack_from(end + "II", head, 0x1C)
                phent, phnum, shent, shnum = struct.unpack_from(
                    end + "HHHH", head, 0x2A)
            if phent < (56 if wide else 32) or (
                    phoff + phent * phnum > size
                    or shoff + shent * shnum > size):
                return False
            f.seek(phoff)
            table = f.read(phent * phnum)
    except OSError:
        return False
    for i in range(phnum):
        if wide:
            offset, filesz = struct.unpack_from(end + "QxxxxxxxxxxxxxxxxQ",
                                                table, i * phent + 8)
        else:
            offset, filesz = struct.unpack_from(end + "IxxxxxxxxI", table,
                                                i * phent + 4)
        if offset + filesz > size:
            return False
    return True


def _compile(command, source, flags, target):
    cache = target.parent
    cache.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(cache)
    fd, temp = tempfile.mkstemp(dir=cache, prefix=".build-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run(
            [*command, *FLAGS, str(source), "-o", temp, *flags],
            capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(command)} exited "
                               f"{done.returncode}: "
                               f"{done.stderr.strip()[-2000:]}")
        with open(temp, "rb") as f:  # on disk before it is named
            os.fsync(f.fileno())
        os.replace(temp, target)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


def _remove_abandoned(cache, age=3600):
    """Temporary files of builds killed an hour ago or more."""
    now = time.time()
    for path in cache.glob(".build-*"):
        try:
            if now - path.stat().st_mtime > age:
                path.unlink()
        except OSError:  # another process took it meanwhile
            pass


def _cpu_signature():
    """What ``-march=native`` compiled for: the machine and the CPU's
    model and features (x86's ``flags``, ARM's ``Features`` and part)."""
    fields = ("model name", "flags", "Features", "CPU implementer",
              "CPU architecture", "CPU variant", "CPU part")
    lines = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name = line.split(":")[0].strip()
                if name in fields:
                    lines.setdefault(name, line.strip())
    except OSError:
        pass
    return "\n".join([platform.machine(), platform.processor(),
                      *sorted(lines.values())])


def _cache_dir():
    given = os.environ.get("KERAS_EMA_OPT_CACHE")
    if given:
        return pathlib.Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "keras_ema_opt"
