"""A numpy-only reader for TensorFlow tensor bundles (object checkpoints).

A checkpoint written by ``tf.train.Checkpoint.save``, ``Model.save_weights``
(TF format) or inside a SavedModel (``variables/variables``) is a *prefix*
with two kinds of files:

* ``<prefix>.index``: a LevelDB SSTable. The value under the empty key is a
  ``BundleHeaderProto``; every other key names a tensor and maps to a
  ``BundleEntryProto`` (dtype, shape, shard, offset, size, crc32c).
* ``<prefix>.data-SSSSS-of-NNNNN``: the raw tensor bytes.

:class:`BundleReader` reads them without TensorFlow. Every failure raises
:class:`keras_ema_opt.errors.LegacyFormatError` naming the file and, where
there is one, the key.
"""

import math
import os
import re
import struct

import numpy as np

from keras_ema_opt.errors import LegacyFormatError
from keras_ema_opt.savedmodel import wire

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"

_TABLE_MAGIC = 0xDB4775248B80FB57
_FOOTER_SIZE = 48
_BLOCK_TRAILER_SIZE = 5
_MASK_DELTA = 0xA282EAD8
_U32 = 0xFFFFFFFF

# ---------------------------------------------------------------------------
# crc32c (Castagnoli), as TensorFlow's and LevelDB's crc32c::Value/Extend.

_POLY = 0x82F63B78


def _make_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (_POLY if c & 1 else 0)
        table.append(c)
    return table


_TABLE = _make_table()
_TABLE_NP = np.array(_TABLE, dtype=np.uint32)
_SMALL = 1 << 12  # below this many bytes a plain Python loop is fastest
_SHIFT_CACHE = {}


def _raw_py(r, data):
    """Advance the raw (non-inverted) register ``r`` over ``data``."""
    table = _TABLE
    for b in data:
        r = table[(r ^ b) & 0xFF] ^ (r >> 8)
    return r


def _apply(images, v):
    """Apply the GF(2)-linear map given by 32 basis images to ``v``."""
    out = 0
    i = 0
    while v:
        if v & 1:
            out ^= images[i]
        v >>= 1
        i += 1
    return out


def _shift_tables(length):
    """Byte tables for the map r -> raw(r, ``length`` zero bytes).

    ``length`` is a power of two; the map is built by repeated squaring of
    the one-zero-byte map and returned as four 256-entry tables (one per
    byte of ``r``).
    """
    tables = _SHIFT_CACHE.get(length)
    if tables is not None:
        return tables
    images = [_TABLE[(1 << i) & 0xFF] ^ ((1 << i) >> 8) for i in range(32)]
    n = 1
    while n < length:
        images = [_apply(images, images[i]) for i in range(32)]
        n *= 2
    tables = []
    for t in range(4):
        table = [0] * 256
        for v in range(1, 256):
            low = v & -v
            table[v] = table[v ^ low] ^ images[8 * t + low.bit_length() - 1]
        tables.append(table)
    _SHIFT_CACHE[length] = tables
    return tables


def _raw_numpy(r, data):
    """As :func:`_raw_py`, vectorised: the data is cut into K lanes of L
    bytes, each lane's CRC is computed in parallel and the lanes are
    combined with the zero-shift map."""
    buf = np.frombuffer(data, dtype=np.uint8)
    n = buf.size
    lane = 1 << max(6, math.ceil(math.log2(math.sqrt(n))))
    k = n // lane
    head = n - k * lane
    r = _raw_py(r, buf[:head].tobytes())
    block = np.ascontiguousarray(buf[head:].reshape(k, lane).T)
    x = np.zeros(k, dtype=np.uint32)
    table = _TABLE_NP
    for j in range(lane):
        x = table[(x & 0xFF) ^ block[j]] ^ (x >> 8)
    t0, t1, t2, t3 = _shift_tables(lane)
    for xk in x.tolist():
        r = t0[r & 0xFF] ^ t1[(r >> 8) & 0xFF] ^ t2[(r >> 16) & 0xFF] ^ t3[r >> 24] ^ xk
    return r


