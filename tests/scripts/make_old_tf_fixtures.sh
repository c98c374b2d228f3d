#!/usr/bin/env bash
# Regenerate a committed fixture set, tests/fixtures/tf2.12/ or
# tests/fixtures/tf2.15/, with that TensorFlow release's own Keras 2
# (tf.keras 2.12 in TensorFlow 2.12.1; Keras 2.15, the `keras` package that
# TensorFlow 2.15.1 ships as tf.keras), in a separate Python 3.11 virtual
# environment, the one the tests make under .pytest-fixtures/ (about 20 s
# to install from the package registry):
#
#     bash tests/scripts/make_old_tf_fixtures.sh 2.12|2.15 [PYTHON3.11]
#
# The tests make the same sets during their run (tests/old_tf.py, which
# lists the cases); they read these committed ones only with
# KEO_OLD_TF_FIXTURES=committed, for a machine without the package
# registry. The set is small on purpose: every optimizer that Keras 2
# release has (new and OptimizerV2, EMA on and off) on the MLP, and a few
# on the other models, each in all four formats. Beside it,
# tests/fixtures/tfVERSION-lookups/ holds SavedModels of adapted lookup
# layers (make_lookup_artifacts.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=${1:?usage: make_old_tf_fixtures.sh 2.12|2.15 [PYTHON3.11]}
# The release's environment, as the tests make it (tests/old_tf.py).
export KEO_OLD_TF_PYTHON=${2:-${KEO_OLD_TF_PYTHON:-python3.11}}
PY=$(python3 tests/old_tf.py python "$VERSION")
CASES=$(python3 tests/old_tf.py cases "$VERSION")
OUT=tests/fixtures/tf$VERSION
rm -rf "$OUT.tmp"
mkdir -p "$OUT.tmp"
# TensorFlow 2.15 would look for tf_keras where TF_USE_LEGACY_KERAS is set
# (make_legacy_artifacts.py sets it for TensorFlow 2.16 and later).
TF_USE_LEGACY_KERAS=0 CUDA_VISIBLE_DEVICES="" TF_CPP_MIN_LOG_LEVEL=3 \
    "$PY" tests/scripts/make_legacy_artifacts.py "$OUT.tmp" $CASES
"$PY" -c "import tensorflow as tf; print(tf.__version__)" \
    > "$OUT.tmp/TENSORFLOW_VERSION"
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
du -sh "$OUT"
# Adapted lookup layers, whose vocabularies a SavedModel keeps in its graph
# (tests/test_model_configs.py): the trained model and the inverted layer.
rm -rf "$OUT-lookups.tmp"
mkdir -p "$OUT-lookups.tmp"
TF_USE_LEGACY_KERAS=0 CUDA_VISIBLE_DEVICES="" TF_CPP_MIN_LOG_LEVEL=3 \
    "$PY" tests/scripts/make_lookup_artifacts.py \
    "$OUT-lookups.tmp"
rm -rf "$OUT-lookups.tmp/padded" "$OUT-lookups.tmp/same_names"
cp "$OUT/TENSORFLOW_VERSION" "$OUT-lookups.tmp/"
rm -rf "$OUT-lookups"
mv "$OUT-lookups.tmp" "$OUT-lookups"
du -sh "$OUT-lookups"
