"""The ``keras-ema-opt`` command.

    keras-ema-opt demo        raw vs EMA vs SWA vs post-hoc EMA on digits
    keras-ema-opt info        versions of keras, the backend and this package
    keras-ema-opt --version

A thin layer: each sub-command calls a library function and returns an exit
code from ``main(argv)``.
"""

import argparse
import importlib.metadata
import json
import sys


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
    from keras_ema_opt.errors import InvalidArgumentError

    try:
        result = demo.run_demo(args.output, epochs=args.epochs,
                               seed=args.seed, plot=not args.no_plot)
    except InvalidArgumentError as e:
        print(f"keras-ema-opt demo: {e}", file=sys.stderr)
        return 1
    print()
    print(f"Keras backend: {result['backend']}, {result['seconds']} s")
    print(demo.format_table(result))
    for kind, path in result["files"].items():
        print(f"{kind}: {path}")
    return 0


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
    info = sub.add_parser("info", help="print versions of what is installed")
    info.add_argument("--json", action="store_true", help="print JSON")
    return parser


def main(argv=None):
    """Run the command line; returns the process exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
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
