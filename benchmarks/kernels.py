"""The kernels of the compiled ``fit`` step on JAX: what XLA makes of the
fit benchmark's step (a 60-layer ``Dense(256)`` MLP, Adam) with Keras' own
``use_ema`` and with ours, counted in its optimized HLO.

    KERAS_BACKEND=jax python -m benchmarks.kernels [--names keras,ours:ema]
    KERAS_BACKEND=jax python -m benchmarks.kernels --step [--names ...]

With ``--step``, the step benchmark's optimizer step alone (200 tensors of
50,000 floats; ``optax`` beside Keras' and ours) instead, and with its
kernels the bytes they read and write (``traffic``) against the bytes the
step must move (``common.adam_bytes``): the share of the roofline that the
compiled program can reach at best, whatever its speed. On a CPU, XLA
gives each output of an update a loop of its own (no multi-output
fusion): Adam's new moments are written, then read back by the weight's
loop, and the new weight read back by its average's loop.

An average folded into the update is computed in the update's own
kernels: the step with it has the kernels of the step without it (on a
GPU each fusion is a kernel launch, the fit step's cost at this size). The
step's time is the fit benchmark's (``benchmarks.fit``); this counts what
it is made of, without timing. Each configuration is compiled in a process
of its own, with XLA's dump of the train step's module.
"""

import argparse
import gc
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks import common
from benchmarks.fit import NAMES
from benchmarks.step import configurations

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
    blocks, entry = _computations(hlo_text)
    body = blocks[entry][1]
    opcodes = [opcode for _, _, opcode, _ in _INSTRUCTION.findall(body)]
    fusions = re.findall(r" fusion\(.*?kind=(k\w+)", body)
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


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2,
             "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8,
             "u64": 8, "c64": 8, "c128": 16, "token": 0}


def _itemsize(dtype):
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    if dtype.startswith("f8"):  # f8e4m3fn, f8e5m2, ...
        return 1
    if dtype in ("s4", "u4", "f4e2m1fn"):  # packed two a byte
        return 0.5
    raise ValueError(f"benchmarks.kernels: unknown HLO element type "
                     f"{dtype!r} (known: {', '.join(_ITEMSIZE)}, f8*, s4, "
                     "u4)")