def _crc32c_builtin(data, crc=0):
    r = crc ^ _U32
    if len(data) < _SMALL:
        r = _raw_py(r, data)
    else:
        r = _raw_numpy(r, data)
    return r ^ _U32


def _accelerated():
    """A C implementation of crc32c, when one is installed."""
    candidates = []
    try:
        import google_crc32c  # noqa: PLC0415

        if getattr(google_crc32c, "implementation", "c") == "c":
            candidates.append(lambda d, c=0: google_crc32c.extend(c, bytes(d)))
    except Exception:  # noqa: BLE001 - optional dependency
        pass
    try:
        import crc32c as _crc32c_mod  # noqa: PLC0415

        candidates.append(lambda d, c=0: _crc32c_mod.crc32c(bytes(d), c))
    except Exception:  # noqa: BLE001 - optional dependency
        pass
    for fn in candidates:
        try:
            if fn(b"123456789") == 0xE3069283 and fn(b"9", fn(b"12345678")) == 0xE3069283:
                return fn
        except Exception:  # noqa: BLE001
            continue
    return None


_ACCELERATED = _accelerated()


def crc32c(data, crc=0):
    """CRC-32C (Castagnoli) of ``data``, continuing from ``crc``.

    Matches TensorFlow's ``crc32c::Extend(crc, data, n)``; ``crc32c(data)``
    is ``crc32c::Value``. Uses ``google_crc32c`` or ``crc32c`` when one is
    importable, else a table-driven implementation vectorised with numpy.

    Args:
        data: ``bytes``, ``bytearray`` or ``memoryview``.
        crc: The CRC of the preceding bytes (0 to start).

    Returns:
        The CRC as an unsigned 32-bit int.
    """
    if _ACCELERATED is not None:
        return _ACCELERATED(data, crc)
    return _crc32c_builtin(data, crc)


def mask_crc(crc):
    """Mask a CRC as TensorFlow/LevelDB store it (``crc32c::Mask``)."""
    return ((((crc >> 15) | (crc << 17)) & _U32) + _MASK_DELTA) & _U32


def unmask_crc(masked):
    """Invert :func:`mask_crc` (``crc32c::Unmask``)."""
    rot = (masked - _MASK_DELTA) & _U32
    return ((rot >> 17) | (rot << 15)) & _U32


# ---------------------------------------------------------------------------
# TF DataType enum -> numpy dtype.


def _dtype_table():
    table = {
        1: ("DT_FLOAT", np.dtype(np.float32)),
        2: ("DT_DOUBLE", np.dtype(np.float64)),
        3: ("DT_INT32", np.dtype(np.int32)),
        4: ("DT_UINT8", np.dtype(np.uint8)),
        5: ("DT_INT16", np.dtype(np.int16)),
        6: ("DT_INT8", np.dtype(np.int8)),
        7: ("DT_STRING", np.dtype(object)),
        8: ("DT_COMPLEX64", np.dtype(np.complex64)),
        9: ("DT_INT64", np.dtype(np.int64)),
        10: ("DT_BOOL", np.dtype(np.bool_)),
        17: ("DT_UINT16", np.dtype(np.uint16)),
        18: ("DT_COMPLEX128", np.dtype(np.complex128)),
        19: ("DT_HALF", np.dtype(np.float16)),
        22: ("DT_UINT32", np.dtype(np.uint32)),
        23: ("DT_UINT64", np.dtype(np.uint64)),
    }
    try:
        import ml_dtypes  # noqa: PLC0415

        table[14] = ("DT_BFLOAT16", np.dtype(ml_dtypes.bfloat16))
        table[24] = ("DT_FLOAT8_E5M2", np.dtype(ml_dtypes.float8_e5m2))
        table[25] = ("DT_FLOAT8_E4M3FN", np.dtype(ml_dtypes.float8_e4m3fn))
    except Exception:  # noqa: BLE001 - optional dependency
        pass
    return table


DTYPES = _dtype_table()
"""Supported TF ``DataType`` enum values: ``{enum: (name, numpy dtype)}``."""

