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

import datetime
import glob
import itertools
import json
import math
import numbers
import os
import re
import warnings
import zipfile

import numpy as np

from keras_ema_opt import _io
from keras_ema_opt.errors import InvalidArgumentError

SNAPSHOT_PATTERN = "phema-{step:09d}.npz"
_SNAPSHOT_GLOB = "phema-*.npz"


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

    Raises:
        InvalidArgumentError: steps and exponents of other lengths, none,
            not finite, a step not above 0, or an exponent not above -1/2
            (a profile ``t^gamma`` on ``[0, t]`` is square-integrable only
            there).
    """
    in_t, in_gamma = _profiles("in", in_t, in_gamma)
    out_t, out_gamma = _profiles("out", out_t, out_gamma)
    in_t, in_gamma = in_t.reshape(-1, 1), in_gamma.reshape(-1, 1)
    out_t, out_gamma = out_t.reshape(1, -1), out_gamma.reshape(1, -1)
    a = profile_inner_product(in_t, in_gamma, in_t.T, in_gamma.T)
    b = profile_inner_product(in_t, in_gamma, out_t, out_gamma)
    x = np.linalg.lstsq(a, b, rcond=None)[0]
    return x / np.sum(x, axis=0, keepdims=True)


def _profiles(side, t, gamma):
    """``(t, gamma)`` of power-function profiles as float64 vectors of one
    length, each profile one that EDM2's inner products are defined on."""
    arrays = []
    for name, value in ((f"{side}_t", t), (f"{side}_gamma", gamma)):
        try:
            array = np.asarray(value, np.float64)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(
                f"`{name}` must be numbers (a scalar, or a sequence or "
                f"array of one per profile). Received: {name}={value!r}"
            ) from e
        if not np.isfinite(array).all():
            raise InvalidArgumentError(
                f"`{name}` must be finite numbers. Received: "
                f"{name}={value!r}")
        arrays.append(array.reshape(-1))
    t, gamma = arrays
    if t.size == 0 or t.size != gamma.size:
        raise InvalidArgumentError(
            f"`{side}_t` and `{side}_gamma` must hold one step and one "
            f"exponent for each profile, at least one. Received: "
            f"{t.size} steps and {gamma.size} exponents.")
    if (t <= 0).any() or (gamma <= -0.5).any():
        raise InvalidArgumentError(
            f"Each profile must end at a step above 0 with an exponent "
            "above -1/2 (t^gamma on [0, t] is square-integrable only "
            f"there; EDM2 fits the snapshots of 0 < t_i). Received: "
            f"{side}_t={t.tolist()}, {side}_gamma={gamma.tolist()}")
    return t, gamma


def write_snapshot(directory, step, gammas, every, arrays, run=None):
    """Write one snapshot atomically; returns its path.

    ``arrays`` maps ``"<slot>/<variable path>"`` to numpy arrays. Averages
    of a dtype numpy's ``.npz`` cannot read back (bfloat16) are written as
    float32, which holds them exactly. Snapshots in ``directory`` of later
    steps are not of this run (``set_aside``). ``run`` (text) names the
    run it is of, where known (``set_aside_other_runs``).
    """
    os.makedirs(directory, exist_ok=True)
    set_aside(directory, after=int(step))
    path = os.path.join(directory, SNAPSHOT_PATTERN.format(step=int(step)))
    meta = {"step": int(step), "gammas": [float(g) for g in gammas],
            "every": int(every)}
    if run is not None:
        meta["run"] = str(run)
    arrays = {key: _storable(np.asarray(value))
              for key, value in arrays.items()}
    with _io.temporary_beside(path, ".npz") as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, __meta__=np.frombuffer(
                json.dumps(meta).encode(), dtype=np.uint8), **arrays)
        _io.publish(tmp, path)
    return path


def _snapshot_steps(directory):
    """``{step: path}`` of the snapshot files in ``directory``, by name."""
    found = {}
    for path in glob.glob(os.path.join(directory, _SNAPSHOT_GLOB)):
        match = re.fullmatch(r"phema-([0-9]+)\.npz", os.path.basename(path))
        if match:
            found[int(match.group(1))] = path
    return found


