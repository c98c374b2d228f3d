#!/usr/bin/env python3
"""Set up a virtual environment from nothing, then run the tests or the example.

    python3 ci/run.py demo      # the main job: `keras-ema-opt demo`
    python3 ci/run.py test      # the test suite, once per Keras backend
    python3 ci/run.py example   # the quick-start example, on each backend

Only a Python >= 3.10 with ``venv`` is needed. The environment lives in
``.venv/`` (``--venv`` to move it) and is reinstalled when ``pyproject.toml``
or ``ci/constraints.txt`` change. The test command runs pytest in a separate
process per backend and part of the suite (``KERAS_BACKEND=jax|tensorflow|
torch``; see ``SHARDS``) and ends with one line ``N passed, N failed, N
skipped``; its exit status is non-zero when any test failed or a run broke.
Two runs go at a time (``--jobs``): most of a test's time is single-threaded
Python.
"""

import argparse
import hashlib
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("jax", "tensorflow", "torch")
# Each backend's suite runs as these parts, one pytest process each, so that
# two at a time keep both cores busy to the end: as three whole-backend runs,
# the third started alone when the first ended and ran on one core for its
# last ~16 minutes. ``tests/test_migration.py`` is about 40% of a backend's
# time (its tf_keras fixtures are made once per clone, shared across runs by
# a file lock). ORDER is longest first, as measured at 63568e8 (seconds of
# pytest time on 2 cores, two runs at a time).
SHARDS = {
    "migration": ["tests/test_migration.py"],
    "rest": ["tests", "--ignore=tests/test_migration.py"],
}
ORDER = (("jax", "rest"),             # ~860 s
         ("tensorflow", "migration"),  # ~720 s
         ("tensorflow", "rest"),       # ~700 s
         ("torch", "rest"),            # ~640 s
         ("jax", "migration"),         # ~510 s
         ("torch", "migration"))       # ~340 s
INPUTS = ("pyproject.toml", "ci/constraints.txt")


def venv_python(venv):
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure_venv(venv):
    """Create ``venv`` and install the package with every extra, if stale."""
    stamp = venv / ".keras-ema-opt-stamp"
    digest = hashlib.sha256(
        b"".join((ROOT / p).read_bytes() for p in INPUTS)
    ).hexdigest()
    if stamp.exists() and stamp.read_text() == digest:
        return venv_python(venv)
    if not venv_python(venv).exists():
        log(f"creating virtual environment {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv_python(venv))
    log("installing keras-ema-opt[all] with ci/constraints.txt")
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["--upgrade", "pip"], check=True)
    subprocess.run(
        pip + ["-c", str(ROOT / "ci/constraints.txt"), "-e", f"{ROOT}[all]"],
        check=True,
    )
    stamp.write_text(digest)
    return venv_python(venv)


def log(message):
    print(f"[ci] {message}", flush=True)


def backend_env(backend):
    env = dict(os.environ)
    env.update(
        KERAS_BACKEND=backend,
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONHASHSEED="0",
        XLA_FLAGS=env.get("XLA_FLAGS", ""),
    )
    return env


def count(junit):
    """(passed, failed, skipped) from a pytest JUnit XML file."""
    if not junit.exists():
        return 0, 0, 0
    suites = ET.parse(junit).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    total = failed = skipped = 0
    for s in suites:
        total += int(s.get("tests", 0))
        failed += int(s.get("failures", 0)) + int(s.get("errors", 0))
        skipped += int(s.get("skipped", 0))
    return total - failed - skipped, failed, skipped


def run_tests(python, backends, pytest_args, jobs=1):
    """pytest once per backend and part of the suite (``SHARDS``), ``jobs``
    of them at a time, each in its own process with its output kept in
    ``.ci-results/<backend>-<part>.log`` and printed when it ends; a line per
    backend, then the last line, sum them up."""
    results = ROOT / ".ci-results"
    results.mkdir(exist_ok=True)
    totals = {b: [0, 0, 0] for b in backends}
    broken = []
    shards = SHARDS
    if any(not a.startswith("-") and (ROOT / a.split("::")[0]).exists()
           for a in pytest_args):
        shards = {"given": []}  # the tests named, one run per backend
    pending = [(b, part) for b, part in ORDER
               if b in backends and part in shards]
    pending += [(b, part) for b in backends for part in shards
                if (b, part) not in pending]
    left = {b: sum(1 for p in pending if p[0] == b) for b in backends}
    running = {}
    while pending or running:
        while pending and len(running) < max(1, jobs):
            backend, part = pending.pop(0)
            name = f"{backend}-{part}"
            junit = results / f"{name}.xml"
            junit.unlink(missing_ok=True)
            log_file = open(results / f"{name}.log", "w")
            log(f"pytest {part}, KERAS_BACKEND={backend}")
            proc = subprocess.Popen(
                [str(python), "-m", "pytest", *shards[part],
                 "-p", "no:cacheprovider", f"--junitxml={junit}",
                 *pytest_args],
                cwd=ROOT, env=backend_env(backend), stdout=log_file,
                stderr=subprocess.STDOUT)
            running[name] = (backend, proc, log_file, time.monotonic())
        time.sleep(1)
        for name, (backend, proc, log_file, start) in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            del running[name]
            log_file.close()
            print((results / f"{name}.log").read_text(), end="", flush=True)
            p, f, s = count(results / f"{name}.xml")
            log(f"{name}: {p} passed, {f} failed, {s} skipped "
                f"in {time.monotonic() - start:.0f}s (pytest exit {code})")
            # 5: nothing collected, as when ``-k`` selects no test of a part
            if code not in (0, 1, 5) or (code == 1 and f == 0):
                broken.append(name)
            totals[backend] = [t + n for t, n in
                               zip(totals[backend], (p, f, s))]
            left[backend] -= 1
            if not left[backend]:
                p, f, s = totals[backend]
                log(f"{backend}: {p} passed, {f} failed, {s} skipped")
    passed, failed, skipped = (sum(n) for n in zip(*totals.values()))
    if broken:
        log(f"pytest broke before reporting on: {', '.join(broken)}")
        failed += len(broken)
    print(f"{passed} passed, {failed} failed, {skipped} skipped", flush=True)
    return 0 if failed == 0 and passed > 0 else 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("demo", "test", "example"))
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv")
    parser.add_argument(
        "--backends", default=",".join(BACKENDS),
        help="comma-separated Keras backends (default: all three)",
    )
    parser.add_argument(
        "--jobs", type=int, default=min(2, os.cpu_count() or 1),
        help="backends tested at the same time (default: 2, or 1 on one "
        "core)",
    )
    args, rest = parser.parse_known_args(argv)
    python = ensure_venv(args.venv.resolve())
    backends = [b for b in args.backends.split(",") if b]
    if args.command == "test":
        return run_tests(python, backends, rest, args.jobs)
    if args.command == "demo":
        backend = os.environ.get("KERAS_BACKEND", "jax")
        log(f"keras-ema-opt demo, KERAS_BACKEND={backend}")
        return subprocess.run(
            [str(python), "-m", "keras_ema_opt.cli", "demo", *rest],
            env=backend_env(backend),
        ).returncode
    for backend in backends:
        log(f"examples/quickstart.py, KERAS_BACKEND={backend}")
        code = subprocess.run(
            [str(python), str(ROOT / "examples/quickstart.py"), *rest],
            env=backend_env(backend),
        ).returncode
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
