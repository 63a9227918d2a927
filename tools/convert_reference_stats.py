#!/usr/bin/env python3
"""Converts the TriAttention reference implementation's query statistics (a `torch.save`
`.pt` file) to triattn's `triattn.stats.v1` safetensors format.

Needs only Python 3 and NumPy: the `.pt` zip archive is read without PyTorch, through a
restricted unpickler that knows the handful of torch globals a tensor dict uses and refuses
every other one (the file is untrusted input; a plain `pickle.load` would run any code it
names).

The `.pt` file records neither the RoPE base, its scaling rule nor the KV-head count, so they
come as flags; the inverse frequencies are computed here, in float64, with Hugging Face's
formulas (the same as include/triattn/core/rope.hpp's `inv_freq`).

Example (Qwen3-8B):
  convert_reference_stats.py qwen3_8b.pt --rope-theta 1e6 --num-kv-heads 8 \\
      --model Qwen/Qwen3-8B --out qwen3_8b.safetensors

Errors print one line on stderr and exit with code 2.
"""

import argparse
import collections
import io
import json
import math
import os
import pickle
import re
import struct
import sys
import zipfile

FORMAT = "triattn.stats.v1"
TENSOR_FIELDS = ("q_mean_real", "q_mean_imag", "q_abs_mean")
HEAD_KEY = re.compile(r"layer(\d+)_head(\d+)")


class ConvertError(Exception):
    """A problem with the input or the flags, reported as one line."""


def import_numpy():
    try:
        import numpy  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ConvertError(
            f"NumPy is required ({sys.executable}: {e}); install python3-numpy or `pip install numpy`") from e
    return numpy


np = None  # set in main(): --help works without NumPy


# --- reading the .pt archive without PyTorch ------------------------------------------------

# torch storage class name -> little-endian NumPy dtype of its raw bytes. BFloat16 has no NumPy
# dtype: its raw uint16 patterns are widened to float32 below.
STORAGE_DTYPES = {
    "FloatStorage": "<f4",
    "DoubleStorage": "<f8",
    "HalfStorage": "<f2",
    "BFloat16Storage": "<u2",
}


class StorageType:
    """Stands for a torch storage class inside the unpickled data."""

    def __init__(self, name):
        self.name = name
        self.dtype = np.dtype(STORAGE_DTYPES[name])


class Storage:
    """A flat array read from `<archive>/data/<key>`."""

    def __init__(self, values):
        self.values = values


