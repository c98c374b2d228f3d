"""Post-hoc EMA: snapshots of power-function EMAs and their reconstruction.

Karras et al. 2024, "Analyzing and Improving the Training Dynamics of
Diffusion Models" (EDM2, arXiv 2312.02696), section 3 and appendix C.3;
reference code ``NVlabs/edm2``: ``training/phema.py``,
``reconstruct_phema.py``.

A power EMA with exponent ``gamma`` averages the weights with the profile
``p_t(tau) = (gamma + 1) tau^gamma / t^(gamma + 1)`` on ``[0, t]``. Given
snapshots ``i`` of such averages (step ``t_i``, exponent ``gamma_i``), the
average of another exponent ``gamma_r`` at step ``t_r`` is approximated by
``sum_i x_i theta_i`` where ``x`` solves the least-squares fit of ``p_r`` by
the ``p_i``: ``A x = b`` with ``A_ij = <p_i, p_j>``, ``b_i = <p_i, p_r>`` and
the closed form ``<p_a, p_b> = (g_a + 1)(g_b + 1)(t_a / t_b)^e /
((g_a + g_b + 1) max(t_a, t_b))``, ``e = g_b if t_a < t_b else -g_a``.
"""

import glob
import json
import os

import numpy as np

from keras_ema_opt import _io
from keras_ema_opt.errors import InvalidArgumentError

SNAPSHOT_PATTERN = "phema-{step:09d}.npz"


def profile_inner_product(t_a, gamma_a, t_b, gamma_b):
    """``<p_a, p_b>`` of two power-EMA profiles (float64, broadcasting)."""
    t_a, gamma_a, t_b, gamma_b = (
        np.asarray(x, dtype=np.float64) for x in (t_a, gamma_a, t_b, gamma_b)
    )
    exponent = np.where(t_a < t_b, gamma_b, -gamma_a)
    numerator = (gamma_a + 1) * (gamma_b + 1) * (t_a / t_b) ** exponent
    return numerator / ((gamma_a + gamma_b + 1) * np.maximum(t_a, t_b))


def solve_coefficients(in_t, in_gamma, out_t, out_gamma):
    """Least-squares weights of the snapshots for each target (EDM2 Alg. 3).

    Args:
        in_t, in_gamma: Steps and exponents of the snapshots, shape ``(n,)``.
        out_t, out_gamma: Targets, shape ``(m,)``.

    Returns:
        ``(n, m)`` float64 coefficients; each column sums to 1 (EDM2
        renormalises the columns, so a constant is reproduced exactly).
    """
    in_t = np.asarray(in_t, np.float64).reshape(-1, 1)
    in_gamma = np.asarray(in_gamma, np.float64).reshape(-1, 1)
    out_t = np.asarray(out_t, np.float64).reshape(1, -1)
    out_gamma = np.asarray(out_gamma, np.float64).reshape(1, -1)
    a = profile_inner_product(in_t, in_gamma, in_t.T, in_gamma.T)
    b = profile_inner_product(in_t, in_gamma, out_t, out_gamma)
    x = np.linalg.lstsq(a, b, rcond=None)[0]
    return x / np.sum(x, axis=0, keepdims=True)


def write_snapshot(directory, step, gammas, every, arrays):
    """Write one snapshot atomically; returns its path.

    ``arrays`` maps ``"<slot>/<variable path>"`` to numpy arrays.
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, SNAPSHOT_PATTERN.format(step=int(step)))
    meta = {"step": int(step), "gammas": [float(g) for g in gammas],
            "every": int(every)}
    with _io.temporary_beside(path, ".npz") as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, __meta__=np.frombuffer(
                json.dumps(meta).encode(), dtype=np.uint8), **arrays)
        _io.publish(tmp, path)
    return path


def read_snapshots(directory, max_step=None):
    """All snapshots in ``directory`` (up to ``max_step``), sorted by step.

    Returns:
        A list of ``(meta, arrays)`` with ``arrays`` a dict of numpy arrays.
    """
    paths = sorted(glob.glob(os.path.join(directory, "phema-*.npz")))
    out = []
    for path in paths:
        try:
            with np.load(path) as data:
                meta = json.loads(bytes(data["__meta__"]).decode())
                arrays = {k: data[k] for k in data.files if k != "__meta__"}
        except (OSError, ValueError, KeyError) as e:
            raise InvalidArgumentError(
                f"{path} is not a readable power-EMA snapshot: {e}"
            ) from e
        if max_step is None or meta["step"] <= max_step:
            out.append((meta, arrays))
    return out


def synthesize(directory, gamma, step=None):
    """The weights of a power EMA of exponent ``gamma`` at ``step``.

    Args:
        directory: Folder of snapshots written by a ``PowerEMA``.
        gamma: Target exponent (``schedules.sigma_rel_to_gamma`` converts a
            ``sigma_rel``).
        step: Target step; default: the last snapshot's.

    Returns:
        A dict ``variable path -> float32 numpy array``.
    """
    # A snapshot of step 0 (before any update) has no power-function
    # profile to fit: EDM2 keeps the snapshots of 0 < t_i <= t.
    snapshots = [s for s in read_snapshots(directory, step)
                 if s[0]["step"] > 0]
    if not snapshots:
        raise InvalidArgumentError(
            f"No power-EMA snapshots after step 0 in {directory!r}"
            + ("" if step is None else f" at or before step {step}")
            + ". PowerEMA writes them every `snapshot_every` steps."
        )
    step = snapshots[-1][0]["step"] if step is None else int(step)
    in_t, in_gamma, sources = [], [], []
    for meta, arrays in snapshots:
        for slot, g in enumerate(meta["gammas"]):
            in_t.append(meta["step"])
            in_gamma.append(g)
            sources.append((arrays, f"{slot}/"))
    x = solve_coefficients(in_t, in_gamma, [step], [gamma])[:, 0]
    names = [k.split("/", 1)[1] for k in snapshots[-1][1] if k.startswith("0/")]
    result = {}
    for name in names:
        total = None
        for coefficient, (arrays, prefix) in zip(x, sources):
            key = prefix + name
            if key not in arrays:
                raise InvalidArgumentError(
                    f"Snapshot variable {name!r} is missing from a snapshot "
                    "written earlier: the snapshots do not come from one model."
                )
            term = coefficient * arrays[key].astype(np.float64)
            total = term if total is None else total + term
        result[name] = total.astype(np.float32)
    return result
