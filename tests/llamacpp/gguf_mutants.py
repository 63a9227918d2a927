"""Hostile GGUF files made from a real one (issue 40): a reader and writer of the GGUF format in
Python's standard library, and the mutants the loaders must refuse.

A GGUF file is a header (magic "GGUF", version, tensor count, key count), the metadata keys
(name, type, value), the tensor directory (name, dims, type, offset into the data) and, at the
file's alignment, the tensor data. `parse` reads the first three; `write` writes them back with
the data section copied unchanged, so a mutant differs from the model in exactly what its
mutation changed. `MUTANTS` lists (name, what it breaks, function of a parsed file returning
the mutant's bytes); `python3 gguf_mutants.py MODEL.gguf OUT_DIR` writes them all.
"""
import copy
import math
import struct
import sys

# GGUF value types (ggml/include/gguf.h).
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
          I64: "<q", F64: "<d"}


class reader:
    def __init__(self, data):
        self.data, self.at = data, 0

    def take(self, fmt):
        v = struct.unpack_from(fmt, self.data, self.at)[0]
        self.at += struct.calcsize(fmt)
        return v

    def string(self):
        n = self.take("<Q")
        s = self.data[self.at:self.at + n]
        self.at += n
        return s

    def value(self, t):
        if t == STRING:
            return self.string()
        if t == ARRAY:
            et, n = self.take("<I"), self.take("<Q")
            return (et, [self.value(et) for _ in range(n)])
        return self.take(SCALAR[t])


