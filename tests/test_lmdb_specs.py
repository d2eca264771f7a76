"""LMDBs as other tools write them (raw bytes, ``np.save`` bytes, msgpack, pickle), read through
a spec file's ``lmdb`` table; and the spec file examples of docs/loader.md."""

from __future__ import annotations

import io
import json
import pickle
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import lmdb
import msgpack
import numpy as np
import pytest

from datastore import DataStoreLoader
from datastore.maths.order import Schedule
from datastore.readers import DatasetSpec, open_dataset, write_lmdb
from datastore.readers.base import DatasetError
from datastore.readers.lmdb_layout import LmdbLayout, RecordField

N = 12  # keys b"0".."11": numeric order differs from LMDB's byte order (b"10" < b"2")
SHAPE = (2, 4, 4, 4)
RNG = np.random.default_rng(14)
X = RNG.standard_normal((N, *SHAPE), dtype=np.float32)
LABELS = RNG.integers(0, 10, N)
Y = RNG.standard_normal((N, 3))  # float64, msgpack-numpy array maps
DOCS = Path(__file__).parent.parent / "docs" / "loader.md"


def put(path: Path, records: dict[bytes, bytes]) -> Path:
    env = lmdb.open(str(path), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for key, value in records.items():
            txn.put(key, value)
    env.close()
    return path


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def numpy_map(a: np.ndarray) -> dict:
    """An array as msgpack-numpy packs it."""
    return {
        b"nd": True,
        b"type": a.dtype.str,
        b"kind": b"",
        b"shape": a.shape,
        b"data": a.tobytes(),
    }


def raw_records(i):
    return X[i].tobytes()


def npy_records(i):
    return npy_bytes(np.asfortranarray(X[i]) if i == 3 else X[i])  # one Fortran-ordered


def msgpack_records(i):
    record = {"data": X[i].tobytes(), "dtype": "float32", "shape": list(SHAPE)}
    return msgpack.packb({**record, "label": int(LABELS[i]), "y": numpy_map(Y[i])})


def pickle_records(i):
    return pickle.dumps((X[i], int(LABELS[i])))


# value -> (the record of sample i, the spec's lmdb table in TOML, the fields it gives)
ENCODINGS = {
    "raw": (raw_records, '[lmdb.fields.x]\ndtype = "<f4"\nshape = [2, 4, 4, 4]\n', "x"),
    "npy": (npy_records, "[lmdb.fields.x]\n", "x"),
    "msgpack": (
        msgpack_records,
        '[lmdb.fields.x]\nitem = "data"\ndtype_item = "dtype"\nshape_item = "shape"\n'
        "[lmdb.fields.label]\n[lmdb.fields.y]\n",
        "x label y",
    ),
    "pickle": (
        pickle_records,
        "allow_pickle = true\n[lmdb.fields.x]\nitem = 0\n[lmdb.fields.label]\nitem = 1\n",
        "x label",
    ),
}
EXPECTED = {"x": X, "label": LABELS, "y": Y}


def write(tmp_path: Path, value: str, keys: str = "numeric", label: bool = True) -> Path:
    """An LMDB of ``value`` records under keys ``str(i)`` (numeric) or ``%08d`` (sorted),
    with a ``__len__`` record to skip, and its spec file; returns the spec file."""
    records, table, fields = ENCODINGS[value]
    name = (lambda i: b"%d" % i) if keys == "numeric" else (lambda i: b"%08d" % i)
    put(tmp_path / "ds", {name(i): records(i) for i in range(N)} | {b"__len__": b"12"})
    top = 'label = "label"\n' if label and "label" in fields else ""
    spec = tmp_path / "spec.toml"
    spec.write_text(
        f'format = "lmdb"\npaths = "ds"\n{top}[lmdb]\nvalue = "{value}"\nkeys = "{keys}"\n'
        f'skip_keys = ["__len__"]\n{table}'
    )
    return spec


def inspect(*args) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "datastore", "inspect", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


# -- each encoding, sample for sample ------------------------------------------------------------
@pytest.mark.parametrize("value", list(ENCODINGS))
def test_each_encoding_reads_exact_arrays_and_labels(tmp_path, value):
    keys = "sorted" if value == "npy" else "numeric"
    spec = write(tmp_path, value, keys)
    fields = ENCODINGS[value][2].split()
    with open_dataset(str(spec)) as r:
        assert len(r) == N and list(r.fields) == fields
        assert r.label == ("label" if "label" in fields else None)
        assert (r.fields["x"].dtype, r.fields["x"].shape) == (np.dtype("<f4"), SHAPE)
        assert r.fields["x"].spatial_axes == (1, 2, 3)
        for i in (0, 2, 3, 10, 11):  # 10 after 9 and 2 before 10: numeric, not byte order
            for name in fields:
                assert r.read(i, name).tobytes() == EXPECTED[name][i].tobytes(), (i, name)
        region = (slice(1, 2), slice(0, 4), slice(1, 3), slice(2, 4))
        out = np.empty((1, 4, 2, 2), np.float32)
        assert r.read(3, "x", region, out=out) is out
        assert out.tobytes() == X[3][region].tobytes()
        if "label" in fields:
            assert r.fields["label"].shape == () and r.fields["label"].dtype == np.int64


def test_inspect_counts_the_samples_of_each_encoding(tmp_path):
    for value in ENCODINGS:
        d = tmp_path / value
        d.mkdir()
        proc = inspect(write(d, value), "--json")
        assert proc.returncode == 0, proc.stderr
        s = json.loads(proc.stdout)
        assert (s["format"], s["num_samples"], s["files"]) == ("lmdb", N, 1)
        assert list(s["fields"]) == ENCODINGS[value][2].split()
        assert s["fields"]["x"] == {
            "dtype": "<f4",
            "shape": list(SHAPE),
            "spatial_axes": [1, 2, 3],
            "chunks": None,
            "nbytes_per_sample": X[0].nbytes,
        }


def test_an_lmdb_file_written_without_subdir(tmp_path):
    env = lmdb.open(str(tmp_path / "one.lmdb"), subdir=False, map_size=1 << 22)
    with env.begin(write=True) as txn:
        for i in range(N):
            txn.put(b"%d" % i, npy_bytes(X[i]))
    env.close()
    layout = LmdbLayout("npy", keys="numeric")
    with open_dataset(DatasetSpec("lmdb", str(tmp_path / "one.lmdb"), lmdb=layout)) as r:
        assert len(r) == N and list(r.fields) == ["data"]
        assert r.read(11, "data").tobytes() == X[11].tobytes()


def test_the_loader_reads_an_lmdb_through_a_spec_file(tmp_path):
    spec = write(tmp_path, "msgpack")
    loader = DataStoreLoader(str(spec), batch_size=4, seed=3)
    order = Schedule(N, 4, seed=3).order(0)
    batches = list(loader)
    assert len(batches) == 3
    for name, want in EXPECTED.items():
        got = np.concatenate([b[name].numpy() for b in batches])
        assert got.tobytes() == want[order].tobytes(), name


# -- pickle needs an explicit opt-in -------------------------------------------------------------
def test_pickle_is_refused_without_allow_pickle(tmp_path):
    spec = write(tmp_path, "pickle")
    spec.write_text(spec.read_text().replace("allow_pickle = true\n", ""))
    proc = inspect(spec)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        f'datastore inspect: error: {spec}: value = "pickle" is refused: unpickling a record '
        "runs code that whoever wrote the LMDB chose. Set allow_pickle = true in the spec's "
        "lmdb table only for data you trust\n"
    )
    with pytest.raises(DatasetError, match="unpickling a record runs code"):
        LmdbLayout("pickle", {"x": RecordField(item=0)})
    spec.write_text(spec.read_text().replace("[lmdb]\n", '[lmdb]\nallow_pickle = "yes"\n'))
    with pytest.raises(DatasetError, match="allow_pickle must be true or false: 'yes'"):
        DatasetSpec.load(spec)


