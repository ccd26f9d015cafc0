"""Reading a GGUF file's header with every count, length and offset checked against the file's size.

A GGUF file is: magic ``GGUF``, u32 version (2 or 3), u64 tensor count, u64 metadata (KV) count, the KV
pairs, one info record per tensor (name, dims, ggml type, data offset), padding to ``general.alignment``,
then the tensor data. Source: ggml's ``docs/gguf.md`` and llama.cpp's ``ggml/src/gguf.cpp`` reader.

Nothing here allocates more than the header itself holds: a count or length that could not fit in the
rest of the file is refused before it is used, so a corrupt or hostile header ends in one
:class:`ModelLoadError` line instead of a hang, an exhausted memory or (once handed to llama.cpp) a crash.
Tensor data is never read here; the loaders map it once the header has passed.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from zoomr.backends.models import ModelLoadError, model_warning, short_repr

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS: ggml tensors have at most four dimensions
MAX_KEY_BYTES = 65535  # gguf.md: keys are at most 2^16 - 1 bytes

# GGUF value types (gguf.md "gguf_metadata_value_type") → struct format of one scalar; 8 string, 9 array
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
INT_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
FLOAT_TYPES = frozenset({6, 12})
TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
              8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
# the smallest encodings, to bound counts by the bytes left: a KV is a key length (8), a type (4) and at
# least one value byte; a tensor info is a name length (8), n_dims (4), a type (4) and an offset (8)
_MIN_KV_BYTES = 13
_MIN_TENSOR_INFO_BYTES = 24


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array: its element type (GGUF type id), length, and the values of a numeric array.

    Attributes:
        item_type: GGUF value type of the elements (8 = string).
        count: number of elements.
        values: the elements of a numeric or bool array; None for a string array (never decoded here).
    """

    item_type: int
    count: int
    values: tuple | None = None


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's record.

    Attributes:
        name: tensor name (``blk.0.attn_q.weight`` ...).
        ggml_type: ggml type of the data (F32, Q4_1 ...).
        ne: dimensions in ggml order, fastest-varying first (reversed numpy/torch order).
        offset: absolute byte offset of the data in the file.
        n_bytes: size of the data (bytes).
    """

    name: str
    ggml_type: GGMLQuantizationType
    ne: tuple[int, ...]
    offset: int
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Dimensions in numpy/torch order (slowest first)."""
        return tuple(reversed(self.ne))


@dataclass
class GGUFHeader:
    """Everything before a GGUF file's tensor data, checked.

    Attributes:
        path: the file.
        version: GGUF version.
        fields: metadata values by key (int, float, bool, str or :class:`GGUFArray`).
        types: GGUF value type of each key.
        tensors: tensor records in file order.
        file_size: bytes.
        data_start: absolute offset of the tensor data section (the end of the tensor records, aligned).
    """

    path: Path
    version: int
    fields: dict[str, object] = field(default_factory=dict)
    types: dict[str, int] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    file_size: int = 0
    data_start: int = 0

    def get(self, key: str, default=None):
        """The value of metadata ``key``, or ``default`` when the file does not have it."""
        return self.fields.get(key, default)

    @property
    def arch(self) -> str | None:
        """``general.architecture`` when it is a string, else None."""
        arch = self.fields.get("general.architecture")
        return arch if isinstance(arch, str) else None


class _Cursor:
    """Reads little-endian values from a mapped file, refusing any read past its end."""

    def __init__(self, buf, path: Path):
        self.buf, self.size, self.pos, self.path = buf, len(buf), 0, path

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: {what}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"truncated GGUF header: {what} at byte {self.pos} needs {n} bytes, "
                            f"the file has {self.size - self.pos} left")

    def scalar(self, fmt: str, what: str):
        n = struct.calcsize("<" + fmt)
        self.need(n, what)
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.scalar("Q", f"length of {what}")
        if limit is not None and n > limit:
            raise self.fail(f"{what} at byte {self.pos - 8} claims {n} bytes (at most {limit} allowed)")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {self.pos - n} is not valid UTF-8") from None

    def skip_string(self, what: str) -> None:
        n = self.scalar("Q", f"length of {what}")
        self.need(n, what)
        self.pos += n


