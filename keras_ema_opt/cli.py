"""The ``keras-ema-opt`` command.

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
    info = sub.add_parser("info", help="print versions of what is installed")
    info.add_argument("--json", action="store_true", help="print JSON")
    return parser


def main(argv=None):
    """Run the command line; returns the process exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
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
