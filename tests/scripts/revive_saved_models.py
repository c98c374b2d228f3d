"""Revive Keras 2 SavedModels with tf.saved_model.load after importing
keras_ema_opt.compat, optionally with tf_keras blocked from import.

Usage: revive_saved_models.py block|allow DIR... ; prints one JSON line.
"""

import builtins
import json
import sys

if sys.argv[1] == "block":
    _real_import = builtins.__import__

    def _guard(name, *args, **kwargs):
        if name == "tf_keras" or name.startswith("tf_keras."):
            raise ImportError(f"blocked for this test: {name}")
        return _real_import(name, *args, **kwargs)

    builtins.__import__ = _guard

import tensorflow as tf  # noqa: E402

import keras_ema_opt.compat  # noqa: E402,F401

out = {"tf_keras_loaded": "tf_keras" in sys.modules}
for path in sys.argv[2:]:
    optimizer = tf.saved_model.load(path).optimizer
    out[path] = {
        "type": type(optimizer).__name__,
        "iterations": optimizer.iterations,
        "learning_rate": optimizer.learning_rate,
        "slots": {f"{k[0]}|{k[1]}": v.tolist()
                  for k, v in optimizer.slots.items()},
        "averages": {k: v.tolist() for k, v in optimizer.averages.items()},
    }
print(json.dumps(out))
