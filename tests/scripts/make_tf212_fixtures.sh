#!/usr/bin/env bash
# Regenerate the committed fixture set tests/fixtures/tf2.12/ with real
# tf.keras 2.12 (TensorFlow 2.12.1, whose Keras 2 is tf.keras itself), in a
# separate Python 3.11 virtual environment:
#
#     bash tests/scripts/make_tf212_fixtures.sh [PYTHON3.11]
#
# The cases are read by tests/test_migration_tf212.py (TF212_CASES); keep
# both lists equal. The set is small on purpose: every Keras 2.12 optimizer
# (new and OptimizerV2, EMA on and off) on the MLP, and a few on the other
# models, each in all four formats.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${1:-python3.11}
VENV=${KEO_TF212_VENV:-/tmp/keo-tf212}
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q "tensorflow-cpu==2.12.1" "h5py<3.17"
fi
OPTIMIZERS="sgd sgd_ema adam adam_ema adamw adagrad adadelta adamax nadam
    rmsprop_ema ftrl adafactor L_sgd L_adam L_adagrad L_adadelta L_adamax
    L_nadam L_rmsprop L_rmsprop_m L_ftrl"
CASES=""
for o in $OPTIMIZERS; do CASES="$CASES $o:mlp"; done
CASES="$CASES adam_ema:conv L_sgd:conv rmsprop_ema:embed L_adagrad:embed
    sgd_ema:nested L_rmsprop:rnn adam:custom"
OUT=tests/fixtures/tf2.12
rm -rf "$OUT.tmp"
mkdir -p "$OUT.tmp"
CUDA_VISIBLE_DEVICES="" TF_CPP_MIN_LOG_LEVEL=3 \
    "$VENV/bin/python" tests/scripts/make_legacy_artifacts.py "$OUT.tmp" $CASES
"$VENV/bin/python" -c "import tensorflow as tf; print(tf.__version__)" \
    > "$OUT.tmp/TENSORFLOW_VERSION"
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
du -sh "$OUT"