def test_the_service_unpickles_nothing_a_client_names(tmp_path):
    from datastore.service.errors import ServiceError
    from datastore.service.resident import listing

    spec = write(tmp_path, "pickle")
    with pytest.raises(ServiceError) as exc:
        listing(str(spec))
    assert exc.value.code == "INVALID_ARGUMENT"
    assert str(exc.value) == (
        f'{spec}: value = "pickle" is refused here: datastore serve unpickles nothing a client '
        "names (it would run code that the data chose); read it with the embedded loader, or "
        "convert it once with write_lmdb (docs/loader.md)"
    )
    (tmp_path / "npy").mkdir()
    assert listing(str(write(tmp_path / "npy", "npy")))[2] == {"x": ("float32", SHAPE)}


def test_a_pickled_lmdb_converts_once_to_our_own(tmp_path):
    with open_dataset(str(write(tmp_path, "pickle"))) as r:  # the snippet of docs/loader.md
        axes = {name: f.spatial_axes for name, f in r.fields.items()}
        write_lmdb(tmp_path / "own", (r.read_sample(i) for i in range(len(r))), spatial_axes=axes)
    with open_dataset(str(tmp_path / "own")) as own:
        assert len(own) == N and own.fields["x"].spatial_axes == (1, 2, 3)
        assert all(own.read(i, "x").tobytes() == X[i].tobytes() for i in range(N))
        assert [int(own.read(i, "label")) for i in range(N)] == LABELS.tolist()


