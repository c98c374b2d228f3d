"""Typed errors raised by keras_ema_opt.

Each one also derives from the built-in exception that Keras 2 or Keras 3
raised in the same situation, so existing ``except`` clauses keep working.
"""


class InvalidArgumentError(ValueError):
    """An optimizer argument has a value outside what it accepts."""


class InvalidArgumentTypeError(InvalidArgumentError, TypeError):
    """An optimizer argument of a type it does not take: a string or
    ``None`` where a number goes (``SGD(learning_rate="0.1")``,
    ``ema_momentum="0.9"``).

    Keras 2 raised ``TypeError`` here and Keras 3 ``ValueError``; this error
    is both, and an :class:`InvalidArgumentError`.
    """


class UnknownArgumentError(TypeError, ValueError):
    """An optimizer was given an argument it does not know.

    Keras 2 raised ``TypeError`` here and Keras 3 ``ValueError``; this error
    is both.
    """


class UnknownVariableError(KeyError, ValueError):
    """A variable that is not there: one the optimizer was not built for
    was passed to it, or a weight names no variable of a model
    (``averaging.assign_by_path``).

    Keras 2 raised ``KeyError`` here and Keras 3 ``ValueError``; this error
    is both.
    """

    def __str__(self):
        # KeyError quotes its argument; a sentence reads better unquoted.
        return str(self.args[0]) if self.args else ""


class LegacyConfigError(ValueError):
    """A Keras 2 optimizer config that cannot be turned into an optimizer."""


class LegacyFormatError(ValueError):
    """A Keras 2 artifact that cannot be read: truncated, corrupt, or not
    the format it claims to be. The message names the file and, where there
    is one, the key or record that failed.

    Attributes:
        path: The file (or directory) being read.
        key: The tensor key, object path or record that failed, or ``None``.
    """

    def __init__(self, message, path=None, key=None):
        super().__init__(message)
        self.path = None if path is None else str(path)
        self.key = key


class LegacyStateError(ValueError):
    """Keras 2 training state that does not fit the Keras 3 model or
    optimizer it is migrated into: a missing variable, a shape mismatch, a
    slot with no place. The message names the variable or slot."""


class ChiefWriteError(OSError):
    """A file that the chief process writes for every process
    (``distributed.save_on_chief``, ``AveragedCheckpoint``, a ``PowerEMA``
    snapshot) could not be written there. Raised on each of the other
    processes, at the same call, so that none of them waits for the chief
    in a later collective; the chief raises its own error (an ``OSError``
    where the file system refused), which names the cause.

    Attributes:
        path: The file or folder the chief was writing.
    """

    def __init__(self, message, path=None):
        super().__init__(message)
        self.path = None if path is None else str(path)