class gguf:
    """The parsed header of a GGUF file: `kv` {name: [type, value]} in file order, `tensors`
    [[name, dims, type, offset]], and the bytes of the data section."""

    def __init__(self, data):
        r = reader(data)
        if data[:4] != b"GGUF":
            raise ValueError("not a GGUF file")
        r.at = 4
        self.version = r.take("<I")
        n_tensors, n_kv = r.take("<Q"), r.take("<Q")
        self.kv = {}
        for _ in range(n_kv):
            name = r.string().decode()
            t = r.take("<I")
            self.kv[name] = [t, r.value(t)]
        self.tensors = []
        for _ in range(n_tensors):
            name = r.string().decode()
            dims = [r.take("<Q") for _ in range(r.take("<I"))]
            self.tensors.append([name, dims, r.take("<I"), r.take("<Q")])
        align = self.alignment()
        self.data = data[(r.at + align - 1) // align * align:]

    def alignment(self):
        return self.kv["general.alignment"][1] if "general.alignment" in self.kv else 32

    def arch(self):
        return self.kv["general.architecture"][1].decode()

    def tensor(self, name):
        return next(t for t in self.tensors if t[0] == name)

    def header(self, n_tensors=None, n_kv=None):
        out = bytearray(b"GGUF" + struct.pack("<IQQ", self.version, len(self.tensors) if n_tensors is None else n_tensors,
                                              len(self.kv) if n_kv is None else n_kv))
        for name, (t, v) in self.kv.items():
            out += pack_string(name.encode()) + struct.pack("<I", t) + pack_value(t, v)
        for name, dims, t, offset in self.tensors:
            out += pack_string(name.encode()) + struct.pack("<I", len(dims))
            out += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", t, offset)
        return out

    def write(self, **counts):
        out = self.header(**counts)
        align = self.alignment()
        out += b"\0" * (-len(out) % align)
        return bytes(out) + self.data


def pack_string(s):
    return struct.pack("<Q", len(s)) + s


def pack_value(t, v):
    if t == STRING:
        return pack_string(v)
    if t == ARRAY:
        et, items = v
        return struct.pack("<IQ", et, len(items)) + b"".join(pack_value(et, x) for x in items)
    return struct.pack(SCALAR[t], v)


def with_kvs(values):
    """The model with each metadata key of `values` ({key: (type, value)}; a key starting with
    '.' is the architecture's own) set."""
    def make(g):
        m = copy.copy(g)
        m.kv = dict(g.kv)
        for key, (t, v) in values.items():
            m.kv[g.arch() + key if key.startswith(".") else key] = [t, v]
        return m.write()
    return make


def with_kv(key, t, v):
    return with_kvs({key: (t, v)})


def tokens_resized(delta):
    def make(g):
        m = copy.copy(g)
        m.kv = dict(g.kv)
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            if key in g.kv:
                et, items = g.kv[key][1]
                n = max(0, len(items) + delta)
                fillers = [{STRING: b"<extra_%d>" % i, F32: 0.0}.get(et, 1) for i in range(max(0, delta))]
                m.kv[key] = [ARRAY, (et, (items + fillers)[:n])]
        return m.write()
    return make


def tokens_duplicated(g):
    """Token 1000 spelled as token 999."""
    m = copy.copy(g)
    m.kv = dict(g.kv)
    et, items = g.kv["tokenizer.ggml.tokens"][1]
    m.kv["tokenizer.ggml.tokens"] = [ARRAY, (et, items[:1000] + [items[999]] + items[1001:])]
    return m.write()


def tensor_changed(name, dims=None, kind=None, offset=None):
    def make(g):
        m = copy.copy(g)
        m.tensors = [list(t) for t in g.tensors]
        t = next(t for t in m.tensors if t[0] == name)
        if dims is not None:
            t[1] = dims(t[1])
        if kind is not None:
            t[2] = kind
        if offset is not None:
            t[3] = offset(t[3], len(g.data))
        return m.write()
    return make


def tensor_dropped(name):
    def make(g):
        m = copy.copy(g)
        m.tensors = [t for t in g.tensors if t[0] != name]
        return m.write()
    return make


def truncated(at):
    """The model cut to `at(header length, file length)` bytes."""
    def make(g):
        full = g.write()
        return full[:at(len(g.header()), len(full))]
    return make


def raw_header(edit):
    def make(g):
        full = bytearray(g.write())
        edit(full)
        return bytes(full)
    return make


def huge_string_length(g):
    """The first key's name claims 2^62 bytes."""
    full = bytearray(g.write())
    struct.pack_into("<Q", full, 24, 1 << 62)
    return bytes(full)


def huge_array_count(g):
    """tokenizer.ggml.tokens claims 2^40 entries."""
    full = bytearray(g.write())
    key = pack_string(b"tokenizer.ggml.tokens") + struct.pack("<I", ARRAY)
    struct.pack_into("<Q", full, bytes(full).index(key) + len(key) + 4, 1 << 40)  # past the element type
    return bytes(full)


NAN = math.nan
MUTANTS = [
    # (name, what it breaks, maker)
    ("block_count_0", "block_count 0", with_kv(".block_count", U32, 0)),
    ("block_count_2e31", "block_count 2^31", with_kv(".block_count", U32, 1 << 31)),
    ("block_count_minus_1", "block_count one less than the blocks the tensors hold", None),
    ("block_count_plus_1", "block_count one more than the blocks the tensors hold", None),
    ("block_count_string", "block_count a string", with_kv(".block_count", STRING, b"thirty")),
    ("rms_eps_nan", "rms_eps NaN", with_kv(".attention.layer_norm_rms_epsilon", F32, NAN)),
    ("rms_eps_zero", "rms_eps 0", with_kv(".attention.layer_norm_rms_epsilon", F32, 0.0)),
    ("rms_eps_negative", "rms_eps -1", with_kv(".attention.layer_norm_rms_epsilon", F32, -1.0)),
    ("rms_eps_inf", "rms_eps inf", with_kv(".attention.layer_norm_rms_epsilon", F32, math.inf)),
    ("rope_base_nan", "rope freq_base NaN", with_kv(".rope.freq_base", F32, NAN)),
    ("rope_base_zero", "rope freq_base 0", with_kv(".rope.freq_base", F32, 0.0)),
    ("rope_base_negative", "rope freq_base -5", with_kv(".rope.freq_base", F32, -5.0)),
    ("head_count_0", "head_count 0", with_kv(".attention.head_count", U32, 0)),
    ("head_count_7", "head_count 7 (divides neither the width nor by the KV heads)",
     with_kv(".attention.head_count", U32, 7)),
    ("head_count_kv_0", "head_count_kv 0", with_kv(".attention.head_count_kv", U32, 0)),
    ("head_count_kv_2", "head_count_kv 2 (does not divide the heads)", with_kv(".attention.head_count_kv", U32, 2)),
    ("embedding_length_0", "embedding_length 0", with_kv(".embedding_length", U32, 0)),
    ("embedding_length_577", "embedding_length off by one from the tensors",
     None),
    ("vocab_size_1000", "vocab_size differs from the tokenizer's and the embedding's", with_kv(".vocab_size", U32, 1000)),
    ("context_length_0", "context_length 0", with_kv(".context_length", U32, 0)),
    ("architecture_unknown", "an architecture no loader knows", with_kv("general.architecture", STRING, b"gpt9")),
    ("tokens_minus_1", "tokenizer arrays one shorter than the embedding's rows", tokens_resized(-1)),
    ("tokens_minus_100", "tokenizer arrays 100 shorter than the embedding's rows", tokens_resized(-100)),
    ("tokens_empty", "tokenizer arrays empty", None),
    ("tokens_plus_8", "tokenizer arrays 8 longer than the embedding's rows", tokens_resized(8)),
    ("tokens_duplicate", "two tokens with the same text", tokens_duplicated),
    ("tokenizer_none", "tokenizer.ggml.model none (llama.cpp aborts when it tokenises)",
     with_kv("tokenizer.ggml.model", STRING, b"none")),
    ("tokenizer_llama_on_bpe", "tokenizer.ggml.model llama on a BPE vocabulary (no scores)",
     with_kv("tokenizer.ggml.model", STRING, b"llama")),
    ("token_type_99", "token types outside llama.cpp's", None),
    ("bos_id_huge", "tokenizer.ggml.bos_token_id 10^9", with_kv("tokenizer.ggml.bos_token_id", U32, 10**9)),
    ("eos_ids_outside", "tokenizer.ggml.eos_token_ids holding ids outside the vocabulary",
     with_kv("tokenizer.ggml.eos_token_ids", ARRAY, (U32, [2, 10**9]))),
    ("expert_count_huge", "expert_count and expert_used_count 2^31 (llama.cpp asserts)",
     None),
    ("expert_used_above_count", "expert_used_count 8 of 4 experts", None),
    ("rope_scaling_unknown", "rope.scaling.type zzz (llama.cpp asserts)", with_kv(".rope.scaling.type", STRING, b"zzz")),
    ("chat_template_16mb", "a 16 MB chat template", with_kv("tokenizer.chat_template", STRING, b"{{ x }}" * (16 << 17))),
    ("embd_swapped", "token_embd.weight with its two dimensions swapped",
     tensor_changed("token_embd.weight", dims=lambda d: d[::-1])),
    ("ffn_gate_swapped", "blk.0.ffn_gate.weight with its two dimensions swapped",
     tensor_changed("blk.0.ffn_gate.weight", dims=lambda d: d[::-1])),
    ("attn_k_swapped", "blk.0.attn_k.weight with its two dimensions swapped",
     tensor_changed("blk.0.attn_k.weight", dims=lambda d: d[::-1])),
    ("tensor_type_99", "a tensor of type 99", tensor_changed("blk.0.attn_q.weight", kind=99)),
    ("tensor_offset_past_end", "a tensor whose data lies past the end of the file",
     tensor_changed("blk.3.ffn_up.weight", offset=lambda o, n: n + 4096)),
    ("tensor_offset_misaligned", "a tensor offset off the alignment",
     tensor_changed("blk.3.ffn_up.weight", offset=lambda o, n: o + 1)),
    ("tensor_missing", "blk.5.attn_q.weight missing", tensor_dropped("blk.5.attn_q.weight")),
    ("tensor_dims_huge", "a tensor of 2^40 x 2^40 elements",
     tensor_changed("blk.0.attn_norm.weight", dims=lambda d: [1 << 40, 1 << 40])),
    ("bad_magic", "a bad magic", raw_header(lambda b: b.__setitem__(slice(0, 4), b"GGUX"))),
    ("version_99", "version 99", raw_header(lambda b: struct.pack_into("<I", b, 4, 99))),
    ("n_tensors_huge", "2^40 tensors claimed", raw_header(lambda b: struct.pack_into("<Q", b, 8, 1 << 40))),
    ("n_kv_huge", "2^40 keys claimed", raw_header(lambda b: struct.pack_into("<Q", b, 16, 1 << 40))),
    ("key_length_huge", "a key name of 2^62 bytes", huge_string_length),
    ("array_count_huge", "a tokenizer array of 2^40 entries", huge_array_count),
    ("truncated_4", "cut after the magic", truncated(lambda h, n: 4)),
    ("truncated_20", "cut inside the header", truncated(lambda h, n: 20)),
    ("truncated_keys", "cut inside the metadata", truncated(lambda h, n: h // 3)),
    ("truncated_directory", "cut inside the tensor directory", truncated(lambda h, n: h - 40)),
    ("truncated_data_start", "cut where the data starts", truncated(lambda h, n: h + 1)),
    ("truncated_data_middle", "cut in the middle of the data", truncated(lambda h, n: (h + n) // 2)),
    ("truncated_last_byte", "one byte short", truncated(lambda h, n: n - 1)),
    ("empty", "an empty file", lambda g: b""),
]


def fill_dependent(g):
    """The makers that depend on the model's own values."""
    blocks = max(int(t[0].split(".")[1]) for t in g.tensors if t[0].startswith("blk.")) + 1
    width = g.tensor("token_embd.weight")[1][0]
    n_tokens = len(g.kv["tokenizer.ggml.tokens"][1][1])
    def token_types(g):
        m = copy.copy(g)
        m.kv = dict(g.kv)
        et, items = g.kv["tokenizer.ggml.token_type"][1]
        m.kv["tokenizer.ggml.token_type"] = [ARRAY, (et, [99] * 100 + items[100:])]
        return m.write()

    makers = {
        "token_type_99": token_types,
        "expert_count_huge": with_kvs({".expert_count": (U32, 1 << 31), ".expert_used_count": (U32, 1 << 31)}),
        "expert_used_above_count": with_kvs({".expert_count": (U32, 4), ".expert_used_count": (U32, 8)}),
        "block_count_minus_1": with_kv(".block_count", U32, blocks - 1),
        "block_count_plus_1": with_kv(".block_count", U32, blocks + 1),
        "embedding_length_577": with_kv(".embedding_length", U32, width + 1),
        "tokens_empty": tokens_resized(-n_tokens),
    }
    return [(name, what, makers.get(name, make)) for name, what, make in MUTANTS]


def write_each(model, out_dir, only=()):
    """Writes the mutants (those named in `only`, or all) one at a time as OUT_DIR/NAME.gguf,
    yielding (name, what, path) after each: a caller that removes each file when done needs
    room for one mutant, not for all (each is about as large as the model)."""
    import os
    with open(model, "rb") as f:
        g = gguf(f.read())
    os.makedirs(out_dir, exist_ok=True)
    for name, what, make in fill_dependent(g):
        if only and name not in only:
            continue
        path = os.path.join(out_dir, name + ".gguf")
        with open(path, "wb") as f:
            f.write(make(g))
        yield name, what, path


if __name__ == "__main__":
    for name, what, path in write_each(sys.argv[1], sys.argv[2]):
        print(f"{name}: {what}")