def is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                      metadata=None):
    """torch._utils._rebuild_tensor_v2, as a bounds-checked gather from the storage."""
    del requires_grad, backward_hooks, metadata  # autograd state, irrelevant here
    if not isinstance(storage, Storage):
        raise ConvertError("malformed pickle: a tensor does not refer to a storage")
    if not (is_int(storage_offset) and isinstance(size, tuple) and isinstance(stride, tuple)
            and len(size) == len(stride) and all(is_int(v) and v >= 0 for v in size + stride)
            and storage_offset >= 0):
        raise ConvertError(f"malformed tensor: offset {storage_offset!r}, size {size!r}, stride {stride!r}")
    # Bounds first, so that a hostile size cannot make the gather allocate without limit.
    if 0 not in size and storage_offset + sum((n - 1) * s for n, s in zip(size, stride)) >= storage.values.size:
        raise ConvertError(f"malformed tensor: size {list(size)} stride {list(stride)} offset {storage_offset} "
                           f"reaches past its storage of {storage.values.size} elements")
    index = np.full(size, storage_offset, dtype=np.int64)
    for axis, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[axis] = n
        index = index + (np.arange(n, dtype=np.int64) * s).reshape(shape)
    return storage.values[index]


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles a torch.save tensor dict; any global other than the allowed ones is refused."""

    def __init__(self, file, archive, prefix):
        super().__init__(file)
        self.archive = archive
        self.prefix = prefix
        self.storages = {}

    def find_class(self, module, name):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return rebuild_tensor_v2
        if module == "torch" and name in STORAGE_DTYPES:
            return StorageType(name)
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        raise ConvertError(f"refusing pickle global {module}.{name} (only torch tensors and plain data are allowed)")

    def persistent_load(self, pid):
        # torch.save's persistent id: ("storage", storage type, key, location, numel).
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], StorageType)
                and isinstance(pid[2], str) and is_int(pid[4]) and pid[4] >= 0):
            raise ConvertError(f"malformed pickle: unsupported persistent id {pid!r}")
        _, storage_type, key, _, numel = pid
        if key not in self.storages:
            member = f"{self.prefix}data/{key}"
            try:
                raw = self.archive.read(member)
            except KeyError as e:
                raise ConvertError(f"storage {member} is missing from the archive") from e
            need = numel * storage_type.dtype.itemsize
            if len(raw) < need:
                raise ConvertError(f"storage {member} holds {len(raw)} bytes, expected {need} "
                                   f"({numel} x {storage_type.name})")
            values = np.frombuffer(raw, dtype=storage_type.dtype, count=numel)
            if storage_type.name == "BFloat16Storage":
                values = (values.astype(np.uint32) << 16).view(np.float32)
            self.storages[key] = Storage(values)
        return self.storages[key]


def read_pt(path):
    """The object stored in a torch.save zip archive."""
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as e:
        raise ConvertError(f"cannot read {path} as a torch.save zip archive: {e}") from e
    with archive:
        pickles = [n for n in archive.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise ConvertError(f"{path} holds {len(pickles)} data.pkl entries, expected 1 (not a torch.save file?)")
        prefix = pickles[0][: -len("data.pkl")]
        if f"{prefix}byteorder" in archive.namelist():
            order = archive.read(f"{prefix}byteorder").decode("ascii", "replace").strip()
            if order != "little":
                raise ConvertError(f"{path} stores {order!r}-endian tensors; only little-endian is supported")
        try:
            return RestrictedUnpickler(io.BytesIO(archive.read(pickles[0])), archive, prefix).load()
        except ConvertError:
            raise
        except Exception as e:  # a corrupt pickle can raise nearly anything
            raise ConvertError(f"malformed pickle in {path}: {type(e).__name__}: {e}") from e


# --- RoPE inverse frequencies (Hugging Face's formulas, as rope.hpp) ------------------------

def inv_freq(args, dim):
    """w_f for f < dim/2, float64, one scalar at a time exactly as rope.hpp's inv_freq."""
    out = []
    for f in range(dim // 2):
        base = math.pow(args.rope_theta, -2.0 * f / dim)
        kind = args.rope_scaling
        if kind == "none":
            w = base
        elif kind == "linear":
            w = base / args.rope_factor
        elif kind == "llama3":
            wavelen = 2.0 * math.pi / base
            low_wavelen = args.original_max_position / args.low_freq_factor
            high_wavelen = args.original_max_position / args.high_freq_factor
            if wavelen > low_wavelen:
                w = base / args.rope_factor
            elif wavelen < high_wavelen:
                w = base
            else:
                smooth = (args.original_max_position / wavelen - args.low_freq_factor) / (
                    args.high_freq_factor - args.low_freq_factor)
                w = (1.0 - smooth) * base / args.rope_factor + smooth * base
        else:  # yarn
            def correction_dim(rotations):
                return (dim * math.log(args.original_max_position / (rotations * 2.0 * math.pi))) / (
                    2.0 * math.log(args.rope_theta))
            low, high = correction_dim(args.beta_fast), correction_dim(args.beta_slow)
            if not args.no_truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0.0), min(high, dim - 1)
            if low == high:
                high += 0.001  # as HF: avoids a division by zero
            ramp = min(max((f - low) / (high - low), 0.0), 1.0)
            extrapolation = 1.0 - ramp
            w = base / args.rope_factor * (1.0 - extrapolation) + base * extrapolation
        out.append(w)
    return np.array(out, dtype="<f8")


def attention_scale(args):
    if args.attention_scale is not None:
        return args.attention_scale
    if args.rope_scaling == "yarn" and args.rope_factor > 1.0:
        return 0.1 * math.log(args.rope_factor) + 1.0
    return 1.0


# --- the conversion --------------------------------------------------------------------------