def set_aside(directory, after=-1, why=None):
    """Move the snapshots of ``directory`` of steps after ``after`` (all of
    them by default) to a folder of their own in it, with a warning;
    returns that folder, or None where none was moved.

    A run writes its snapshots in the order of its steps, so one of a later
    step in its folder, as it writes another, is not of its own past: it is
    another run's (a folder used again), or of the steps a run resumed from
    an earlier checkpoint takes again. Left there, ``synthesize`` would mix
    them into this run's solve (by default at the last step, theirs). They
    go to ``superseded-<time>-<n>/``, which ``synthesize`` does not read.
    """
    later = sorted((step, path) for step, path in
                   _snapshot_steps(directory).items() if step > after)
    return _move_aside(
        directory, later,
        why or f"it writes step {after}, and a run writes its snapshots "
        "in order: they are another run's (the folder used again), or "
        "of steps a run resumed from an earlier point takes again")


def set_aside_other_runs(directory, run):
    """``set_aside`` of the snapshots of ``directory`` that record another
    run than ``run``, whatever their steps: a run resumed at a later step
    into a folder another run used. Snapshots that record no run, or that
    cannot be read, stay (``synthesize`` names the latter)."""
    others = []
    for step, path in sorted(_snapshot_steps(directory).items()):
        try:
            theirs = _read_meta(path).get("run")
        except InvalidArgumentError:
            continue
        if theirs is not None and theirs != run:
            others.append((step, path))
    return _move_aside(
        directory, others,
        f"they record another run than this one ({run}), and a folder "
        "keeps one run's snapshots (the folder used again)")


def _move_aside(directory, items, why):
    """Move the ``(step, path)`` snapshots ``items`` to a new
    ``superseded-<time>-<n>/`` in ``directory``, with a warning saying
    ``why`` they are not this run's; that folder, or None for none."""
    if not items:
        return None
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime(
        "%Y%m%dT%H%M%SZ")
    n = 0
    while os.path.exists(os.path.join(directory, f"superseded-{stamp}-{n}")):
        n += 1
    aside = os.path.join(directory, f"superseded-{stamp}-{n}")
    os.makedirs(aside)
    for _, path in items:
        os.replace(path, os.path.join(aside, os.path.basename(path)))
    steps = [step for step, _ in items]
    warnings.warn(
        f"{len(steps)} power-EMA snapshot(s) in {directory} (steps "
        f"{', '.join(map(str, _elided(steps, 3, 2)))}) are not this run's: "
        + why + f". Moved to {aside}, so that synthesize() reads this "
        "run's alone.", stacklevel=4)
    return aside


def set_aside_after_start(directory, start, tense="starts"):
    """``set_aside`` of the snapshots after step ``start``, where a run
    ``starts`` (``fit()``, before its first step) or ``started`` (a
    custom loop's first snapshot into the folder): none of a later step
    is of its past."""
    return set_aside(
        directory, after=start,
        why=f"this run {tense} at step {start}, so they are another run's "
        "(the folder used again)" + (
            "" if start == 0 else ", or of the steps it takes again "
            "(resumed from an earlier point)"))


def _elided(items, head, tail):
    """``items``, or their first ``head`` and last ``tail`` around an
    ``"..."`` where there are more (for messages)."""
    if len(items) <= head + tail + 1:
        return list(items)
    return list(items[:head]) + ["..."] + list(items[-tail:])


def _storable(array):
    if array.dtype.kind in "fiub" and array.dtype.name != "bfloat16" and (
            array.dtype.isbuiltin):
        return array
    return array.astype(np.float32)


# What numpy raises on a damaged or truncated .npz.
_UNREADABLE = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile)


def _snapshot_error(path, problem):
    return InvalidArgumentError(
        f"{path} is not a readable power-EMA snapshot: {problem}")


def _read_meta(path):
    try:
        with np.load(path) as data:
            meta = json.loads(bytes(data["__meta__"]).decode())
    except _UNREADABLE as e:
        raise _snapshot_error(path, f"{type(e).__name__}: {e}") from e
    if not isinstance(meta, dict) or not isinstance(
            meta.get("step"), int) or not isinstance(
            meta.get("gammas"), list) or not all(
            _finite_number(g) for g in meta["gammas"]):
        raise _snapshot_error(
            path, f"its metadata {meta!r} lacks an integer `step` and a "
            "list of `gammas` (finite numbers)")
    every = meta.get("every", 1)  # written by every version since 2f21de0
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise _snapshot_error(
            path, f"its update interval `every` is {every!r}, not a "
            "positive integer")
    if not isinstance(meta.get("run", ""), str):
        raise _snapshot_error(
            path, f"its `run` is {meta['run']!r}, not a run's name (text)")
    return meta


