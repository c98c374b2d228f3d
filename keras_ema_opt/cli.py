"""The ``keras-ema-opt`` command.

    keras-ema-opt demo        raw vs EMA vs SWA vs post-hoc EMA on digits
    keras-ema-opt migrate SRC DST.keras   Keras 2 training state -> Keras 3
    keras-ema-opt inspect SRC [--json]    what a Keras 2 artifact holds
    keras-ema-opt bench       benchmarks beside the peers (source checkout)
    keras-ema-opt info        versions of keras, the backend and this package
    keras-ema-opt --version

A thin layer: each sub-command calls a library function and returns an exit
code from ``main(argv)``.
"""

import argparse
import contextlib
import importlib.metadata
import json
import signal
import sys
import warnings

from keras_ema_opt.errors import InvalidArgumentError


def environment_info():
    """What this installation runs on, as a dict of names to versions."""
    import keras

    info = {
        "keras_ema_opt": _version("keras-ema-opt"),
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
    }
    for package in ("tensorflow", "jax", "torch", "tf_keras", "numpy", "h5py"):
        info[package] = _version(package)
    return info


def _demo(args):
    from keras_ema_opt import demo

    try:
        result = demo.run_demo(args.output, epochs=args.epochs,
                               seed=args.seed, plot=not args.no_plot)
    except InvalidArgumentError as e:
        print(f"keras-ema-opt demo: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Its files are written whole or not at all, its scratch removed.
        print("keras-ema-opt demo: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line, non-zero exit (an unwritable folder)
        return _report("demo", e)
    print()
    print(f"Keras backend: {result['backend']}, {result['seconds']} s")
    print(demo.format_table(result))
    for kind, path in result["files"].items():
        print(f"{kind}: {path}")
    return 0


def _import(module, option, spec, form):
    try:
        return importlib.import_module(module)
    except Exception as e:  # the user's module may raise anything
        raise InvalidArgumentError(
            f"{option} takes {form}, importable from here (the current "
            f"folder and PYTHONPATH). Received: {spec!r}, whose module "
            f"{module!r} failed to import: {type(e).__name__}: {e}") from e


def _load_attr(spec, what):
    """``module:function`` -> the object, for ``--model``."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise InvalidArgumentError(
            f"{what} takes module:function. Received: {spec!r}")
    found = getattr(_import(module, what, spec, "module:function"), name,
                    None)
    if not callable(found):
        raise InvalidArgumentError(
            f"{what} takes module:function, a function of the module "
            f"returning the Keras 3 model. Received: {spec!r}: module "
            f"{module!r} has {'no ' if found is None else 'a non-callable '}"
            f"{name!r}.")
    return found


def _custom_objects(spec):
    """``--custom-objects module``: the module's public classes and
    functions by name, or its ``CUSTOM_OBJECTS`` dict when it has one."""
    if not spec:
        return None
    module = _import(spec, "--custom-objects", spec, "a module")
    objects = getattr(module, "CUSTOM_OBJECTS", None)
    if objects is None:
        objects = {k: v for k, v in vars(module).items()
                   if not k.startswith("_") and callable(v)}
    if not isinstance(objects, dict):
        raise InvalidArgumentError(
            f"--custom-objects: {spec}.CUSTOM_OBJECTS must be a dict of "
            f"name -> class or function. Received: "
            f"{type(objects).__name__}")
    return dict(objects)


class _Progress:
    """Stage messages on stderr, and a tensor counter while verifying
    (redrawn in place on a terminal, one final line otherwise)."""

    def __init__(self, quiet=False, stream=None, stopped=None):
        self.quiet = quiet
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        # Signals received (`_migrate`): raised again at the next stage or
        # tensor, where the handler's own exception was swallowed (Python
        # runs a handler wherever the interpreter is, a gc callback too).
        self.stopped = stopped if stopped is not None else []

    def _check(self):
        if self.stopped:
            raise _Stopped(*self.stopped[0])

    def __call__(self, message):
        self._check()
        if not self.quiet:
            print(f"keras-ema-opt migrate: {message}", file=self.stream,
                  flush=True)

    def update(self, done, total):
        self._check()
        if self.quiet or not (self.live or done == total):
            return
        end = "\n" if done == total else ""
        print(f"\rkeras-ema-opt migrate: compared {done}/{total} tensors",
              end=end, file=self.stream, flush=True)


def _migrate(args):
    from keras_ema_opt.backend import _tf_startup

    _tf_startup.import_tensorflow_quietly()
    from keras_ema_opt import savedmodel

    stopped = []
    say = _Progress(args.quiet, stopped=stopped)

    def stop(signum, frame):
        stopped.append(("interrupted", 130) if signum == signal.SIGINT
                       else ("terminated", 143))
        raise _Stopped(*stopped[0])

    # Ctrl-C and SIGTERM as an exception: the migration's `finally`
    # removes its temporary file.
    previous = {signum: signal.signal(signum, stop)
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        model = _load_attr(args.model, "--model") if args.model else None
        model_ = savedmodel.migrate(
            args.src, args.dst, custom_objects=_custom_objects(
                args.custom_objects), safe_mode=not args.unsafe,
            model=model, verify=not args.no_verify, progress=say,
            overwrite=args.overwrite)
    except Exception as e:  # one line, non-zero exit; typed errors named
        return _report("migrate", e)
    except (KeyboardInterrupt, _Stopped) as e:
        what, code = e.args if isinstance(e, _Stopped) else (
            "interrupted", 130)
        print(f"keras-ema-opt migrate: {what}; {args.dst} not written",
              file=sys.stderr)
        return code
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if stopped:  # a signal after the last stage: the file is complete
        what, code = stopped[0]
        print(f"keras-ema-opt migrate: {what} after writing {args.dst} "
              "(complete and verified)", file=sys.stderr)
        return code
    import keras

    optimizer = getattr(model_, "optimizer", None)
    if optimizer is None:
        print(f"wrote {args.dst}: {len(model_.weights)} weights, no "
              "optimizer (the source was not compiled, or was saved "
              "without it)")
        return 0
    step = int(keras.ops.convert_to_numpy(optimizer.iterations))
    print(f"wrote {args.dst}: {len(model_.weights)} weights, optimizer "
          f"{type(optimizer).__name__} at iteration {step}")
    return 0


@contextlib.contextmanager
def _one_line_warnings(command):
    """Warnings formatted as one line each, named by the command (not with
    the source line of the library that raised them), as its other
    messages are; the previous format is restored after. Only the format:
    where and whether a warning is shown (or recorded, by
    ``warnings.catch_warnings(record=True)``) stays Python's."""
    previous = warnings.formatwarning

    def format_warning(message, category, filename, lineno, line=None):
        text = str(message).strip().splitlines()
        return (f"keras-ema-opt {command}: warning: {category.__name__}: "
                f"{text[0] if text else ''}\n")

    warnings.formatwarning = format_warning
    try:
        yield
    finally:
        warnings.formatwarning = previous


class _Stopped(BaseException):
    """Ctrl-C or SIGTERM during ``migrate``: ``(what, exit code)`` (a
    BaseException, as KeyboardInterrupt: no ``except Exception`` on the
    way catches it)."""


def _report(command, error):
    """One line on stderr naming the error; the exit code 1."""
    text = str(error).splitlines()[0] if str(error) else ""
    print(f"keras-ema-opt {command}: error: {type(error).__name__}: {text}",
          file=sys.stderr)
    return 1


def _inspect(args):
    from keras_ema_opt import savedmodel

    try:
        summary = savedmodel.inspect(args.src).summary()
    except Exception as e:
        return _report("inspect", e)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{summary['path']} ({summary['format']}, Keras "
          f"{summary['keras_version'] or 'unknown'})")
    model = summary["model"] or {}
    print(f"  model: {model.get('class_name')} {model.get('name')!r}, "
          f"{len(summary['weights'])} weights")
    opt = summary["optimizer"]
    if opt is None:
        print("  optimizer: none")
    else:
        print(f"  optimizer: {opt['class_name']} ({opt['kind']}), "
              f"iterations {opt['iterations']}, learning rate "
              f"{_learning_rate(opt)}, EMA {'yes' if opt['ema'] else 'no'}")
        if opt["config"]:
            print(f"  config: {json.dumps(opt['config'].get('config', opt['config']))}")
        for name, slots in opt["slots"].items():
            print(f"    {name}: {', '.join(slots)}")
    for name, size in summary["vocabularies"].items():
        print(f"  vocabulary of {name}: " + (
            "two layers of this name" if size is None else
            f"{size} tokens (a lookup table of the graph)"))
    for warning in summary["warnings"]:
        print(f"  note: {warning}")
    return 0


def _learning_rate(opt):
    """The learning rate ``inspect`` shows: the stored value, else the
    config's (an h5 file keeps a Keras 2.11+ optimizer's there only;
    OptimizerV2's may be ``lr``), a schedule by its class."""
    def shown(value):
        if isinstance(value, float):
            return f"{value:.7g}"  # float32 values to float32's digits
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        return repr(value)

    if opt["learning_rate"] is not None:
        return shown(opt["learning_rate"])
    config = opt["config"]
    inner = config.get("config", config) if isinstance(config, dict) else None
    if not isinstance(inner, dict):
        return "not stored"
    value = inner.get("learning_rate", inner.get("lr"))
    if isinstance(value, dict):  # a serialized schedule
        return f"{value.get('class_name', 'schedule')} (config)"
    return "not stored" if value is None else f"{shown(value)} (config)"


def _bench(argv):
    """``python -m benchmarks``: the benchmarks live in the source tree
    (``benchmarks/``), beside the package."""
    try:
        from benchmarks import __main__ as bench
    except ImportError:
        print("keras-ema-opt bench: error: the benchmarks are part of the "
              "source checkout (benchmarks/), not of the installed package. "
              "Run it from the repository root, where `python -m benchmarks` "
              "works too.", file=sys.stderr)
        return 1
    return bench.main(argv)


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _parser():
    parser = argparse.ArgumentParser(
        prog="keras-ema-opt",
        description="Weight averaging for Keras 3 optimizers, and the Keras 2 "
        "optimizer contract.",
    )
    parser.add_argument(
        "--version", action="version",
        version=f"keras-ema-opt {_version('keras-ema-opt')}",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser(
        "demo", help="train a digits convnet with and without averaging")
    demo.add_argument("--output", default="keras-ema-opt-demo",
                      help="folder for the plot, model and results")
    demo.add_argument("--epochs", type=int, default=12)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--no-plot", action="store_true")
    migrate = sub.add_parser(
        "migrate", help="turn a Keras 2 artifact (SavedModel, .h5, TF "
        "checkpoint) into a Keras 3 .keras file that resumes training")
    migrate.add_argument("src", help="SavedModel dir, .h5, tf_keras .keras "
                         "file, checkpoint prefix or folder")
    migrate.add_argument("dst", help="the .keras file to write")
    migrate.add_argument("--model", metavar="MODULE:FUNCTION",
                         help="builds the Keras 3 model (bare checkpoints)")
    migrate.add_argument("--custom-objects", metavar="MODULE",
                         help="module with custom layers/losses/optimizers")
    migrate.add_argument("--no-verify", action="store_true",
                         help="skip reloading and comparing the output")
    migrate.add_argument("--unsafe", action="store_true",
                         help="allow Lambda layers (runs stored bytecode)")
    migrate.add_argument("--overwrite", action="store_true",
                         help="replace an existing destination (never the "
                         "source)")
    migrate.add_argument("--quiet", action="store_true",
                         help="print no progress (errors and warnings "
                         "still)")
    inspect = sub.add_parser(
        "inspect", help="print what a Keras 2 artifact holds")
    inspect.add_argument("src", help="SavedModel dir, .h5, tf_keras .keras "
                         "file, checkpoint prefix or folder")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    sub.add_parser(
        "bench", help="benchmarks beside the peers (python -m benchmarks)",
        add_help=False)
    info = sub.add_parser("info", help="print versions of what is installed")
    info.add_argument("--json", action="store_true", help="print JSON")
    return parser


def main(argv=None):
    """Run the command line; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its options are the benchmark driver's
        return _bench(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    if args.command == "migrate":
        with _one_line_warnings("migrate"):
            return _migrate(args)
    if args.command == "inspect":
        with _one_line_warnings("inspect"):
            return _inspect(args)
    if args.command == "info":
        info = environment_info()
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            for key, value in info.items():
                print(f"{key:>14}: {value or 'not installed'}")
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