def read_header(path: Path) -> GGUFHeader:
    """Parse and check the header of the GGUF file at ``path`` (tensor data is not read).

    Checks: magic and version; KV and tensor counts that fit in the file; every string and array
    inside the file; no nested arrays, duplicate keys or duplicate tensor names; ``general.alignment``
    a power of two; per tensor 1..4 dimensions, a known ggml type, a row length that is a multiple of
    the type's block, an aligned offset and data that ends inside the file.

    Raises:
        ModelLoadError: the first check that fails, as one line naming the file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise ModelLoadError(f"{path}: not a GGUF file ({size} bytes)")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        return _parse(_Cursor(buf, path))
    finally:
        buf.close()


def _parse(cur: _Cursor) -> GGUFHeader:
    if bytes(cur.buf[:4]) != MAGIC:
        raise cur.fail("not a GGUF file (no GGUF magic)")
    cur.pos = 4
    version = cur.scalar("I", "version")
    if version not in VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        hint = " (a big-endian file?)" if swapped in VERSIONS else ""
        raise cur.fail(f"GGUF version {version} is not supported (supported: 2, 3){hint}")
    n_tensors = cur.scalar("Q", "tensor count")
    n_kv = cur.scalar("Q", "metadata count")
    left = cur.size - cur.pos
    if n_kv > left // _MIN_KV_BYTES:
        raise cur.fail(f"GGUF header claims {n_kv} metadata entries, more than a file of {cur.size} bytes can hold")
    if n_tensors > left // _MIN_TENSOR_INFO_BYTES:
        raise cur.fail(f"GGUF header claims {n_tensors} tensors, more than a file of {cur.size} bytes can hold")
    head = GGUFHeader(cur.path, version, file_size=cur.size)
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}", MAX_KEY_BYTES)
        shown = shown_name(key)
        if key in head.fields:
            raise cur.fail(f"GGUF metadata key {shown!r} appears twice")
        vtype = cur.scalar("I", f"type of {shown}")
        head.fields[key] = _value(cur, vtype, shown, nested=False)
        head.types[key] = vtype
    alignment = _alignment(cur, head)
    infos = []
    names = set()
    for i in range(n_tensors):
        name = cur.string(f"name of tensor #{i}", MAX_KEY_BYTES)
        if name in names:
            raise cur.fail(f"tensor {shown_name(name)} appears twice")
        names.add(name)
        name_shown = shown_name(name)
        n_dims = cur.scalar("I", f"dimension count of {name_shown}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name_shown} has {n_dims} dimensions (ggml allows 1 to {MAX_DIMS})")
        ne = tuple(cur.scalar("Q", f"dimensions of {name_shown}") for _ in range(n_dims))
        raw_type = cur.scalar("I", f"type of {name_shown}")
        rel = cur.scalar("Q", f"data offset of {name_shown}")
        infos.append((name, ne, raw_type, rel))
    data_start = head.data_start = -(-cur.pos // alignment) * alignment
    for name, ne, raw_type, rel in infos:
        head.tensors.append(_tensor(cur, name, ne, raw_type, rel, data_start, alignment))
    return head


def shown_name(name: str, limit: int = 80) -> str:
    """A key or tensor name as messages show it: names may be 64 KiB long and hold control characters
    (a newline), one error line may not."""
    if not name.isprintable():
        name = name.encode("unicode_escape").decode("ascii")
    return name if len(name) <= limit else name[:limit - 3] + "..."


def _value(cur: _Cursor, vtype: int, key: str, nested: bool):
    if vtype in _SCALAR:
        return cur.scalar(_SCALAR[vtype], f"value of {key}")
    if vtype == STRING:
        return cur.string(f"value of {key}")
    if vtype != ARRAY:
        raise cur.fail(f"GGUF metadata {key} has unknown value type {vtype}")
    if nested:  # llama.cpp's reader refuses arrays of arrays too
        raise cur.fail(f"GGUF metadata {key} is an array of arrays")
    item = cur.scalar("I", f"element type of {key}")
    count = cur.scalar("Q", f"length of {key}")
    if item == STRING:
        if count > (cur.size - cur.pos) // 8:
            raise cur.fail(f"GGUF metadata {key} claims {count} strings, more than the file can hold")
        for _ in range(count):
            cur.skip_string(f"element of {key}")
        return GGUFArray(item, count)
    if item not in _SCALAR:
        raise cur.fail(f"GGUF metadata {key} is an array of " +
                       ("arrays" if item == ARRAY else f"unknown type {item}"))
    fmt = _SCALAR[item]
    width = struct.calcsize(fmt)
    if count > (cur.size - cur.pos) // width:
        raise cur.fail(f"GGUF metadata {key} claims {count} elements, more than the file can hold")
    values = struct.unpack_from(f"<{count}{fmt}", cur.buf, cur.pos)
    cur.pos += count * width
    return GGUFArray(item, count, values)


def _alignment(cur: _Cursor, head: GGUFHeader) -> int:
    if "general.alignment" not in head.fields:
        return DEFAULT_ALIGNMENT
    a = head.fields["general.alignment"]
    if head.types["general.alignment"] != 4 or a == 0 or a & (a - 1):
        raise cur.fail(f"general.alignment {short_repr(a)} is not a power of two stored as uint32")
    return a


def _tensor(cur: _Cursor, name: str, ne: tuple, raw_type: int, rel: int, data_start: int,
            alignment: int) -> TensorInfo:
    info_name, name = name, shown_name(name)
    try:
        qtype = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise cur.fail(f"tensor {name} has unknown ggml type {raw_type}") from None
    if ne[0] % block:
        raise cur.fail(f"tensor {name}: row of {ne[0]} elements is not a multiple of the {qtype.name} "
                       f"block ({block})")
    n_elems = 1
    for d in ne:  # Python ints: a product that would overflow 64 bits is simply too large below
        n_elems *= d
    n_bytes = n_elems // block * type_size
    if rel % alignment:
        raise cur.fail(f"tensor {name}: data offset {rel} is not a multiple of the alignment {alignment}")
    start = data_start + rel
    if start + n_bytes > cur.size:
        raise cur.fail(f"truncated GGUF file: tensor {name} ({'x'.join(map(str, ne))} {qtype.name}) ends at "
                       f"byte {start + n_bytes}, the file has {cur.size} bytes")
    return TensorInfo(info_name, qtype, ne, start, n_bytes)


# --- metadata: what the model needs -------------------------------------------------------------

# Architectures whose hyperparameters zoomr checks (the ones its torch backend implements); llama.cpp
# alone checks the others.
CHECKED_ARCHS = ("llama", "qwen2")
# Keys llama.cpp's loader requires of both (llama-model.cpp, load_hparams: get_key without
# required=false), plus sizes it reads as optional but cannot build these models without.
REQUIRED_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length",
                 "attention.head_count", "attention.layer_norm_rms_epsilon")
# llama.cpp assumes a RoPE base of 10000 when the key is absent. For llama that is the Llama 1/2 value,
# which old conversions relied on, so it is taken with a warning; no Qwen2 was trained with it (they use
# 1e6), so a qwen2 file without the key is refused rather than run with wrong logits.
ROPE_BASE_DEFAULTS = {"llama": 10000.0}
# The RoPE scalings llama.cpp knows (llama_rope_scaling_type names); it aborts the process on any other.
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
# Keys that may hold one value per layer (llama.cpp get_key_or_arr).
PER_LAYER_KEYS = ("feed_forward_length", "attention.head_count", "attention.head_count_kv")
# LLAMA_MAX_LAYERS (llama-hparams.h): llama.cpp aborts on a block count of 0 or above it, any architecture.
MAX_LAYERS = 512


def check_gguf(path: Path) -> GGUFHeader:
    """:func:`read_header` and :func:`check_metadata`: what a GGUF file must pass before a loader sees it.

    Raises:
        ModelLoadError: the first check that fails, as one line naming the file and the field.
    """
    head = read_header(path)
    check_metadata(head)
    return head


def check_metadata(head: GGUFHeader) -> None:
    """Check the metadata a loader will read. For every architecture: the tokenizer arrays llama.cpp
    indexes without bounds checks, and the values it asserts on (block count, experts, RoPE scaling
    name), whose failure would abort the process. For :data:`CHECKED_ARCHS` also every required size,
    its type and sign, and the RoPE base.

    Prints one warning line (:func:`zoomr.backends.models.model_warning`) per documented default taken.

    Raises:
        ModelLoadError: a missing or ill-typed key, a size that is not positive, arrays that disagree.
    """
    fail = _failer(head)
    arch = head.get("general.architecture")
    if arch is None:
        raise fail("GGUF metadata lacks general.architecture")
    if not isinstance(arch, str) or not arch:
        raise fail("GGUF metadata general.architecture is not a string")
    _check_tokenizer(head, fail)
    _check_llamacpp_asserts(head, arch, fail)
    scaling = head.get(f"{arch}.rope.scaling.type")
    if scaling is not None and scaling not in ROPE_SCALING_TYPES:
        raise fail(f"GGUF metadata {shown_name(arch)}.rope.scaling.type is {short_repr(scaling)} "
                   f"(known: {', '.join(ROPE_SCALING_TYPES)})")
    if arch not in CHECKED_ARCHS:
        return
    for key in REQUIRED_KEYS:
        if f"{arch}.{key}" not in head.fields:
            raise fail(f"GGUF metadata lacks {arch}.{key}")
    for key in ("context_length", "embedding_length", "block_count", "attention.key_length",
                "attention.value_length", "rope.dimension_count", "vocab_size") + PER_LAYER_KEYS:
        gguf_int(head, f"{arch}.{key}", per_layer=key in PER_LAYER_KEYS)
    for key in ("attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor"):
        gguf_float(head, f"{arch}.{key}")
    if gguf_float(head, f"{arch}.rope.freq_base", 1.0) == 0:
        raise fail(f"GGUF metadata {arch}.rope.freq_base is 0, expected a RoPE base > 0")
    n_layers = gguf_int(head, f"{arch}.block_count")
    if n_layers > len(head.tensors):  # every block has tensors of its own: a larger count is corrupt
        raise fail(f"GGUF metadata {arch}.block_count is {n_layers}, but the file holds {len(head.tensors)} tensors")
    if f"{arch}.rope.freq_base" not in head.fields:
        if arch not in ROPE_BASE_DEFAULTS:
            raise fail(f"GGUF metadata lacks {arch}.rope.freq_base")
        model_warning(f"{head.path}: GGUF metadata lacks {arch}.rope.freq_base; assuming "
                      f"{ROPE_BASE_DEFAULTS[arch]:g} as llama.cpp does (right for Llama 1/2, wrong for models "
                      "trained with another base)")


def _check_llamacpp_asserts(head: GGUFHeader, arch: str, fail) -> None:
    """Values llama.cpp's ``load_hparams`` checks with GGML_ASSERT, which aborts the whole process:
    the block count, and how many experts are used against how many there are."""
    a = shown_name(arch)
    n_layers = head.get(f"{arch}.block_count")
    if n_layers is not None and (head.types[f"{arch}.block_count"] not in INT_TYPES
                                 or not 1 <= n_layers <= MAX_LAYERS):
        raise fail(f"GGUF metadata {a}.block_count is {short_repr(n_layers)}, expected an integer from 1 to "
                   f"{MAX_LAYERS}")
    counts = {}
    for key in ("expert_count", "expert_used_count", "expert_group_count", "expert_group_used_count"):
        v = head.get(f"{arch}.{key}", 0)
        if f"{arch}.{key}" in head.fields and head.types[f"{arch}.{key}"] not in INT_TYPES:
            raise fail(f"GGUF metadata {a}.{key} is {_kind(head, f'{arch}.{key}')}, expected an integer")
        counts[key] = v
    n, used, groups, groups_used = counts.values()
    for key, v in (("expert_used_count", used), ("expert_group_count", groups)):
        if n == 0 and v:
            raise fail(f"GGUF metadata {a}.{key} is {v}, but the model has no experts ({a}.expert_count 0)")
    if n and not 0 < used <= n:
        raise fail(f"GGUF metadata {a}.expert_used_count is {used}, expected 1 to expert_count {n}")
    if n and groups and (groups >= n or (groups > 1 and (n % groups or not 0 < groups_used < groups))):
        raise fail(f"GGUF metadata {a}.expert_group_count {groups} / expert_group_used_count {groups_used} do not "
                   f"fit {n} experts")


def gguf_int(head: GGUFHeader, key: str, default=None, per_layer: bool = False):
    """A positive integer of the metadata (a tuple of them when ``per_layer`` and the file stores an array).

    Raises:
        ModelLoadError: the value is not an integer (or integer array of the right kind), or not >= 1.
    """
    if key not in head.fields:
        return default
    v, t = head.fields[key], head.types[key]
    if per_layer and isinstance(v, GGUFArray) and v.item_type in INT_TYPES:
        values = v.values
    elif t in INT_TYPES:
        values = (v,)
    else:
        raise _failer(head)(f"GGUF metadata {key} is {_kind(head, key)}, expected an integer")
    if not values or min(values) < 1:
        raise _failer(head)(f"GGUF metadata {key} is {short_repr(v if t != ARRAY else list(values))}, expected >= 1")
    return values if isinstance(v, GGUFArray) else v


def gguf_float(head: GGUFHeader, key: str, default=None) -> float | None:
    """A finite, non-negative number of the metadata (float or integer types).

    Raises:
        ModelLoadError: the value is not a number, or is negative, infinite or NaN.
    """
    if key not in head.fields:
        return default
    v, t = head.fields[key], head.types[key]
    if t not in FLOAT_TYPES | INT_TYPES:
        raise _failer(head)(f"GGUF metadata {key} is {_kind(head, key)}, expected a number")
    if not 0 <= v < float("inf"):  # NaN fails too
        raise _failer(head)(f"GGUF metadata {key} is {v}, expected a finite number >= 0")
    return float(v)


def _check_tokenizer(head: GGUFHeader, fail) -> None:
    """llama.cpp reads ``scores[i]`` and ``token_type[i]`` for every token id without checking either
    array's length or element type: arrays that do not match the token list would be read out of bounds."""
    tokens = head.get("tokenizer.ggml.tokens")
    if tokens is None:
        return
    if not isinstance(tokens, GGUFArray) or tokens.item_type != STRING:
        raise fail(f"GGUF metadata tokenizer.ggml.tokens is {_kind(head, 'tokenizer.ggml.tokens')}, "
                   "expected an array of strings")
    for key, item in (("tokenizer.ggml.scores", 6), ("tokenizer.ggml.token_type", 5), ("tokenizer.ggml.merges", 8)):
        arr = head.get(key)
        if arr is None:
            continue
        if not isinstance(arr, GGUFArray) or arr.item_type != item:
            raise fail(f"GGUF metadata {key} is {_kind(head, key)}, expected an array of {TYPE_NAMES[item]}")
        if key != "tokenizer.ggml.merges" and arr.count != tokens.count:
            raise fail(f"GGUF metadata {key} has {arr.count} entries for {tokens.count} tokens")


def _kind(head: GGUFHeader, key: str) -> str:
    v, t = head.fields[key], head.types[key]
    if isinstance(v, GGUFArray):
        return f"an array of {TYPE_NAMES.get(v.item_type, v.item_type)}"
    return f"a {TYPE_NAMES[t]}"


def _failer(head: GGUFHeader):
    return lambda what: ModelLoadError(f"{head.path}: {what}")