# -- a spec that does not match the records ------------------------------------------------------
def test_a_raw_shape_that_does_not_match_names_the_key(tmp_path):
    spec = write(tmp_path, "raw")
    spec.write_text(spec.read_text().replace("[2, 4, 4, 4]", "[2, 4, 4, 8]"))
    proc = inspect(spec)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        f"datastore inspect: error: {tmp_path / 'ds'}: field 'x': record b'0': the record holds "
        "512 bytes, dtype <f4 and shape [2, 4, 4, 8] make 1024; check lmdb.fields.x "
        "(dtype, shape)\n"
    )


def test_an_npy_dtype_that_does_not_match_names_the_key(tmp_path):
    spec = write(tmp_path, "npy", keys="sorted")
    spec.write_text(spec.read_text() + 'dtype = "<f8"\n')
    with pytest.raises(DatasetError) as exc:
        open_dataset(str(spec))
    assert str(exc.value) == (
        f"{tmp_path / 'ds'}: field 'x': record b'00000000' holds <f4 [2, 4, 4, 4], but the spec "
        "(lmdb.fields.x: dtype) says <f8 [2, 4, 4, 4]"
    )


def test_a_record_unlike_the_first_is_named_when_read(tmp_path):
    spec = write(tmp_path, "msgpack")
    env = lmdb.open(str(tmp_path / "ds"), map_size=1 << 24)
    with env.begin(write=True) as txn:
        odd = {"data": X[7].tobytes(), "dtype": "float32", "shape": [4, 2, 4, 4], "label": 1}
        txn.put(b"7", msgpack.packb({**odd, "y": numpy_map(Y[7])}))
        txn.put(b"5", msgpack.packb({**odd, "shape": [2, 4, 4, 4], "label": 1.5}))
    env.close()
    with open_dataset(str(spec)) as r:
        assert r.read(6, "x").tobytes() == X[6].tobytes()
        with pytest.raises(DatasetError) as exc:
            r.read(7, "x")
        assert str(exc.value) == (
            f"{tmp_path / 'ds'}: field 'x': record b'7' holds <f4 [4, 2, 4, 4], but the first "
            "record b'0' says <f4 [2, 4, 4, 4]"
        )
        with pytest.raises(DatasetError, match=r"field 'label': record b'5' holds <f8 \[\], but"):
            r.read(5, "label")


def test_numbers_take_the_spec_dtype_when_nothing_is_lost(tmp_path):
    spec = write(tmp_path, "msgpack")
    spec.write_text(
        spec.read_text().replace("[lmdb.fields.label]\n", '[lmdb.fields.label]\ndtype = "<i2"\n')
    )
    put(
        tmp_path / "ds",
        {b"4": msgpack.packb({**msgpack.unpackb(msgpack_records(4)), "label": 1.5})},
    )
    put(
        tmp_path / "ds",
        {b"5": msgpack.packb({**msgpack.unpackb(msgpack_records(5)), "label": 40000})},
    )
    with open_dataset(str(spec)) as r:
        assert r.fields["label"].dtype == np.dtype("<i2")
        assert [int(r.read(i, "label")) for i in range(4)] == LABELS[:4].tolist()
        for i, bad in ((4, "1.5"), (5, "40000")):
            with pytest.raises(
                DatasetError, match=rf"'label': record b'{i}': item 'label' is {bad}, not a <i2"
            ):
                r.read(i, "label")