def collect_stats(obj):
    """(metadata, q tensors [3][layers, q_heads, bands] float32, head_dim) from the .pt object."""
    if not (isinstance(obj, dict) and isinstance(obj.get("metadata"), dict) and isinstance(obj.get("stats"), dict)):
        raise ConvertError("the .pt file is not a reference stats dict with 'metadata' and 'stats'")
    metadata, stats = obj["metadata"], obj["stats"]
    if not stats:
        raise ConvertError("the .pt file holds no head statistics")
    heads = {}
    for key, entry in stats.items():
        m = HEAD_KEY.fullmatch(key) if isinstance(key, str) else None
        if m is None:
            raise ConvertError(f"unexpected stats key {key!r}; expected layerLL_headHH")
        if not isinstance(entry, dict):
            raise ConvertError(f"stats {key} is not a dict of tensors")
        heads[(int(m.group(1)), int(m.group(2)))] = (key, entry)
    num_layers = 1 + max(layer for layer, _ in heads)
    num_q_heads = 1 + max(head for _, head in heads)
    num_missing = num_layers * num_q_heads - len(heads)
    if num_missing:
        # Lazily: found within len(heads) + 1 steps even when a hostile key claims a huge index.
        layer, head = next((l, h) for l in range(num_layers) for h in range(num_q_heads) if (l, h) not in heads)
        raise ConvertError(f"{num_missing} of {num_layers} x {num_q_heads} (layer, q-head) statistics are missing, "
                           f"first layer{layer:02d}_head{head:02d}; every head of every layer is required")
    sampled = metadata.get("sampled_heads")
    if sampled is not None and (not isinstance(sampled, (list, tuple)) or sorted(
            tuple(p) if isinstance(p, (list, tuple)) else (p,) for p in sampled) != sorted(heads)):
        raise ConvertError("metadata sampled_heads does not list exactly the heads present in stats")

    def tensor(key, entry, name):
        t = entry.get(name)
        if not isinstance(t, np.ndarray):
            raise ConvertError(f"stats {key} has no tensor {name}")
        if t.ndim != 1:
            raise ConvertError(f"stats {key} {name} has shape {list(t.shape)}, expected [head_dim/2]")
        return t

    first_key, first_entry = heads[(0, 0)]
    num_bands = tensor(first_key, first_entry, TENSOR_FIELDS[0]).size
    if num_bands == 0:
        raise ConvertError(f"stats {first_key} {TENSOR_FIELDS[0]} is empty")
    out = {name: np.empty((num_layers, num_q_heads, num_bands), dtype=np.float32) for name in TENSOR_FIELDS}
    for (layer, head), (key, entry) in heads.items():
        for name in TENSOR_FIELDS:
            t = tensor(key, entry, name)
            if t.size != num_bands:
                raise ConvertError(f"stats {key} {name} has {t.size} bands, expected {num_bands} (from {first_key})")
            if not np.all(np.isfinite(t)):
                raise ConvertError(f"stats {key} {name} holds non-finite values")
            out[name][layer, head] = t
    # Some files (gpt-oss) also record the model's shape: it must agree with the tensors.
    for field, value in (("head_dim", 2 * num_bands), ("num_layers", num_layers),
                         ("num_attention_heads", num_q_heads)):
        if metadata.get(field) is not None and metadata[field] != value:
            raise ConvertError(f"metadata {field} {metadata[field]!r} != {value} found in the tensors")
    return metadata, out, 2 * num_bands


# Element sizes in include/triattn/io/safetensors.hpp's order (increasing alignment); the
# writer lays tensors out by descending position here, then by name, as the C++ writer does.
SAFETENSORS_DTYPES = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
                      "F64", "I64", "U64")


def safetensors_bytes(tensors, metadata):
    """A safetensors file laid out as triattn's C++ writer does (the same bytes for the same
    input): compact JSON with the metadata (sorted) first and the tensors in buffer order;
    tensors by descending element alignment, then name, gap-free, so each is aligned to its
    element size; the header padded with spaces to a multiple of 8 bytes.
    `tensors`: name -> (dtype, little-endian ndarray)."""
    header = {"__metadata__": dict(sorted(metadata.items()))}
    data = bytearray()
    for name in sorted(tensors, key=lambda n: (-SAFETENSORS_DTYPES.index(tensors[n][0]), n)):
        dtype, array = tensors[name]
        raw = array.tobytes(order="C")
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data.extend(raw)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + bytes(data)


def decimal(x):
    """Shortest round-trip decimal, as C++'s std::to_chars writes it in the range used here."""
    text = repr(float(x))
    return text[:-2] if text.endswith(".0") else text


