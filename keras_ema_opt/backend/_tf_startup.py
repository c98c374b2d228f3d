"""TensorFlow's start-up notes held back while it is imported, for the
command line (``keras-ema-opt migrate``), whatever Keras backend runs."""

import importlib.util
import os
import re
import subprocess
import sys

# TensorFlow's start-up notes, written by its C++ runtime to the process'
# stderr before its logging starts (so `TF_CPP_MIN_LOG_LEVEL` cannot hold
# them back): absl's preamble, info-level lines (`I0000 ...] oneDNN custom
# operations are on`, `Could not find cuda drivers`) and the CPU features'
# second line. Warnings (`W...`) and errors (`E...`) are not among them.
STARTUP_NOTE = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called"
    r"|I\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] "
    r"|To enable the following instructions: ")


# Run by a child process that reads what TensorFlow's import writes to
# stderr and passes on all but the notes. A child, not a thread or a file:
# where the import aborts the process (a `F...` fatal line, a CPU without
# the instructions TensorFlow was built for), what it wrote is still in the
# pipe, and the child passes it on. It ignores Ctrl-C, which the parent
# passes on to the import, and it ends when the pipe closes.
_FILTER = """\
import re, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
note = re.compile(sys.argv[1].encode())
for line in sys.stdin.buffer:
    if not note.match(line):
        sys.stderr.buffer.write(line)
        sys.stderr.buffer.flush()
"""


def import_tensorflow_quietly():
    """Import TensorFlow, where it is installed and not yet imported, with
    its start-up notes held back (``STARTUP_NOTE``) and everything else
    it writes to stderr passed on as it comes.

    Keras imports TensorFlow, where it is installed, to save a model on
    any backend, and TensorFlow's C++ runtime then writes half a dozen
    info lines between the command's own; importing it first lets the
    command hold them back. A process's stderr is a file descriptor, so
    the lines are caught there, through a pipe to ``_FILTER``. Where
    stderr is closed, or no Python can be started, nothing is caught.
    """
    if "tensorflow" in sys.modules or importlib.util.find_spec(
            "tensorflow") is None or not sys.executable:
        return
    try:
        os.fstat(2)
        sys.stderr.flush()
        child = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _FILTER,
             STARTUP_NOTE.pattern], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL)
    except (OSError, AttributeError, ValueError):
        return  # no stderr to catch, or no child
    saved = os.dup(2)
    try:
        os.dup2(child.stdin.fileno(), 2)
        try:
            import tensorflow  # noqa: F401
        except Exception:  # Keras says what is wrong where it needs it
            pass
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
    finally:
        os.close(saved)
        child.stdin.close()
        try:  # the child ends once the pipe is closed
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:  # a process the import started
            child.kill()  # holds the pipe open
            child.wait()