def test_inspect_checks_every_raw_record(tmp_path):
    spec = write(tmp_path, "raw")
    put(tmp_path / "ds", {b"9": X[9].tobytes()[:-4]})
    proc = inspect(spec)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "field 'x': record b'9': the record holds 508 bytes" in proc.stderr
    assert proc.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("value", "old", "new", "index", "message"),
    [
        ("msgpack", "[lmdb.fields.y]\n", '[lmdb.fields.y]\nitem = "yy"\n', 0,
         "field 'y': record b'0' has no item 'yy' "
         "(it has: 'data', 'dtype', 'shape', 'label', 'y')"),
        ("msgpack", 'dtype_item = "dtype"', 'dtype_item = "shape"', 0,
         "field 'x': record b'0': item 'shape' (dtype_item) is [2, 4, 4, 4], not a numpy dtype"),
        ("msgpack", 'shape_item = "shape"\n', "", 0,
         "field 'x': record b'0': item 'data' is bytes; give lmdb.fields.x a dtype and a shape "
         "(or dtype_item and shape_item: the items that hold them)"),
        ("pickle", "item = 0", 'item = "x"', 0,
         "field 'x': record b'0' is a sequence of 2 items: item must be a position 0..1, got 'x'"),
        ("msgpack", 'keys = "numeric"\nskip_keys = ["__len__"]\n', "", 12,  # b"__len__" last
         "record b'__len__' is not msgpack: ExtraData: "),
    ],
)  # fmt: skip
def test_records_that_do_not_fit_the_table_are_named(tmp_path, value, old, new, index, message):
    spec = write(tmp_path, value, label=False)
    spec.write_text(spec.read_text().replace(old, new))
    with pytest.raises(DatasetError) as exc, open_dataset(str(spec)) as r:
        r.read(index, "x")
    assert str(exc.value).startswith(f"{tmp_path / 'ds'}: {message}"), str(exc.value)


def test_numeric_keys_must_be_numbers(tmp_path):
    spec = write(tmp_path, "raw")
    spec.write_text(spec.read_text().replace('skip_keys = ["__len__"]\n', ""))
    with pytest.raises(DatasetError, match=r"key b'__len__' is not a decimal integer .*skip_keys"):
        open_dataset(str(spec))
    put(tmp_path / "ds", {b"007": X[0].tobytes()})
    spec.write_text(spec.read_text().replace("[lmdb]\n", '[lmdb]\nskip_keys = ["__len__"]\n'))
    with pytest.raises(DatasetError, match=r"keys b'007' and b'7' are the same number"):
        open_dataset(str(spec))


def test_an_lmdb_without_meta_asks_for_a_spec(tmp_path):
    put(tmp_path / "ds", {b"0": X[0].tobytes()})
    proc = inspect(tmp_path / "ds")
    assert proc.returncode == 2
    assert (
        "no __meta__ record: not a dataset written by write_lmdb; describe its records in a "
        "spec file with an lmdb table" in proc.stderr
    )


def _named_databases(path: Path) -> Path:
    """An environment holding named databases ``train`` (samples 0-7) and ``val`` (8-11) of
    npy records, as tools that keep both splits in one environment write it."""
    env = lmdb.open(str(path), map_size=1 << 24, max_dbs=2)
    for name, rows in ((b"train", range(8)), (b"val", range(8, N))):
        db = env.open_db(name)
        with env.begin(write=True, db=db) as txn:
            for i in rows:
                txn.put(b"%08d" % i, npy_bytes(X[i]))
    env.close()
    return path