def convert(args):
    metadata, q, head_dim = collect_stats(read_pt(args.input))
    num_layers, num_q_heads, _ = q["q_mean_real"].shape
    if args.layers is not None:  # a subset, in the order given (parity cases use a few layers)
        bad = [layer for layer in args.layers if layer >= num_layers]
        if bad:
            raise ConvertError(f"--layers {bad[0]} is out of range: the stats hold {num_layers} layers")
        q = {name: value[args.layers] for name, value in q.items()}
        num_layers = len(args.layers)
    style = metadata.get("rope_style")
    if style not in ("half", "interleaved"):
        raise ConvertError(f"metadata rope_style {style!r} is not 'half' or 'interleaved'")
    if metadata.get("num_kv_heads") is not None and metadata["num_kv_heads"] != args.num_kv_heads:
        raise ConvertError(f"--num-kv-heads {args.num_kv_heads} != metadata num_kv_heads {metadata['num_kv_heads']!r}")
    if num_q_heads % args.num_kv_heads != 0:
        raise ConvertError(f"{num_q_heads} q-heads are not a multiple of --num-kv-heads {args.num_kv_heads}")
    scale = attention_scale(args)
    out_meta = {
        "format": FORMAT,
        "rope_style": style,
        "num_kv_heads": str(args.num_kv_heads),
        "attention_scale": decimal(scale),
        "source": os.path.basename(args.input),
    }
    model = args.model if args.model is not None else metadata.get("model_name")
    if model is not None:
        out_meta["model"] = str(model)
    if args.layers is not None:
        out_meta["layers"] = ",".join(str(layer) for layer in args.layers)
    if is_int(metadata.get("num_traces")):
        out_meta["num_traces"] = str(metadata["num_traces"])
    tensors = {name: ("F32", q[name].astype("<f4")) for name in TENSOR_FIELDS}
    tensors["inv_freq"] = ("F64", inv_freq(args, head_dim))
    blob = safetensors_bytes(tensors, out_meta)
    # Through a temporary file and a rename, so that a failed write leaves no partial file.
    tmp = f"{args.out}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, args.out)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise ConvertError(f"cannot write {args.out}: {e.strerror}") from e
    return num_layers, num_q_heads, head_dim


def layer_list(text):
    try:
        layers = [int(x) for x in text.split(",")]
    except ValueError:
        layers = []
    if not layers or min(layers) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer indices")
    return layers


def positive(kind):
    def parse(text):
        try:
            v = kind(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from e
        if not (v > 0 and math.isfinite(v)):
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0" + (" and finite" if kind is float else ""))
        return v
    return parse


class OneLineParser(argparse.ArgumentParser):
    """Reports a usage error as one line (exit code 2), like every other error."""

    def error(self, message):
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv):
    p = OneLineParser(
        prog="convert_reference_stats.py",
        description="Convert TriAttention reference query statistics (.pt) to triattn.stats.v1 safetensors. "
                    "Needs Python 3 and NumPy only (no PyTorch).",
        epilog="RoPE flags follow the model's Hugging Face config (rope_theta, rope_scaling.*). "
               "Qwen3-8B: --rope-theta 1e6 --num-kv-heads 8. DeepSeek-R1-Distill-Llama-8B: --rope-theta 500000 "
               "--rope-scaling llama3 --rope-factor 8 --low-freq-factor 1 --high-freq-factor 4 "
               "--original-max-position 8192 --num-kv-heads 8. Errors exit with code 2.")
    p.add_argument("input", help="the reference .pt stats file")
    p.add_argument("--out", required=True, help="the .safetensors file to write")
    p.add_argument("--num-kv-heads", type=positive(int), required=True, help="KV heads of the model (GQA)")
    p.add_argument("--rope-theta", type=positive(float), default=10000.0, help="RoPE base (default 10000)")
    p.add_argument("--rope-scaling", choices=("none", "linear", "llama3", "yarn"), default="none",
                   help="rope_scaling.rope_type (default none)")
    p.add_argument("--rope-factor", type=positive(float), default=1.0, help="linear/llama3/yarn factor")
    p.add_argument("--low-freq-factor", type=positive(float), default=1.0, help="llama3 (default 1)")
    p.add_argument("--high-freq-factor", type=positive(float), default=4.0, help="llama3 (default 4)")
    p.add_argument("--original-max-position", type=positive(float), default=8192.0,
                   help="llama3/yarn original_max_position_embeddings (default 8192)")
    p.add_argument("--beta-fast", type=positive(float), default=32.0, help="yarn (default 32)")
    p.add_argument("--beta-slow", type=positive(float), default=1.0, help="yarn (default 1)")
    p.add_argument("--no-truncate", action="store_true", help="yarn truncate=false (gpt-oss)")
    p.add_argument("--attention-scale", type=positive(float), default=None,
                   help="RoPE attention scaling a (default 1; yarn: 0.1 ln(factor) + 1)")
    p.add_argument("--model", help="model name for the metadata (default: the .pt's model_name)")
    p.add_argument("--layers", type=layer_list, default=None,
                   help="comma-separated layers to keep, in this order (default: all)")
    args = p.parse_args(argv)
    if args.rope_scaling == "llama3" and args.high_freq_factor == args.low_freq_factor:
        p.error("--high-freq-factor must differ from --low-freq-factor")
    return args


def main(argv=None):
    global np  # pylint: disable=global-statement
    args = parse_args(argv)
    try:
        np = import_numpy()
        layers, q_heads, head_dim = convert(args)
    except ConvertError as e:
        print(f"convert_reference_stats.py: error: {args.input}: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {layers} layers x {q_heads} q-heads ({args.num_kv_heads} kv-heads), head_dim {head_dim}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
