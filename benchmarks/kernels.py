"""The kernels of the compiled ``fit`` step on JAX: what XLA makes of the
fit benchmark's step (a 60-layer ``Dense(256)`` MLP, Adam) with Keras' own
``use_ema`` and with ours, counted in its optimized HLO.

    KERAS_BACKEND=jax python -m benchmarks.kernels [--names keras,ours:ema]

An average folded into the update is computed in the update's own
kernels: the step with it has the kernels of the step without it (on a
GPU each fusion is a kernel launch, the fit step's cost at this size). The
step's time is the fit benchmark's (``benchmarks.fit``); this counts what
it is made of, without timing. Each configuration is compiled in a process
of its own, with XLA's dump of the train step's module.
"""

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import common
from benchmarks.fit import NAMES

ROOT = Path(__file__).resolve().parent.parent
# A few batches compile the step (its time is not measured here).
BATCHES = 4


# ENTRY instructions that launch no work of their own.
_NO_WORK = {"parameter", "constant", "bitcast", "tuple", "get-tuple-element"}


def count(hlo_text):
    """Counts of the ENTRY computation of an optimized HLO module: fusions
    by kind, custom calls (library kernels: matrix products), copies,
    conditionals, loops, and any other instruction that does work unfused
    (``other``: a ``dot`` XLA left alone on a CPU, say)."""
    start = hlo_text.rfind("\nENTRY")
    if start < 0:
        raise ValueError("benchmarks.kernels: no ENTRY computation in the "
                         "HLO text (not an HLO module dump?)")
    opcodes = re.findall(r"^\s*(?:ROOT )?%?[\w.\-]+ = .*?\s([a-z][\w\-]*)\(",
                         hlo_text[start:], re.M)
    fusions = re.findall(r" fusion\(.*?kind=(k\w+)", hlo_text[start:])
    kinds = {}
    for kind in fusions:
        kinds[kind] = kinds.get(kind, 0) + 1
    named = {"fusion", "custom-call", "copy", "conditional", "while"}
    return {"fusions": len(fusions), "fusion_kinds": kinds,
            "custom_calls": opcodes.count("custom-call"),
            "copies": opcodes.count("copy"),
            "conditionals": opcodes.count("conditional"),
            "loops": opcodes.count("while"),
            "other": sum(1 for op in opcodes
                         if op not in named and op not in _NO_WORK)}


def _module_number(path):
    return int(re.search(r"module_(\d+)", os.path.basename(path)).group(1))


def _compile_one(name):
    """In a process whose XLA_FLAGS dump the train step: fit a few
    batches, then count the kernels of the dumped module."""
    import numpy as np

    from benchmarks import fit
    from benchmarks.step import keras_optimizer

    rng = np.random.default_rng(0)
    x = rng.standard_normal((fit.BATCH * BATCHES, fit.WIDTH),
                            dtype=np.float32)
    model = fit.model()
    model.compile(optimizer=keras_optimizer(name), loss="mse")
    model.fit(x, x, batch_size=fit.BATCH, epochs=1, shuffle=False,
              verbose=0)
    # The module's HLO (not its buffer-assignment or memory reports), the
    # last compiled (module numbers are not zero-padded alike everywhere).
    dumped = sorted(glob.glob(os.path.join(
        os.environ["KEO_KERNELS_DUMP"],
        "*train_step*after_optimizations.txt")), key=_module_number)
    if not dumped:
        raise RuntimeError("benchmarks.kernels: XLA dumped no train step "
                           f"module for {name}")
    import jax

    common.emit(dict(count(Path(dumped[-1]).read_text()), bench="kernels",
                     backend="jax", name=name,
                     platform=jax.devices()[0].platform))


def run(names):
    records = []
    for name in names:
        with tempfile.TemporaryDirectory() as dump:
            env = dict(os.environ, KERAS_BACKEND="jax",
                       TF_CPP_MIN_LOG_LEVEL="3", KEO_KERNELS_DUMP=dump,
                       XLA_FLAGS=" ".join(filter(None, [
                           os.environ.get("XLA_FLAGS"),
                           f"--xla_dump_to={dump}",
                           "--xla_dump_hlo_as_text",
                           "--xla_dump_hlo_module_re=.*train_step.*"])))
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.kernels", "--one", name],
                cwd=ROOT, env=env, capture_output=True, text=True,
                timeout=900)
            if proc.returncode:
                raise RuntimeError(f"benchmarks.kernels: {name} failed:\n"
                                   f"{proc.stderr[-3000:]}")
            for line in proc.stdout.splitlines():
                if line.startswith("BENCH "):
                    records.append(json.loads(line[6:]))
                    print(line, flush=True)
    return records


def table(records):
    return common.markdown_table(
        ["configuration", "platform", "fusions (kernels)", "by kind",
         "custom calls", "copies", "conditionals", "loops", "other"],
        [[r["name"], r["platform"], r["fusions"],
          ", ".join(f"{k} {v}" for k, v in sorted(r["fusion_kinds"].items())),
          r["custom_calls"], r["copies"], r["conditionals"], r["loops"],
          r["other"]] for r in records])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", default=",".join(NAMES),
                        help="comma-separated configurations of "
                        "benchmarks.fit")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    backend = os.environ.get("KERAS_BACKEND", "jax")
    if backend != "jax":
        parser.error("benchmarks.kernels reads XLA's dump of JAX's fit step:"
                     f" run it with KERAS_BACKEND=jax (received {backend!r})")
    if args.one:
        _compile_one(args.one)
        return 0
    print(table(run(common.comma_list(parser, "--names", args.names,
                                      NAMES))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