def test_a_named_database_is_read_through_the_spec(tmp_path):
    """Named databases (an environment opened with max_dbs) could not be read: the main
    database holds only their names, and the reader said "no __meta__ record"."""
    _named_databases(tmp_path / "ds")
    got = {}
    for name in ("train", "val"):
        spec = tmp_path / f"{name}.toml"
        spec.write_text(f'format = "lmdb"\npaths = "ds"\n[lmdb]\nvalue = "npy"\ndb = "{name}"\n')
        loader = DataStoreLoader(str(spec), batch_size=2, shuffle=False, drop_last=False)
        got[name] = np.concatenate([b["data"].numpy() for b in loader])
        loader.close()
    assert np.array_equal(got["train"], X[:8]) and np.array_equal(got["val"], X[8:])
    proc = inspect(tmp_path / "ds")  # no spec: it says which databases there are
    assert proc.returncode == 2
    assert (
        "holds named databases (train, val), no __meta__ record: name the one to read with "
        'db = "train" in a spec file\'s lmdb table' in proc.stderr
    )
    (tmp_path / "test.toml").write_text(
        'format = "lmdb"\npaths = "ds"\n[lmdb]\nvalue = "npy"\ndb = "test"\n'
    )
    proc = inspect(tmp_path / "test.toml")
    assert proc.returncode == 2
    assert "no database named 'test' (named databases: train, val)" in proc.stderr


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"format": "hdf5", "lmdb": {"value": "npy"}}, "an lmdb table is for format lmdb"),
        ({"lmdb": {"value": "npy", "order": "x"}}, r"unknown key\(s\) \['order'\] in lmdb"),
        ({"lmdb": {"value": "json"}}, "lmdb value 'json' is not one of raw, npy"),
        ({"lmdb": {"value": "npy", "keys": "random"}}, "lmdb keys 'random' is not one of"),
        ({"lmdb": {"value": "raw", "fields": {"x": {"dtype": "<f4"}}}}, "x'.*give dtype and shape"),
        ({"lmdb": {"value": "raw", "fields": {"x": {}, "y": {}}}}, "name one field"),
        ({"lmdb": {"value": "npy", "fields": {"x": {"item": "a"}}}}, 'x\'.*item: a "npy" record'),
        ({"lmdb": {"value": "msgpack"}}, "needs lmdb.fields"),
        ({"lmdb": {"value": "msgpack", "fields": {"x": {"dtype": "f5"}}}}, "x'.*dtype 'f5' is not"),
        ({"lmdb": {"value": "msgpack", "fields": {"x": {"shape": [2, -1]}}}}, "negative length"),
        ({"lmdb": {"value": "msgpack", "fields": {"x": {"size": 3}}}}, r"x'.*\['size'\]"),
        ({"lmdb": {"value": "msgpack", "fields": {"x": {"item": -1}}}}, "a position"),
        ({"lmdb": {"value": "npy", "skip_keys": "__len__"}}, "skip_keys must be a list"),
        ({"lmdb": {"value": "npy", "db": ""}}, "lmdb db must be a database's name"),
    ],
)
def test_a_malformed_lmdb_table_names_the_key(tmp_path, spec, message):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"format": "lmdb", "paths": "ds", **spec}))
    with pytest.raises(DatasetError, match=message) as exc:
        DatasetSpec.load(path)
    assert exc.value.path == str(path)


def test_a_spec_round_trips_through_plain_data(tmp_path):
    spec = DatasetSpec.load(write(tmp_path, "msgpack"))
    assert spec.lmdb.fields[0] == ("x", RecordField("data", None, None, "dtype", "shape"))
    assert DatasetSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert "lmdb" not in DatasetSpec("lmdb", "ds").to_dict()


# -- the spec files of docs/loader.md ------------------------------------------------------------
def test_every_spec_file_example_in_the_docs_is_a_valid_spec():
    text = DOCS.read_text()
    section = text[text.index("## Spec files") :]
    section = section[: section.index("\n## ", 1)]
    examples = [tomllib.loads(t) for t in re.findall(r"```toml\n(.*?)```", section, re.S)]
    examples += [json.loads(t) for t in re.findall(r"```json\n(.*?)```", section, re.S)]
    formats = set()
    for example in examples:
        spec = DatasetSpec.from_dict(example, base_dir="/data")
        formats.add(spec.format if spec.lmdb is None else f"lmdb-{spec.lmdb.value}")
    assert len(examples) == 12
    assert formats == {
        "hdf5", "hdf5-per-sample", "zarr", "npy", "tar",
        "lmdb", "lmdb-raw", "lmdb-npy", "lmdb-msgpack", "lmdb-pickle",
    }  # fmt: skip