def _finite_number(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an integer beyond any float
        return False


def _read_arrays(path):
    try:
        with np.load(path) as data:
            return {k: data[k] for k in data.files if k != "__meta__"}
    except _UNREADABLE as e:
        raise _snapshot_error(path, f"{type(e).__name__}: {e}") from e


def _index(directory, max_step=None):
    """``[(meta, path)]`` of the snapshots in ``directory`` (up to
    ``max_step``), sorted by step; reads only their metadata. Files are
    snapshots by their names' pattern, ``phema-<step>.npz``, as
    ``set_aside`` takes them (another file, ``phema-notes.npz``, made the
    whole reconstruction fail)."""
    out = []
    for path in sorted(_snapshot_steps(directory).values()):
        meta = _read_meta(path)
        if max_step is None or meta["step"] <= max_step:
            out.append((meta, path))
    out.sort(key=lambda item: item[0]["step"])
    return out


def read_snapshots(directory, max_step=None):
    """All snapshots in ``directory`` (up to ``max_step``), sorted by step.

    Returns:
        A list of ``(meta, arrays)`` with ``arrays`` a dict of numpy arrays.

    Raises:
        InvalidArgumentError: naming a file that is not a readable snapshot.
    """
    return [(meta, _read_arrays(path))
            for meta, path in _index(directory, max_step)]


def profile_end(meta):
    """A snapshot's ``t_i``: the step of its averages' last update.

    ``PowerEMA`` updates its averages at the multiples of ``every`` (it
    has no ``start_step``), and a snapshot can be written between two of
    them (``snapshot_every`` not a multiple of ``every``, or a callback
    call that passes the snapshot's step under ``steps_per_execution``):
    its averages then hold the profile on ``[0, step // every * every]``,
    not on ``[0, step]``. 0: no update yet, no profile.
    """
    every = meta.get("every", 1)
    return meta["step"] // every * every


def _family(name):
    """A model's name without the ``_<n>`` Keras' naming adds to the second
    and later models of a name in a process (``sequential_1``)."""
    return re.sub(r"_[0-9]+$", "", name)


def _under_one(paths, head=None):
    """``(head, {rest: path})`` where every path lies under one head above
    a layer's path (``sequential`` of ``sequential/d1/kernel``, not ``d1``
    of ``d1/kernel``), that one if given; else None."""
    rests = {}
    for path in paths:
        parts = path.split("/", 1)
        if len(parts) != 2 or "/" not in parts[1] or (
                head is not None and parts[0] != head):
            return None
        head = parts[0]
        rests[parts[1]] = path
    return None if head is None else (head, rests)


def align_paths(keys, targets, model_name=None, containers=True):
    """Map each of ``keys`` to one of ``targets``, one to one, by path.

    The same path; or else the same path without a model's name, or under
    another name of that model (the same but for the ``_<n>`` Keras adds):
    Keras 3 puts a ``Sequential`` or subclassed model's name at the head
    of its variables' paths when it builds them
    (``sequential/d1/kernel``); the same model loaded from a ``.keras``
    file has ``d1/kernel``, and one built again in the same process
    ``sequential_1/d1/kernel``.

    A head counts as a model's name only where it is ``model_name`` (the
    targets' model, for ``assign_by_path``) or of its family, or, without
    ``model_name`` (snapshots matched with each other), where the keys or
    the targets all lie under it and the map then names every target. So
    ``d1/kernel`` never matches ``d2/kernel``, nor ``encoder/dense/kernel``
    a ``dense/kernel`` beside an ``encoder/dense_1/kernel``, nor, into a
    model, ``block_1/...`` its ``block_2/...``. Where no model's name
    accounts for the paths, the names of nested models and wrappers, which
    a loaded model's paths lack too (``outer/block/d/kernel`` loads as
    ``d/kernel``): ``_without_containers``. Callers check the shapes.

    Returns:
        A dict ``key -> target``, or None where no map, or more than one,
        names every key.
    """
    keys, targets = list(keys), list(targets)
    known = set(targets)
    if len(set(keys)) != len(keys):
        return None
    whole = model_name is None  # each snapshot holds the same variables
    if all(key in known for key in keys):
        if not whole and shadowed(keys, targets):
            return None
        return {key: key for key in keys}
    under_keys = _under_one(keys)
    if whole:
        under_targets = _under_one(targets)
    else:
        # The model's own variables; others (a seed generator's) aside.
        prefix = model_name + "/"
        under_targets = _under_one(
            [t for t in targets if t.startswith(prefix)], model_name)
    found = []
    if under_keys is not None and (
            whole or _family(under_keys[0]) == _family(model_name)):
        head, rests = under_keys
        rest_of = {path: rest for rest, path in rests.items()}
        if all(rest_of[key] in known for key in keys):
            found.append({key: rest_of[key] for key in keys})
        if under_targets is not None:
            other, paths = under_targets
            if other != head and _family(other) == _family(head) and all(
                    rest_of[key] in paths for key in keys):
                found.append({key: paths[rest_of[key]] for key in keys})
    if under_targets is not None:
        _, paths = under_targets
        if all(key in paths for key in keys):
            found.append({key: paths[key] for key in keys})
    if whole:
        found = [m for m in found if set(m.values()) == known]
    if not found and containers:
        found = [_without_containers(keys, targets, whole)]
    return found[0] if len(found) == 1 else None


def _numbered(name):
    """``(family, n)`` of a name as Keras' ``uniquify`` makes them:
    ``("dense", 0)`` of ``dense``, ``("dense", 3)`` of ``dense_3``."""
    match = re.fullmatch(r"(.+?)_([0-9]+)", name)
    return (match.group(1), int(match.group(2))) if match else (name, 0)


def keras_named_families(model):
    """The names Keras gives ``model``'s layers made without a name (their
    class's, in snake case: ``dense`` of ``Dense``, and a
    ``Bidirectional``'s ``forward_gru``), where a layer has such a name:
    the ``families`` of ``renumbered``."""
    from keras.src.utils import naming

    families = set()
    flatten = getattr(model, "_flatten_layers", None)
    for layer in flatten(include_self=True) if flatten else ():
        own = naming.to_snake_case(type(layer).__name__)
        family = _numbered(layer.name)[0]
        if family in (own, "forward_" + own, "backward_" + own):
            families.add(family)
    return families


def renumbered(keys, targets, model_name, families, most=64):
    """The maps of ``keys`` to ``targets`` once the names Keras gave
    layers itself are numbered as in a model built again in this process.

    Keras names a layer made without a name after its class, numbered in
    the process (``dense``, ``dense_1``, ...): the same model built again
    in the same process names its layers ``dense_2``, ``dense_3``, and its
    variables' paths change with them. Each family of ``families`` (the
    names the targets' model gave its layers itself, ``dense``) is shifted
    by one number for all its names, the one that takes each of the keys'
    names of that family to a name of the targets (a frozen layer that no
    key names keeps its place in the count); names of other families are
    kept. Each renaming is then matched by ``align_paths`` as it is or
    under the model's other name, never by dropping containers' names.

    Returns:
        The list of the distinct maps found (``key -> target``), empty
        where a family has no such shift or the shifts would make more than
        ``most`` renamings to try.
    """
    def numbers(paths):
        found = {}
        for path in paths:
            for part in path.split("/")[:-1]:
                family, n = _numbered(part)
                if family in families:
                    found.setdefault(family, {})[n] = part
        return found

    have, want = numbers(targets), numbers(keys)
    options = []  # (family, [shift, ...])
    count = 1
    for family, named in sorted(want.items()):
        there = have.get(family, {})
        low = min(named)
        shifts = [s for s in sorted({n - low for n in there})
                  if all(n + s in there for n in named)]
        if not shifts:
            return []
        options.append((family, shifts))
        count *= len(shifts)
    if not options or count > most:
        return []
    maps = []
    for chosen in itertools.product(*(shifts for _, shifts in options)):
        if not any(chosen):
            continue  # the names as they are: align_paths found no map
        rename = {}
        for (family, _), shift in zip(options, chosen):
            for n, name in want[family].items():
                rename[name] = have[family][n + shift]
        renamed = {}
        for key in keys:
            parts = key.split("/")
            renamed["/".join([rename.get(p, p) for p in parts[:-1]]
                             + parts[-1:])] = key
        if len(renamed) != len(keys):
            continue
        found = align_paths(list(renamed), targets, model_name=model_name,
                            containers=False)
        if found is not None:
            pairs = {renamed[r]: t for r, t in found.items()}
            if pairs not in maps:
                maps.append(pairs)
    return maps


def shadowed(keys, targets):
    """The keys that are targets and could also be another target that no
    key is, which a load has put at the key's path (sorted): into a model,
    a weight for ``d/kernel`` from a loaded model whose Sequential ``enc``
    held that ``d``, beside a built model's frozen top-level ``d``."""
    exact = set(keys) & set(targets)
    found = set()
    for target in targets:
        if target in exact:
            continue
        parts = target.split("/")
        found.update(end for end in ("/".join(parts[-n:])
                                     for n in range(2, len(parts)))
                     if end in exact)
    return sorted(found)


def _without_containers(keys, targets, whole):
    """The map where one side's paths are the other's without the names of
    layers that hold layers, or None.

    Keras 3 builds a loaded ``Sequential`` or functional model's layers
    outside the name scopes of the models and wrappers that hold them:
    ``outer/block/d/kernel`` (a ``Sequential`` nesting a ``Sequential``)
    loads as ``d/kernel``, ``bi/forward_g/gru_cell/kernel`` (a
    ``Bidirectional``) as ``forward_g/gru_cell/kernel``; a subclassed
    layer keeps its name. A key that is a target maps to itself (into a
    model, not where a target no key is ends with it: ``shadowed``).
    Every other key maps to a target that ends with it or that it ends
    with (a layer and a variable at least), not a key's own: the only
    such target left once the keys with one have taken theirs, over and
    over; between snapshots (``whole``, the map naming every target), a
    key that its ends leave in doubt takes the longest. The keys are all
    the longer side of their pairs or all the shorter; the map is one to
    one. A container's name goes from all the paths under it or from
    none: where a pair drops ``encoder``, every paired path of the longer
    side under ``encoder/`` drops at least that, and no path of the
    shorter side starts with it, so ``encoder/dense/kernel`` never takes
    ``dense/kernel`` beside an ``encoder/dense_1/kernel``. Into a model,
    the model's variables that take no key are not looked at on the
    longer side: a built model's BatchNormalization statistics that were
    not averaged lie under the same containers.
    """
    split = {path: tuple(path.split("/")) for path in list(keys) + list(
        targets)}
    if not whole and shadowed(keys, targets):
        return None
    by_end = {}  # the targets by each of their ends of two names or more
    for target in targets:
        parts = split[target]
        for n in range(2, len(parts) + 1):
            by_end.setdefault(parts[-n:], []).append(target)
    known = set(targets)
    pairs = {key: key for key in keys if key in known}
    taken = set(pairs)
    longer_side = None  # "keys" or "targets"
    candidates = {}  # key -> its targets, the longest first
    for key in keys:
        if key in pairs:
            continue
        parts = split[key]
        ending_with_key = [t for t in by_end.get(parts, ())
                           if t not in taken]
        key_ends_with = [t for n in range(len(parts) - 1, 1, -1)
                         for t in by_end.get(parts[-n:], ())
                         if len(split[t]) == n and t not in taken]
        if not ending_with_key and not key_ends_with:
            return None  # no target for this key
        if ending_with_key and key_ends_with:
            return None  # the key longer than one target, shorter than one
        side = "targets" if ending_with_key else "keys"
        if longer_side not in (None, side):
            return None  # the keys longer in one pair, shorter in another
        longer_side = side
        candidates[key] = ending_with_key or key_ends_with
    while candidates:  # a key with one target left takes it
        forced = {key: left[0] for key, left in (
            (key, [t for t in cands if t not in taken])
            for key, cands in candidates.items()) if len(left) == 1}
        if not forced:
            break
        for key, target in forced.items():
            pairs[key] = target
            taken.add(target)
            del candidates[key]
    for key, cands in candidates.items():
        left = [t for t in cands if t not in taken]
        if not left or not whole or longer_side != "keys":
            return None  # several targets could have lost the same names
        pairs[key] = left[0]  # between snapshots: the longest
    if len(set(pairs.values())) != len(pairs) or (
            whole and set(pairs.values()) != known):
        return None
    dropped = {}  # each pair's longer path -> the names it drops
    for key, target in pairs.items():
        longer, shorter = ((target, key) if longer_side == "targets"
                           else (key, target))
        dropped[longer] = split[longer][:len(split[longer])
                                        - len(split[shorter])]
    if longer_side == "keys":
        longer_paths, shorter_paths = list(pairs), targets
    else:
        longer_paths, shorter_paths = list(pairs.values()), keys
    for head in set(dropped.values()) - {()}:
        for path in longer_paths:
            if split[path][:len(head)] == head and dropped.get(
                    path, ())[:len(head)] != head:
                return None  # a container's name dropped from some paths
        for path in shorter_paths:
            if split[path][:len(head)] == head:
                return None  # and kept on the other side
    return pairs


def _non_finite(name, slot, meta, path, index):
    """The error for a snapshot average that is NaN or infinite (a run
    that diverged): every reconstruction it takes part in is, too."""
    before = [m["step"] for m, _, _ in index if m["step"] < meta["step"]]
    hint = (f" The snapshots before it are finite: `step={before[-1]}` "
            "reconstructs from them alone." if before else "")
    return InvalidArgumentError(
        f"Snapshot variable {name!r} (slot {slot}) holds NaN or infinite "
        f"values in {path} (step {meta['step']}): the training had "
        "diverged by then, and any reconstruction from it would be NaN."
        + hint)


def _one_run(directory, metas):
    """Refuse snapshots of more than one run (those that record one)."""
    runs = {}
    for meta in metas:
        if "run" in meta:
            runs.setdefault(meta["run"], []).append(meta["step"])
    if len(runs) > 1:
        listed = "; ".join(
            f"run {run}: steps {', '.join(map(str, _elided(steps, 3, 2)))}"
            for run, steps in runs.items())
        raise InvalidArgumentError(
            f"The snapshots in {directory!r} are of {len(runs)} runs "
            f"({listed}), and a reconstruction mixing them fits no run's "
            "power EMA. A run sets another's aside as it writes its first "
            "snapshot into a folder; these were written beside each other "
            "(two runs writing into one folder at once?): move all but "
            "one run's snapshots out of it.")


def synthesize(directory, gamma, step=None):
    """The weights of a power EMA of exponent ``gamma`` at ``step``.

    The snapshots are read one at a time (memory: the result and one
    snapshot), and every snapshot must hold the same variables, with the
    same shapes, as the last one (by path, where a model saved and loaded
    again names them under another model name: ``align_paths``). Each
    snapshot is fitted as the profile ending at its averages' last update
    (``profile_end``: with ``every > 1``, the last multiple of ``every``
    up to its step).

    Args:
        directory: Folder of snapshots written by a ``PowerEMA``.
        gamma: Target exponent (``schedules.sigma_rel_to_gamma`` converts a
            ``sigma_rel``).
        step: Target step, one of the snapshots' steps (a power EMA at a
            later step averages weights no snapshot saw); default: the last
            snapshot's. The result is the power EMA as that snapshot's
            averages hold it, at their last update.

    Returns:
        A dict ``variable path -> float32 numpy array``, the paths as the
        snapshot of ``step`` names them.

    Raises:
        InvalidArgumentError: a step that is not a snapshot's, no snapshots,
            a damaged file, snapshots of more than one run or that do not
            come from one model, or a snapshot holding NaN or infinite
            averages (each named).
    """
    # Each snapshot's profile ends at its averages' last update
    # (`profile_end`), never before an earlier snapshot's (a run resumed
    # with a larger `every` keeps the averages of its last update under
    # the former one until its first update under the new). A snapshot
    # before the first update has no power-function profile to fit: EDM2
    # keeps the snapshots of 0 < t_i <= t.
    if not isinstance(directory, (str, os.PathLike)):
        raise InvalidArgumentError(
            "`directory` must be the path (str or os.PathLike) of the "
            "folder PowerEMA wrote its snapshots to. Received: "
            f"directory={directory!r}")
    if isinstance(gamma, (bool, np.bool_)) or not isinstance(
            gamma, numbers.Real) or not np.isfinite(gamma) or gamma <= -0.5:
        raise InvalidArgumentError(
            "`gamma` must be a finite number above -1/2, the exponent of "
            "the power EMA to synthesize (schedules.sigma_rel_to_gamma "
            f"converts a sigma_rel). Received: gamma={gamma!r}")
    if not os.path.isdir(directory):
        raise InvalidArgumentError(
            f"The snapshot folder {directory!r} does not exist"
            + (" (it is a file)" if os.path.exists(directory) else "")
            + ": give the `snapshot_dir` PowerEMA wrote its snapshots to.")
    index, end = [], 0
    for meta, path in _index(directory):
        end = max(end, profile_end(meta))
        index.append((meta, path, end))
    _one_run(directory, [meta for meta, _, _ in index])
    early = {meta["step"]: meta for meta, _, e in index if e == 0}
    index = [item for item in index if item[2] > 0]
    if not index:
        raise InvalidArgumentError(
            f"No power-EMA snapshots after the first update in "
            f"{directory!r}. PowerEMA writes them every `snapshot_every` "
            "steps.")
    steps = [meta["step"] for meta, _, _ in index]
    if step is None:
        step = steps[-1]
    shown = _elided(steps, 4, 3)
    is_step = not isinstance(step, (bool, np.bool_)) and isinstance(
        step, (int, np.integer))
    if is_step and int(step) in early:
        raise InvalidArgumentError(
            f"The snapshot of step {int(step)} in {directory!r} holds no "
            "update yet (PowerEMA updates its averages every "
            f"{early[int(step)].get('every', 1)} steps): it has no profile "
            f"to fit. `step` must be one of {shown}. Received: "
            f"step={step!r}")
    if not is_step or int(step) not in steps:
        raise InvalidArgumentError(
            "`step` must be the step of one of the snapshots in "
            f"{directory!r} ({shown}): the snapshots fit the profile of a "
            "power EMA on [0, step] only where they reach it. "
            f"Received: step={step!r}")
    step = int(step)
    # Each snapshot's profile ends at its last update (`profile_end`);
    # snapshots written between the same two updates hold the same
    # averages: the last of them is kept (it is the target's own where
    # the target is among them).
    by_end = {}
    for meta, path, end in index:
        if meta["step"] <= step:
            by_end[end] = (meta, path, end)
    index = [by_end[end] for end in sorted(by_end)]
    in_t, in_gamma = [], []
    for meta, _, end in index:
        for g in meta["gammas"]:
            in_t.append(end)
            in_gamma.append(g)
    x = solve_coefficients(in_t, in_gamma, [in_t[-1]], [gamma])[:, 0]
    last_path = index[-1][1]
    last = _read_arrays(last_path)
    shapes = {k.split("/", 1)[1]: v.shape for k, v in last.items()
              if k.startswith("0/")}
    del last
    totals = {name: np.zeros(shape, np.float64)
              for name, shape in shapes.items()}
    k = 0
    for meta, path, _ in index:
        arrays = _read_arrays(path)
        # A model saved and loaded again (or built again in another
        # process) may name the same variables under another model name.
        held = [key.split("/", 1)[1] for key in arrays
                if key.startswith("0/")]
        names = align_paths(shapes, held) or {}
        extra = sorted(set(held) - {names.get(n, n) for n in shapes})
        if extra:
            raise InvalidArgumentError(
                f"Snapshot variables {_elided(extra, 3, 2)} of {path} are "
                f"not in {last_path}: the snapshots do not come from one "
                "model.")
        for slot in range(len(meta["gammas"])):
            for name, shape in shapes.items():
                here = names.get(name, name)
                key = f"{slot}/{here}"
                if key not in arrays:
                    raise InvalidArgumentError(
                        f"Snapshot variable {name!r} (slot {slot}) is "
                        f"missing from {path}, which {last_path} has: the "
                        "snapshots do not come from one model.")
                if arrays[key].shape != shape:
                    named = name if here == name else f"{here!r} there"
                    raise InvalidArgumentError(
                        f"Snapshot variable {name!r} ({named}) has shape "
                        f"{arrays[key].shape} in {path} and {shape} in "
                        f"{last_path}: the snapshots do not come from one "
                        "model.")
                value = arrays[key].astype(np.float64)
                if not np.isfinite(value).all():
                    raise _non_finite(name, slot, meta, path, index)
                totals[name] += x[k] * value
            k += 1
        del arrays
    return {name: total.astype(np.float32) for name, total in totals.items()}