def _shape_bytes(text):
    """Bytes of every array in an HLO shape (a tuple's elements summed; a
    dynamic dimension ``<=n`` at its bound)."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]", text):
        sizes = [d.strip().removeprefix("<=") for d in dims.split(",")
                 if d.strip()]
        if not all(d.isdigit() for d in sizes):
            raise ValueError(f"benchmarks.kernels: an HLO shape without "
                             f"bounds: {dtype}[{dims}]")
        total += _itemsize(dtype) * int(np.prod([int(d) for d in sizes]))
    return int(total)


_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?)\s([a-z][\w\-]*)\((.*)$", re.M)
_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+)\s*(\(.*)?\{\s*$")


def _computations(hlo_text):
    """``({name: (header, body)}, entry name)`` of an HLO module's
    computations written over several lines (as XLA prints them)."""
    blocks, entry, lines = {}, None, hlo_text.splitlines()
    for i, line in enumerate(lines):
        match = _COMPUTATION.match(line)
        if match is None or " = " in line.split("(")[0]:
            continue
        body = []
        for inner in lines[i + 1:]:
            if inner.strip() == "}":
                break
            body.append(inner)
        blocks[match.group(2)] = (match.group(3) or "", "\n".join(body))
        if match.group(1):
            entry = match.group(2)
    if entry is None:
        raise ValueError("benchmarks.kernels: no ENTRY computation in the "
                         "HLO text (not an HLO module dump?)")
    return blocks, entry


def _operands(rest):
    """The names an instruction's operand list refers to, each once (up
    to the list's closing parenthesis: attributes and metadata after it
    name computations, not operands)."""
    depth, end = 1, len(rest)
    for i, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            end = i
            break
    return list(dict.fromkeys(re.findall(r"%([\w.\-]+)", rest[:end])))


def traffic(hlo_text):
    """Bytes the ENTRY computation's work reads and writes: each
    instruction that launches work (a fusion, a copy, a custom call, an
    unfused op) reads its operands (each once) and writes its result, in
    full. What stays in registers inside a fusion is not counted; what a
    fusion writes and another reads back is counted twice, as the memory
    moves it. A ``call`` (and an ``async-start``) counts the work of the
    computation it calls (a GPU's command buffer, say); a loop or a
    conditional counts its operands and result once, not its body's
    work per trip."""
    blocks, entry = _computations(hlo_text)
    return _computation_traffic(blocks, entry, ())


def _computation_traffic(blocks, name, calling):
    if name in calling or name not in blocks:
        raise ValueError(f"benchmarks.kernels: computation %{name} "
                         + ("calls itself" if name in calling else
                            "is called but not in the HLO text"))
    header, body = blocks[name]
    shapes = {param: _shape_bytes(shape) for param, shape in re.findall(
        r"([\w.\-]+): ((?:\([^()]*\))|[a-z][a-z0-9]*\[[^\]]*\])", header)}
    moved = 0
    for target, shape, opcode, rest in _INSTRUCTION.findall(body):
        shapes[target] = _shape_bytes(shape)
        if opcode in _NO_WORK or opcode in ("async-update", "async-done"):
            continue
        if opcode in ("call", "async-start"):
            callee = re.search(r"(?:to_apply|calls)=%?([\w.\-]+)", rest)
            if callee is None:
                raise ValueError(f"benchmarks.kernels: {opcode} %{target} "
                                 "names no computation")
            moved += _computation_traffic(blocks, callee.group(1),
                                          calling + (name,))
            continue
        operands = _operands(rest)
        unknown = [o for o in operands if o not in shapes]
        if unknown:
            raise ValueError(f"benchmarks.kernels: %{target} reads "
                             f"{', '.join('%' + o for o in unknown)}, not "
                             f"defined before it in %{name}")
        moved += shapes[target] + sum(shapes[o] for o in operands)
    return moved


def _module_number(path):
    return int(re.search(r"module_(\d+)", os.path.basename(path)).group(1))


def _compile_one(name):
    """In a process whose XLA_FLAGS dump the train step: fit a few
    batches, then count the kernels of the dumped module."""
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


def run_step(names=None):
    """The step benchmark's compiled steps (``names``, else all of its
    configurations), one after another in this process: their kernels
    (``count``), bytes moved (``traffic``) and the bytes the step must
    move."""
    import jax

    configs = configurations()
    n = common.N_TENSORS * common.SIZE
    records = []
    for name in names or configs:
        builder, kind, averages = configs[name]
        step_fn, sync = builder(kind)
        text = step_fn.compiled_text()
        needed = common.adam_bytes(n, averages)
        moved = traffic(text)
        record = dict(count(text), bench="step_kernels", backend="jax",
                      name=name, platform=jax.devices()[0].platform,
                      averages=averages, moved_bytes=moved,
                      needed_bytes=needed, moved_per_needed=moved / needed)
        common.emit(record)
        records.append(record)
        del step_fn, sync
        gc.collect()
    return records


def step_table(records):
    """A markdown table of ``run_step``'s records."""
    return common.markdown_table(
        ["configuration", "platform", "fusions (kernels)", "copies",
         "moved (MB)", "must move (MB)", "moved / must move",
         "roofline share at best"],
        [[r["name"], r["platform"], r["fusions"], r["copies"],
          f"{r['moved_bytes'] / 1e6:.1f}", f"{r['needed_bytes'] / 1e6:.1f}",
          f"{r['moved_per_needed']:.2f}", f"{1 / r['moved_per_needed']:.2f}"]
         for r in records])


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
    parser = argparse.ArgumentParser(description=common.summary(__doc__))
    parser.add_argument("--names", default=None,
                        help="comma-separated configurations of "
                        "benchmarks.fit (with --step: of benchmarks.step)")
    parser.add_argument("--step", action="store_true",
                        help="the step benchmark's optimizer step alone, "
                        "with the bytes its kernels move")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    backend = os.environ.get("KERAS_BACKEND", "jax")
    if backend != "jax":
        parser.error("benchmarks.kernels reads XLA's dump of JAX's fit step:"
                     f" run it with KERAS_BACKEND=jax (received {backend!r})")
    if args.one:
        _compile_one(args.one)
        return 0
    accepted = tuple(configurations()) if args.step else NAMES
    names = common.comma_list(parser, "--names",
                              args.names or ",".join(accepted), accepted)
    if args.step:
        print(step_table(run_step(names)))
    else:
        print(table(run(names)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
