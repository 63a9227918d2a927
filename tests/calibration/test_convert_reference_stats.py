"""tools/convert_reference_stats.py on synthetic torch.save archives written here without
PyTorch (fake `torch` modules make pickle emit the same globals and persistent ids as
torch.save): exact values through shuffled keys and strided storages, the safetensors layout,
and every refusal of malformed or hostile input (exit code 2, one line on stderr).

Usage: test_convert_reference_stats.py <converter>. Needs NumPy: without it the test is skipped
(exit 77), or fails when TRIATTN_REQUIRE_DATA=1 (CI).
"""

import collections
import io
import json
import os
import pickle
import random
import struct
import subprocess
import sys
import tempfile
import types
import zipfile

try:
    import numpy as np
except ImportError:
    if os.environ.get("TRIATTN_REQUIRE_DATA") == "1":
        print(f"FAILED: NumPy is missing for {sys.executable} (install python3-numpy)")
        sys.exit(1)
    print(f"SKIPPED: NumPy is missing for {sys.executable}; the converter needs it")
    sys.exit(77)

CONVERTER = sys.argv[1]

# --- a torch.save writer without torch -------------------------------------------------------

torch = types.ModuleType("torch")
torch_utils = types.ModuleType("torch._utils")
sys.modules.update({"torch": torch, "torch._utils": torch_utils})


def _rebuild_tensor_v2(*args):
    raise AssertionError("never called: only pickled by reference")


_rebuild_tensor_v2.__module__ = "torch._utils"
torch_utils._rebuild_tensor_v2 = _rebuild_tensor_v2
for _name in ("FloatStorage", "DoubleStorage", "HalfStorage", "BFloat16Storage"):
    setattr(torch, _name, type(_name, (), {"__module__": "torch"}))


class FakeStorage:
    def __init__(self, kind, raw, numel):
        self.kind, self.raw, self.numel = kind, raw, numel


class FakeTensor:
    """Pickles as torch does: _rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())."""

    def __init__(self, storage, offset, size, stride):
        self.args = (storage, offset, tuple(size), tuple(stride), False, collections.OrderedDict())

    def __reduce__(self):
        return (_rebuild_tensor_v2, self.args)


class Hostile:
    """Would run a shell command when unpickled by a plain pickle.load."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def f32_tensor(values, storages):
    values = np.asarray(values, dtype="<f4")
    s = FakeStorage(torch.FloatStorage, values.tobytes(), values.size)
    storages.append(s)
    return FakeTensor(s, 0, values.shape, (1,))


class TorchPickler(pickle.Pickler):
    def __init__(self, file, keys):
        super().__init__(file, protocol=2)
        self.keys = keys

    def persistent_id(self, obj):
        if isinstance(obj, FakeStorage):
            return ("storage", obj.kind, self.keys[id(obj)], "cpu", obj.numel)
        return None


def write_pt(path, obj, storages, byteorder="little", truncate=None):
    keys = {id(s): str(i) for i, s in enumerate(storages)}
    buf = io.BytesIO()
    TorchPickler(buf, keys).dump(obj)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", byteorder)
        for s in storages:
            raw = s.raw if truncate is None or keys[id(s)] != truncate else s.raw[:-4]
            z.writestr(f"archive/data/{keys[id(s)]}", raw)
        z.writestr("archive/version", "3\n")


# --- the synthetic model ----------------------------------------------------------------------

LAYERS, Q_HEADS, BANDS = 2, 4, 4
SEED = int(os.environ.get("TRIATTN_TEST_SEED") or random.SystemRandom().getrandbits(32))
print(f"TRIATTN_TEST_SEED={SEED}")
rng = np.random.default_rng(SEED)
EXPECTED = {name: rng.standard_normal((LAYERS, Q_HEADS, BANDS)).astype("<f4")
            for name in ("q_mean_real", "q_mean_imag", "q_abs_mean")}


def build(strided=True, skip=None, extra_meta=None, style="half", bands=None):
    """(object, storages) of a reference stats file; heads in shuffled order. With `strided`,
    head (0, 1)'s three tensors are views into one shared storage (offset and stride 3)."""
    storages = []
    stats = {}
    order = [(l, h) for l in range(LAYERS) for h in range(Q_HEADS)]
    random.Random(7).shuffle(order)
    for layer, head in order:
        if (layer, head) == skip:
            continue
        fields = {name: EXPECTED[name][layer, head] for name in EXPECTED}
        if bands is not None and (layer, head) == (1, 2):
            fields["q_abs_mean"] = np.zeros(bands, dtype="<f4")
        if strided and (layer, head) == (0, 1):
            interleaved = np.stack([fields[n] for n in EXPECTED], axis=1).reshape(-1).astype("<f4")
            s = FakeStorage(torch.FloatStorage, interleaved.tobytes(), interleaved.size)
            storages.append(s)
            entry = {n: FakeTensor(s, i, (BANDS,), (3,)) for i, n in enumerate(EXPECTED)}
        else:
            entry = {n: f32_tensor(v, storages) for n, v in fields.items()}
        stats[f"layer{layer:02d}_head{head:02d}"] = entry
    metadata = {"rope_style": style, "head_dim": 2 * BANDS, "model_name": "synthetic/model",
                "sampled_heads": [[l, h] for l, h in order if (l, h) != skip]}
    metadata.update(extra_meta or {})
    if style is None:
        del metadata["rope_style"]
    return {"metadata": metadata, "stats": stats}, storages


failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print(f"FAIL: {what}")