_DT_STRING = 7

# ---------------------------------------------------------------------------
# Messages of tensor_bundle.proto, by field number.

_BUNDLE_HEADER = {
    1: ("num_shards", "int32"),
    2: ("endianness", "int32"),
    3: ("version", "message"),
}
_BUNDLE_ENTRY = {
    1: ("dtype", "int32"),
    2: ("shape", "message"),
    3: ("shard_id", "int32"),
    4: ("offset", "int64"),
    5: ("size", "int64"),
    6: ("crc32c", "fixed32"),
    7: ("slices", "repeated"),
}
_VERSION_DEF = {1: ("producer", "int32"), 2: ("min_consumer", "int32")}
_BUNDLE_VERSION = 1  # kTensorBundleVersion
_MAX_SHARDS = 1 << 20


def _fail(message, path, key=None):
    suffix = f" (key {key!r})" if key is not None else ""
    return LegacyFormatError(f"{path}: {message}{suffix}", path=path, key=key)


def _bad_consumers(version_bytes, path):
    """The repeated int32 ``VersionDef.bad_consumers``, packed or not."""
    out = []
    for number, wire_type, value in wire.fields(version_bytes, path):
        if number != 3:
            continue
        if wire_type == wire.VARINT:
            out.append(wire._int32(value))
        elif wire_type == wire.LENGTH_DELIMITED:
            pos = 0
            while pos < len(value):
                v, pos = wire.read_varint(value, pos, path=path)
                out.append(wire._int32(v))
        else:
            raise wire._error(f"VersionDef.bad_consumers has wire type {wire_type}", path)
    return out


# ---------------------------------------------------------------------------
# The SSTable of the .index file.


def _read_block(data, handle, path, verify, what):
    """Contents of the block at BlockHandle ``(offset, size)``."""
    offset, size = handle
    limit = len(data) - _FOOTER_SIZE
    if offset > limit or size > limit - offset or _BLOCK_TRAILER_SIZE > limit - offset - size:
        raise _fail(
            f"{what} block (offset {offset}, size {size}) lies outside the "
            f"table ({len(data)} bytes)",
            path,
        )
    end = offset + size
    compression = data[end]
    if compression != 0:
        raise _fail(
            f"{what} block is compressed (type {compression}); TensorFlow "
            "writes tensor bundle index blocks uncompressed",
            path,
        )
    if verify:
        stored = int.from_bytes(data[end + 1 : end + 5], "little")
        actual = mask_crc(crc32c(data[offset : end + 1]))
        if stored != actual:
            raise _fail(f"{what} block checksum mismatch", path)
    return data[offset:end]


def _block_entries(block, path, what):
    """Iterate ``(key, value)`` over the entries of one block."""
    n = len(block)
    if n < 4:
        raise _fail(f"{what} block is too short ({n} bytes)", path)
    num_restarts = int.from_bytes(block[n - 4 :], "little")
    if num_restarts > (n - 4) // 4:
        raise _fail(f"{what} block has a bad restart count {num_restarts}", path)
    limit = n - 4 - 4 * num_restarts
    pos = 0
    prev = b""
    while pos < limit:  # every entry consumes at least 3 bytes
        shared, pos = wire.read_varint(block, pos, limit, 5, path)
        non_shared, pos = wire.read_varint(block, pos, limit, 5, path)
        value_length, pos = wire.read_varint(block, pos, limit, 5, path)
        if shared > len(prev):
            raise _fail(
                f"{what} block entry shares {shared} bytes with a "
                f"{len(prev)}-byte key",
                path,
            )
        if non_shared > limit - pos or value_length > limit - pos - non_shared:
            raise _fail(f"{what} block entry overruns the block", path)
        key = prev[:shared] + block[pos : pos + non_shared]
        pos += non_shared
        value = block[pos : pos + value_length]
        pos += value_length
        yield key, value
        prev = key


def _decode_handle(value, pos, end, path):
    offset, pos = wire.read_varint(value, pos, end, path=path)
    size, pos = wire.read_varint(value, pos, end, path=path)
    return (offset, size), pos


def read_table(data, path=None, verify_checksums=True):
    """Read every ``(key, value)`` of a LevelDB SSTable held in memory.

    Args:
        data: The whole table file (``bytes``).
        path: The file name, for error messages.
        verify_checksums: Check each block's masked crc32c.

    Returns:
        A list of ``(key: bytes, value: bytes)`` in file order (ascending).

    Raises:
        LegacyFormatError: Bad magic, truncation, a compressed block, a
            checksum mismatch, keys out of order.
    """
    if len(data) < _FOOTER_SIZE:
        raise _fail(
            f"too short for a table ({len(data)} bytes, the footer alone is "
            f"{_FOOTER_SIZE})",
            path,
        )
    footer = data[-_FOOTER_SIZE:]
    magic = int.from_bytes(footer[-8:], "little")
    if magic != _TABLE_MAGIC:
        raise _fail(
            f"bad table magic number {magic:#018x} (expected "
            f"{_TABLE_MAGIC:#018x}): not a tensor bundle index",
            path,
        )
    _metaindex, pos = _decode_handle(footer, 0, 40, path)
    index_handle, _ = _decode_handle(footer, pos, 40, path)
    index = _read_block(data, index_handle, path, verify_checksums, "index")
    entries = []
    prev = None
    for _, handle_bytes in _block_entries(index, path, "index"):
        handle, _ = _decode_handle(handle_bytes, 0, len(handle_bytes), path)
        block = _read_block(data, handle, path, verify_checksums, "data")
        for key, value in _block_entries(block, path, "data"):
            if prev is not None and key <= prev:
                raise _fail(f"table keys out of order at {key!r}", path)
            entries.append((key, value))
            prev = key
    return entries


_TENSOR_SLICE = {1: ("extent", "repeated")}
_TENSOR_SLICE_EXTENT = {1: ("start", "int64"), 2: ("length", "int64")}


def _parse_slice(data):
    """A ``TensorSliceProto`` as a tuple of ``(start, length or None)``."""
    raw = wire._message_fields(data, _TENSOR_SLICE, "TensorSliceProto")
    out = []
    for item in raw.get("extent", ()):
        extent = wire._message_fields(
            item, _TENSOR_SLICE_EXTENT, "TensorSliceProto.Extent"
        )
        out.append((extent.get("start", 0), extent.get("length")))
    return tuple(out)


def _slice_label(extents):
    return "[" + ", ".join(
        f"{start}:" if length is None else f"{start}:{start + length}"
        for start, length in extents
    ) + "]"