def run(pt, *flags, out=None):
    cmd = [sys.executable, CONVERTER, pt, "--num-kv-heads", "2", "--out", out or pt + ".safetensors", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def read_safetensors(path):
    blob = open(path, "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    check(n % 8 == 0, "header not padded to a multiple of 8 bytes")
    header = json.loads(blob[8:8 + n])
    base = 8 + n
    # The C++ writer's layout: metadata first, then F64 before F32, each group by name, gap-free.
    names = list(header)
    check(names == ["__metadata__", "inv_freq", "q_abs_mean", "q_mean_imag", "q_mean_real"], f"header order {names}")
    tensors = {}
    offset = 0
    for name in names[1:]:
        e = header[name]
        begin, end = e["data_offsets"]
        check(begin == offset, f"{name} starts at {begin}, expected {offset} (gap-free)")
        dtype = {"F32": "<f4", "F64": "<f8"}[e["dtype"]]
        tensors[name] = np.frombuffer(blob[base + begin:base + end], dtype=dtype).reshape(e["shape"])
        offset = end
    check(base + offset == len(blob), "trailing bytes after the last tensor")
    return header["__metadata__"], tensors, header


def expect_error(tmp, label, obj_storages, needle, flags=(), **write_kw):
    pt = os.path.join(tmp, f"{label}.pt")
    if isinstance(obj_storages, bytes):
        open(pt, "wb").write(obj_storages)
    else:
        write_pt(pt, *obj_storages, **write_kw)
    r = run(pt, *flags)
    lines = r.stderr.strip().splitlines()
    check(r.returncode == 2, f"{label}: exit code {r.returncode}, expected 2 ({r.stderr.strip()})")
    check(len(lines) == 1 and needle in r.stderr, f"{label}: stderr {r.stderr!r} lacks {needle!r} on one line")
    check(not os.path.exists(pt + ".safetensors"), f"{label}: an output was written despite the error")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        # Exact values, layout, metadata.
        pt = os.path.join(tmp, "good.pt")
        write_pt(pt, *build())
        r = run(pt, "--rope-theta", "1e6", "--model", "flag/model")
        if r.returncode != 0:
            print(f"FAIL: valid file: exit {r.returncode}: {r.stderr}")
            return 1
        meta, tensors, header = read_safetensors(pt + ".safetensors")
        for name, want in EXPECTED.items():
            check(header[name]["dtype"] == "F32" and np.array_equal(tensors[name], want), f"{name} differs")
        check(header["inv_freq"]["dtype"] == "F64", "inv_freq is not F64")
        check(np.allclose(tensors["inv_freq"], 1e6 ** (-np.arange(0, 2 * BANDS, 2) / (2 * BANDS)), rtol=1e-15,
                          atol=0), "default inv_freq")
        check(meta == {"format": "triattn.stats.v1", "rope_style": "half", "num_kv_heads": "2",
                       "attention_scale": "1", "source": "good.pt", "model": "flag/model"}, f"metadata {meta}")

        # The .pt's model name when --model is absent; YaRN's default attention scale.
        r = run(pt, "--rope-scaling", "yarn", "--rope-factor", "4", "--original-max-position", "32768")
        meta, _, _ = read_safetensors(pt + ".safetensors")
        check(r.returncode == 0 and meta["model"] == "synthetic/model", f"model from .pt: {meta}")
        check(abs(float(meta["attention_scale"]) - (0.1 * np.log(4.0) + 1.0)) < 1e-15, f"yarn scale {meta}")
        os.remove(pt + ".safetensors")

        # --help works and says what is needed.
        r = subprocess.run([sys.executable, CONVERTER, "--help"], capture_output=True, text=True, check=False)
        check(r.returncode == 0 and "--num-kv-heads" in r.stdout and "NumPy" in r.stdout, "--help")

        # Refusals: exit 2, one line, no output file.
        marker = os.path.join(tmp, "pwned")
        obj, storages = build()
        obj["metadata"]["note"] = Hostile(f"touch {marker}")
        expect_error(tmp, "hostile", (obj, storages), "refusing pickle global")
        check(not os.path.exists(marker), "the hostile pickle ran a command")

        expect_error(tmp, "missing_head", build(skip=(1, 2)), "missing, first layer01_head02")
        obj, storages = build()
        obj["stats"]["layer99999999_head00"] = obj["stats"]["layer00_head00"]
        expect_error(tmp, "huge_index", (obj, storages), "missing, first layer02_head00")
        expect_error(tmp, "truncated", build(), "holds 12 bytes, expected 16", truncate="3")
        expect_error(tmp, "bands", build(bands=3), "has 3 bands, expected 4")
        expect_error(tmp, "head_dim", build(extra_meta={"head_dim": 16}), "metadata head_dim 16 != 8")
        expect_error(tmp, "kv_heads_meta", build(extra_meta={"num_kv_heads": 4}), "--num-kv-heads 2 != metadata")
        expect_error(tmp, "no_style", build(style=None), "rope_style None")
        expect_error(tmp, "bad_style", build(style="neox"), "rope_style 'neox'")
        expect_error(tmp, "gqa", build(), "4 q-heads are not a multiple of --num-kv-heads 3",
                     flags=("--num-kv-heads", "3"))
        expect_error(tmp, "big_endian", build(), "'big'-endian", byteorder="big")
        expect_error(tmp, "not_zip", b"not a zip archive", "cannot read")
        obj, storages = build(strided=False)
        next(iter(obj["stats"].values()))["q_mean_real"].args = (storages[0], 2, (BANDS,), (1,), False, {})
        expect_error(tmp, "past_storage", (obj, storages), "reaches past its storage of 4 elements")
        obj, storages = build()
        obj["metadata"]["sampled_heads"] = obj["metadata"]["sampled_heads"][1:]
        expect_error(tmp, "sampled", (obj, storages), "sampled_heads")

    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("all converter checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