def _num_increasing(value):
    """OrderedCode::WriteNumIncreasing (an unsigned int)."""
    body = value.to_bytes((value.bit_length() + 7) // 8, "big")
    return bytes([len(body)]) + body


def _signed_num_increasing(value):
    """OrderedCode::WriteSignedNumIncreasing (a signed 64-bit int)."""
    magnitude = ~value if value < 0 else value
    n = (magnitude.bit_length() + 7) // 7
    body = bytearray((value & ((1 << (8 * n)) - 1)).to_bytes(n, "big"))
    if n <= 8:
        body[0] ^= (0xFF << (8 - n)) & 0xFF
    else:
        body[0] ^= 0xFF
        body[1] ^= 0x80 if n == 9 else 0xC0
    return bytes(body)


def _slice_key(name, starts, lengths):
    """TensorFlow's ``checkpoint::EncodeTensorNameSlice``: the index key of
    one slice of tensor ``name`` (``lengths`` -1 for a full extent)."""
    escaped = re.sub(
        rb"[\x00\xff]",
        lambda m: b"\x00\xff" if m.group() == b"\x00" else b"\xff\x00",
        name.encode("utf-8"),
    )
    out = [_num_increasing(0), escaped, b"\x00\x01", _num_increasing(len(starts))]
    for start, length in zip(starts, lengths):
        out.append(_signed_num_increasing(start))
        out.append(_signed_num_increasing(length))
    return b"".join(out)


# ---------------------------------------------------------------------------


class BundleReader:
    """Read the tensors of a TensorFlow checkpoint without TensorFlow.

    Args:
        prefix: The checkpoint prefix, e.g. ``".../ckpt-1"``,
            ``".../weights"`` (``save_weights``) or
            ``".../variables/variables"`` (SavedModel). Files
            ``<prefix>.index`` and ``<prefix>.data-SSSSS-of-NNNNN`` are read.
        verify_checksums: Check the index's block checksums and each
            tensor's crc32c when it is read (TensorFlow does both).

    The index is read and parsed on construction; data shards are opened
    only by :meth:`get_tensor`, so a missing shard is reported when a tensor
    in it is read.

    Raises:
        LegacyFormatError: On any failure, naming the file and key.

    Example (needs a checkpoint on disk, so it is not run as a test):

    ```
    reader = BundleReader("/tmp/ckpt/ckpt-1")
    for key in reader.keys():
        print(key, reader.dtype(key), reader.shape(key))
    graph = reader.object_graph()
    ```
    """

    def __init__(self, prefix, verify_checksums=True):
        self._prefix = os.fspath(prefix)
        self._verify = bool(verify_checksums)
        self._index_path = self._prefix + ".index"
        if os.path.isdir(self._prefix) and not os.path.exists(self._index_path):
            raise _fail(
                "is a directory, not a checkpoint prefix (pass e.g. "
                "'dir/ckpt-1' or 'savedmodel/variables/variables')",
                self._prefix,
            )
        try:
            with open(self._index_path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise _fail(
                f"cannot read checkpoint index ({e.strerror or e})",
                self._index_path,
            ) from None
        raw = {}
        slice_raw = {}
        header = None
        for key_bytes, value in read_table(data, self._index_path, self._verify):
            if key_bytes == b"":
                header = value
                continue
            if key_bytes[:1] == b"\x00":
                # The data of one slice of a sliced tensor, under
                # EncodeTensorNameSlice(name, slice); see _slice_key.
                slice_raw[key_bytes] = value
                continue
            try:
                key = key_bytes.decode("utf-8")
            except UnicodeDecodeError:
                raise _fail(
                    f"tensor key {key_bytes!r} is not valid UTF-8",
                    self._index_path,
                ) from None
            raw[key] = value
        if header is None:
            raise _fail("no bundle header (empty key) in the index", self._index_path)
        self._header = self._parse_header(header)
        self._raw = raw
        self._slice_raw = slice_raw
        self._entries = {}
        self._keys = sorted(raw)

    # -- header and entries -------------------------------------------------

    def _parse_header(self, value):
        path = self._index_path
        try:
            header = wire._message_fields(
                value, _BUNDLE_HEADER, "BundleHeaderProto"
            )
            version = header.get("version", b"")
            ver = wire._message_fields(version, _VERSION_DEF, "VersionDef")
            bad = _bad_consumers(version, None)
        except LegacyFormatError as e:
            raise _fail(f"bad bundle header: {e}", path, "") from None
        num_shards = header.get("num_shards", 0)
        if not 0 < num_shards <= _MAX_SHARDS:
            raise _fail(f"bad shard count {num_shards} in the bundle header", path, "")
        endianness = header.get("endianness", 0)
        if endianness != 0:
            raise _fail(
                "the bundle was written big-endian; only little-endian "
                "bundles can be read (as TensorFlow)",
                path,
                "",
            )
        min_consumer = ver.get("min_consumer", 0)
        if min_consumer > _BUNDLE_VERSION or _BUNDLE_VERSION in bad:
            raise _fail(
                f"bundle version (min_consumer {min_consumer}, bad_consumers "
                f"{bad}) cannot be read by a version-{_BUNDLE_VERSION} reader",
                path,
                "",
            )
        return {
            "num_shards": num_shards,
            "endianness": endianness,
            "producer": ver.get("producer", 0),
            "min_consumer": min_consumer,
        }

    def _missing(self, key):
        return _fail(
            f"no tensor {key!r} in the checkpoint ({len(self._keys)} keys)",
            self._index_path,
            key,
        )

    def _parse_entry(self, value, key):
        path = self._index_path
        try:
            raw = wire._message_fields(value, _BUNDLE_ENTRY, "BundleEntryProto")
            shape = wire.parse_tensor_shape(raw.get("shape", b""))
            slices = [
                _parse_slice(item) for item in raw.get("slices", ())
            ]
        except LegacyFormatError as e:
            raise _fail(f"bad bundle entry: {e}", path, key) from None
        if shape is None or any(d < 0 for d in shape):
            raise _fail(f"tensor shape {shape} is not fully defined", path, key)
        entry = {
            "dtype": raw.get("dtype", 0),
            "shape": shape,
            "shard_id": raw.get("shard_id", 0),
            "offset": raw.get("offset", 0),
            "size": raw.get("size", 0),
            "crc32c": raw.get("crc32c", 0),
            "slices": slices,
        }
        if not 0 <= entry["shard_id"] < self._header["num_shards"]:
            raise _fail(
                f"shard id {entry['shard_id']} out of range "
                f"(num_shards={self._header['num_shards']})",
                path,
                key,
            )
        if entry["offset"] < 0 or entry["size"] < 0:
            raise _fail(
                f"negative offset {entry['offset']} or size {entry['size']}",
                path,
                key,
            )
        return entry

    def entry(self, key):
        """The parsed ``BundleEntryProto`` of ``key``.

        Returns:
            ``{"dtype": int (DataType enum), "shape": tuple of ints,
            "shard_id": int, "offset": int, "size": int, "crc32c": int
            (masked, as stored), "slices": list}``. ``slices`` is empty
            unless the tensor was saved in slices (e.g. by a sharding
            policy); then it holds one tuple per slice with a
            ``(start, length)`` pair per dimension, ``length`` ``None``
            for the full extent.

        Raises:
            LegacyFormatError: Unknown key or a malformed entry.
        """
        cached = self._entries.get(key)
        if cached is not None:
            return cached
        if key not in self._raw:
            raise self._missing(key)
        entry = self._parse_entry(self._raw[key], key)
        self._entries[key] = entry
        return entry

    # -- public API ---------------------------------------------------------

    @property
    def prefix(self):
        """The checkpoint prefix (``str``)."""
        return self._prefix

    @property
    def num_shards(self):
        """The number of data shards named by the bundle header."""
        return self._header["num_shards"]

    def keys(self):
        """The tensor keys, sorted (the header's empty key and the keys of
        individual slices excluded, as TensorFlow's reader does)."""
        return list(self._keys)

    def __contains__(self, key):
        return key in self._raw

    def __len__(self):
        return len(self._keys)

    def shape(self, key):
        """The shape of tensor ``key`` as a tuple of ints (``()`` for a
        scalar)."""
        return self.entry(key)["shape"]

    def _numpy_dtype(self, enum, key):
        known = DTYPES.get(enum)
        if known is None:
            raise _fail(
                f"unsupported tensor dtype (DataType enum {enum})",
                self._index_path,
                key,
            )
        return known[1]

    def dtype(self, key):
        """The numpy dtype of tensor ``key``; ``object`` for strings,
        ``ml_dtypes.bfloat16`` for bfloat16.

        Raises:
            LegacyFormatError: Unknown key, or a dtype with no numpy
                equivalent (resource, variant, quantized types).
        """
        return self._numpy_dtype(self.entry(key)["dtype"], key)

    def _shard_path(self, shard_id):
        return f"{self._prefix}.data-{shard_id:05d}-of-{self.num_shards:05d}"

    def _check_extent(self, key, entry, dtype):
        """Check ``entry``'s size against its shape and its shard."""
        count = math.prod(entry["shape"])
        size = entry["size"]
        if dtype == object:
            if count > size:
                raise _fail(
                    f"{count} strings cannot fit in {size} bytes",
                    self._index_path,
                    key,
                )
        elif count * dtype.itemsize != size:
            raise _fail(
                f"size {size} does not match shape {entry['shape']} of "
                f"{dtype} ({count * dtype.itemsize} bytes)",
                self._index_path,
                key,
            )
        path = self._shard_path(entry["shard_id"])
        try:
            file_size = os.stat(path).st_size
        except OSError as e:
            raise _fail(f"cannot read data shard ({e.strerror or e})", path, key) from None
        offset = entry["offset"]
        if offset > file_size or size > file_size - offset:
            raise _fail(
                f"tensor bytes [{offset}, {offset + size}) lie beyond the end "
                f"of the data shard ({file_size} bytes)",
                path,
                key,
            )
        return count

    def _read_bytes(self, key, entry):
        path = self._shard_path(entry["shard_id"])
        size = entry["size"]
        try:
            with open(path, "rb") as f:
                f.seek(entry["offset"])
                buf = bytearray(size)
                got = f.readinto(buf)
        except OSError as e:
            raise _fail(f"cannot read data shard ({e.strerror or e})", path, key) from None
        if got != size:
            raise _fail(f"short read ({got} of {size} bytes)", path, key)
        return path, buf

    def _read_entry(self, key, entry, dtype):
        """Read, check and decode the (unsliced) tensor of ``entry``."""
        count = self._check_extent(key, entry, dtype)
        path, buf = self._read_bytes(key, entry)
        if dtype == object:
            return self._decode_strings(key, entry, path, buf, count)
        if self._verify:
            self._check_crc(key, entry, path, crc32c(buf))
        return np.frombuffer(buf, dtype=dtype).reshape(entry["shape"])

    def get_tensor(self, key):
        """Read tensor ``key``.

        Tensors saved in slices (by a sharding policy, possibly across
        several data shards) are assembled.

        Returns:
            A writable ``np.ndarray`` of :meth:`shape` and :meth:`dtype`
            (0-d for scalars). String tensors come back as an object array
            of ``bytes``.

        Raises:
            LegacyFormatError: Unknown key or dtype, a missing or short data
                shard, a size that does not match the shape, a crc32c
                mismatch, or slices that are missing or do not tile the
                tensor.
        """
        entry = self.entry(key)
        dtype = self.dtype(key)
        if entry["slices"]:
            return self._read_sliced(key, entry, dtype)
        return self._read_entry(key, entry, dtype)

    def _read_sliced(self, key, entry, dtype):
        shape = entry["shape"]
        path = self._index_path
        parts = []
        total = 0
        # First check every slice (bounds, entry, extent in its shard), so
        # that nothing is allocated for a tensor the files cannot hold.
        for extents in entry["slices"]:
            label = f"{key} slice {_slice_label(extents)}"
            if len(extents) != len(shape):
                raise _fail(
                    f"slice of rank {len(extents)} for a tensor of shape {shape}",
                    path,
                    label,
                )
            index, starts, lengths = [], [], []
            for (start, length), dim in zip(extents, shape):
                full = length is None
                stop = dim if full else start + length
                if start < 0 or (not full and length < 0) or stop > dim or start > stop:
                    raise _fail(f"slice out of bounds of shape {shape}", path, label)
                index.append(slice(start, stop))
                starts.append(start)
                lengths.append(-1 if full else length)
            encoded = _slice_key(key, starts, lengths)
            raw = self._slice_raw.get(encoded)
            if raw is None:
                raise _fail("the index has no entry for this slice", path, label)
            part = self._parse_entry(raw, label)
            expected = tuple(s.stop - s.start for s in index)
            if part["dtype"] != entry["dtype"] or part["shape"] != expected:
                raise _fail(
                    f"slice entry has dtype {part['dtype']} and shape "
                    f"{part['shape']}, expected {entry['dtype']} and {expected}",
                    path,
                    label,
                )
            if part["slices"]:
                raise _fail("a slice is itself sliced", path, label)
            total += self._check_extent(label, part, dtype)
            parts.append((label, part, tuple(index)))
        if total != math.prod(shape):
            raise _fail(
                f"the slices hold {total} elements, the tensor of shape "
                f"{shape} {math.prod(shape)}",
                path,
                key,
            )
        out = np.empty(shape, dtype=dtype)
        covered = np.zeros(shape, dtype=bool)
        for label, part, index in parts:
            if covered[index].any():
                raise _fail("slices overlap", path, label)
            out[index] = self._read_entry(label, part, dtype)
            covered[index] = True
        if not covered.all():
            raise _fail("the slices do not cover the tensor", path, key)
        return out

    def _check_crc(self, key, entry, path, crc):
        if mask_crc(crc) != entry["crc32c"]:
            raise _fail(
                f"crc32c mismatch (stored {entry['crc32c']:#010x}, computed "
                f"{mask_crc(crc):#010x}): the data shard is corrupt",
                path,
                key,
            )

    def _decode_strings(self, key, entry, path, buf, count):
        # [varint64 len]*count [masked crc32c of the lengths as uint32 (or
        # uint64 when > 2**32-1)] [bytes]*count. The entry's crc covers the
        # lengths in that fixed-width form, the length checksum and the
        # bytes.
        size = len(buf)
        data = bytes(buf)
        lengths = []
        pos = 0
        for _ in range(count):  # count <= size, checked by _check_extent
            try:
                n, pos = wire.read_varint(data, pos, size)
            except LegacyFormatError as e:
                raise _fail(f"bad string length: {e}", path, key) from None
            lengths.append(n)
        if pos + 4 > size:
            raise _fail("string tensor is truncated (no length checksum)", path, key)
        stored_length_crc = data[pos : pos + 4]
        pos += 4
        if sum(lengths) != size - pos:
            raise _fail(
                f"string lengths add up to {sum(lengths)} bytes but "
                f"{size - pos} remain",
                path,
                key,
            )
        if self._verify:
            fixed = b"".join(
                struct.pack("<I", n) if n <= _U32 else struct.pack("<Q", n)
                for n in lengths
            )
            crc = crc32c(fixed)
            if mask_crc(crc).to_bytes(4, "little") != stored_length_crc:
                raise _fail("string length checksum mismatch", path, key)
            crc = crc32c(stored_length_crc, crc)
            crc = crc32c(memoryview(data)[pos:], crc)
            self._check_crc(key, entry, path, crc)
        out = np.empty(count, dtype=object)
        for i, n in enumerate(lengths):
            out[i] = data[pos : pos + n]
            pos += n
        return out.reshape(entry["shape"])

    def object_graph(self):
        """The checkpoint's object graph.

        Returns:
            :func:`keras_ema_opt.savedmodel.wire.parse_trackable_object_graph`
            of the ``_CHECKPOINTABLE_OBJECT_GRAPH`` tensor: a list of node
            dicts indexed by node id.

        Raises:
            LegacyFormatError: Not an object-based checkpoint, or a corrupt
                graph.
        """
        if OBJECT_GRAPH_KEY not in self._raw:
            raise _fail(
                "not an object-based checkpoint (no "
                f"{OBJECT_GRAPH_KEY} tensor)",
                self._index_path,
                OBJECT_GRAPH_KEY,
            )
        value = self.get_tensor(OBJECT_GRAPH_KEY)
        if value.shape != ():
            raise _fail(
                f"object graph tensor has shape {value.shape}, expected a "
                "scalar string",
                self._index_path,
                OBJECT_GRAPH_KEY,
            )
        data = value.item()
        if not isinstance(data, bytes):
            raise _fail(
                "object graph tensor is not a string",
                self._index_path,
                OBJECT_GRAPH_KEY,
            )
        path = self._shard_path(self.entry(OBJECT_GRAPH_KEY)["shard_id"])
        try:
            return wire.parse_trackable_object_graph(data, path)
        except LegacyFormatError as e:
            raise LegacyFormatError(
                f"{e} (key {OBJECT_GRAPH_KEY!r})", path=path, key=OBJECT_GRAPH_KEY
            ) from None

    def __repr__(self):
        return f"BundleReader({self._prefix!r}, {len(self._keys)} tensors)"
