"""WebDataset-style tar shards, written with ``tarfile``: the members sharing a key are one
sample (``000123.x.npy``, ``000123.y.npy``, ``000123.cls``, ``000123.json``), read by the
``tar`` reader, described by ``datastore inspect`` and delivered by ``DataStoreLoader``."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from datastore import DataStoreLoader
from datastore.maths.order import Schedule
from datastore.readers import DatasetError, FieldInfo, open_dataset
from datastore.readers.tar_keys import split_member
from datastore.store.shards import LocalView, local_files, plan_shards

N = 10
# Shard k holds these samples, keys listed in the order they first appear in its tar.
SHARDS = [[0, 1, 2, 3], [6, 5, 4], [7, 8, 9]]
ORDER = [i for keys in SHARDS for i in keys]  # sample index -> the sample written
FIELDS = ["cls", "label", "redshift", "params", "sim.box", "x", "y"]


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def _x(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal((2, 4, 4, 4)).astype(np.float32)


def _y(i: int) -> np.ndarray:
    return np.array([i, -i, 0.5 * i], dtype=np.float32)


def _meta(i: int) -> dict:
    redshift = 1 if i == 5 else round(0.25 * i, 2)  # sample 5 writes an integer: widened
    return {
        "label": i % 4,
        "redshift": redshift,
        "params": [i, 2 * i],
        "name": f"halo-{i}",  # a string: metadata, not a field
        "sim": {"box": 512 + i},
    }


def _members(i: int, prefix: str = "") -> dict[str, bytes]:
    key = f"{prefix}{i:06d}"
    return {
        f"{key}.json": json.dumps(_meta(i)).encode(),
        f"{key}.x.npy": _npy(_x(i)),
        f"{key}.cls": f"{i % 4}\n".encode(),
        f"{key}.y.npy": _npy(_y(i)),
    }


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Three shards: members of a key interleaved with other keys' (shards 0 and 2, the
    latter under a directory ``train/``), or together in another field order (shard 1)."""
    d = tmp_path_factory.mktemp("wds")
    by_field = [list(_members(i).items()) for i in SHARDS[0]]
    _write_tar(d / "shard-000000.tar", [m[f] for f in range(4) for m in by_field])
    rotated = []
    for k, i in enumerate(SHARDS[1]):
        items = list(_members(i).items())
        rotated += items[k + 1 :] + items[: k + 1]
    _write_tar(d / "shard-000001.tar", rotated)
    by_field = [list(_members(i, "train/").items()) for i in SHARDS[2]]
    _write_tar(d / "shard-000002.tar", [m[f] for f in (3, 1, 0, 2) for m in by_field])
    return d


def test_member_names_split_into_key_slot_and_kind():
    assert split_member("000123.x.npy") == ("000123", "x", "npy")
    assert split_member("train/000123.cls") == ("train/000123", "cls", "cls")
    assert split_member("a.b/000123.seg.mask.NPY") == ("a.b/000123", "seg.mask", "npy")
    for name, reason in [
        ("README", "is not named KEY.FIELD"),
        ("dir/.x.npy", "is not named KEY.FIELD"),
        ("000123.jpg", ".jpg members are not read"),
    ]:
        with pytest.raises(ValueError, match=reason):
            split_member(name)


def test_one_sample_per_key_with_named_fields(shards):
    with open_dataset(str(shards)) as r:
        assert (r.format, len(r), len(r.files)) == ("tar", N, 3)
        assert list(r.fields) == FIELDS
        assert r.fields["x"] == FieldInfo("x", np.dtype("<f4"), (2, 4, 4, 4), (1, 2, 3))
        assert r.fields["y"] == FieldInfo("y", np.dtype("<f4"), (3,))
        assert r.fields["cls"] == FieldInfo("cls", np.dtype("int64"), ())
        assert r.fields["label"] == FieldInfo("label", np.dtype("int64"), ())
        assert r.fields["redshift"] == FieldInfo("redshift", np.dtype("float64"), ())
        assert r.fields["params"] == FieldInfo("params", np.dtype("int64"), (2,))
        assert r.fields["sim.box"] == FieldInfo("sim.box", np.dtype("int64"), ())
        for index in (0, 3, 4, 5, 6, 7, 9):
            i = ORDER[index]
            got = r.read_sample(index)
            assert got["x"].dtype == np.float32 and np.array_equal(got["x"], _x(i))
            assert np.array_equal(got["y"], _y(i))
            assert got["cls"].dtype == np.int64 and int(got["cls"]) == i % 4
            assert int(got["label"]) == i % 4
            assert got["redshift"].dtype == np.float64
            assert float(got["redshift"]) == (1.0 if i == 5 else round(0.25 * i, 2))
            assert got["params"].tolist() == [i, 2 * i]
            assert int(got["sim.box"]) == 512 + i
            assert r.read_json(index) == _meta(i)
        with pytest.raises(DatasetError) as exc:
            r.read_json(0, "meta")
        assert (
            str(exc.value)
            == f"{shards}/shard-000000.tar[000000]: field 'meta': no such .json member"
        )
        assert np.array_equal(r.read(8, "x", (slice(1, 2), slice(0, 4), slice(2, 3), slice(1, 3))),
                              _x(8)[1:2, :, 2:3, 1:3])  # fmt: skip
        r.check_files()  # every sample agrees with sample 0


def test_bare_and_container_members_name_their_fields(tmp_path):
    a = np.arange(6, dtype=np.int16).reshape(2, 3)
    npz = io.BytesIO()
    np.savez(npz, p=a, q=a.T.copy())
    members = [("s0.npy", _npy(a)), ("s0.cls", b"3"), ("s0.m.npz", npz.getvalue())]
    members += [("s0.meta.json", b'{"w": [0.5, 1.5], "tag": null}'), ("s0.z.json", b"[1, 2]")]
    _write_tar(tmp_path / "one.tar", members)
    with open_dataset(str(tmp_path / "one.tar")) as r:
        got = r.read_sample(0)
    assert list(got) == ["cls", "m.p", "m.q", "meta.w", "data", "z"]
    assert got["data"].tolist() == a.tolist() and got["m.q"].tolist() == a.T.tolist()
    assert (int(got["cls"]), got["meta.w"].tolist(), got["z"].tolist()) == (3, [0.5, 1.5], [1, 2])
    _write_tar(tmp_path / "clash.tar", [("s0.npy", _npy(a)), ("s0.json", b'{"data": 1}')])
    with pytest.raises(DatasetError) as exc:
        open_dataset(str(tmp_path / "clash.tar"))
    assert str(exc.value) == (
        f"{tmp_path / 'clash.tar'}[s0]: field 'data': sample 's0' gets this field from two "
        "members: 's0.json' and 's0.npy'"
    )


def test_nodes_holding_whole_shards_read_one_dataset(shards, tmp_path):
    """After ``stage --mode shard``: node 0 holds shard 0, node 1 shards 1 and 2."""
    listings, readers = [], []
    for node, names in enumerate([["shard-000000.tar"], ["shard-000001.tar", "shard-000002.tar"]]):
        d = tmp_path / f"node{node}"
        d.mkdir()
        for name in names:
            shutil.copy(shards / name, d / name)
        readers.append(open_dataset(str(d)))
        signature = {n: (str(f.dtype), f.shape) for n, f in readers[-1].fields.items()}
        listings.append(("tar", local_files(readers[-1], str(d)), signature))
    assert listings[1][1] == {"shard-000001.tar": 3, "shard-000002.tar": 3}
    names, counts, owners = plan_shards(listings)
    assert (names, counts.tolist()) == ([f"shard-00000{k}.tar" for k in range(3)], [4, 3, 3])
    assert owners[np.arange(N)].tolist() == [0] * 4 + [1] * 6
    view = LocalView.of_names(readers[1], names, list(listings[1][1]), counts)
    for index in range(4, N):
        assert np.array_equal(view.read(index, "x"), _x(ORDER[index]))
        assert int(view.read(index, "cls")) == ORDER[index] % 4
    with pytest.raises(ValueError, match="sample 3 is not on this node"):
        view.read(3, "x")
    for r in readers:
        r.close()


def _broken(tmp_path: Path, name: str, members: list[tuple[str, bytes]]) -> str:
    """A dataset: a good shard of samples 0-1, then ``name`` holding ``members``."""
    d = tmp_path / name.split(".")[0]
    d.mkdir()
    _write_tar(d / "a.tar", [m for i in (0, 1) for m in _members(i).items()])
    _write_tar(d / name, members)
    return str(d / name)


def _without(i: int, name: str) -> list[tuple[str, bytes]]:
    return [m for m in _members(i).items() if m[0] != name]


def test_bad_samples_are_named_by_shard_and_key(tmp_path):
    good = str(tmp_path / "missing" / "a.tar")
    path = _broken(tmp_path, "missing.tar", _without(2, "000002.y.npy"))
    with pytest.raises(DatasetError) as exc:
        open_dataset(os.path.dirname(path))
    assert str(exc.value) == (
        f"{path}: field 'y': sample '000002' has no member for this field, which sample "
        f"'000000' in {good} has (every sample needs one member per field: cls, json, x, y)"
    )
    path = _broken(tmp_path, "twice.tar", [*_members(2).items(), ("000002.x.npz", b"")])
    with pytest.raises(DatasetError) as exc:
        open_dataset(os.path.dirname(path))
    assert str(exc.value) == (
        f"{path}: field 'x': sample '000002' has two members for this field: "
        "'000002.x.npy' and '000002.x.npz'"
    )
    path = _broken(tmp_path, "readme.tar", [*_members(2).items(), ("README", b"hi")])
    with pytest.raises(DatasetError) as exc:
        open_dataset(os.path.dirname(path))
    assert str(exc.value) == f"{path}: member 'README' is not named KEY.FIELD (e.g. 000123.x.npy)"


def test_a_bad_header_in_a_shard_is_named_not_taken_for_its_end(tmp_path):
    """tarfile took a bad header past the first for the end of the shard: 1 of 4 samples
    read, the rest lost without a word."""
    path = tmp_path / "wds" / "shard-000000.tar"
    path.parent.mkdir()
    _write_tar(path, [m for i in range(4) for m in _members(i).items()])
    with tarfile.open(path) as tf:
        at = tf.getmembers()[4].offset  # sample 1's first header
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x20
    path.write_bytes(bytes(raw))
    with pytest.raises(DatasetError) as exc:
        open_dataset(str(path.parent))
    assert str(exc.value) == f"{path}: not a readable tar archive: bad checksum"


def test_bad_labels_are_named_when_read(tmp_path):
    path = _broken(tmp_path, "cls.tar", [*_without(2, "000002.cls"), ("000002.cls", b"seven")])
    with open_dataset(os.path.dirname(path)) as r:
        with pytest.raises(DatasetError) as exc:
            r.read(2, "x")
        assert str(exc.value) == (
            f"{path}[000002.cls]: field 'cls': not a valid .cls file: not an integer class "
            "label: b'seven'"
        )
    # a float where sample 0 has an int; a bool, which numpy would cast to 1
    for label, kind in ((2.5, "<f8"), (True, "|b1")):
        meta = {k: v for k, v in _meta(2).items() if k != "params"} | {"label": label}
        doc = [("000002.json", json.dumps(meta).encode())]
        path = _broken(tmp_path, f"{kind[1]}.tar", [*_without(2, "000002.json"), *doc])
        with open_dataset(os.path.dirname(path)) as r:
            with pytest.raises(DatasetError) as exc:
                r.read(2, "label")
            assert (
                str(exc.value)
                == f"{path}[000002]: field 'label': sample 2 is {kind} (), sample 0 is <i8 ()"
            )
            with pytest.raises(DatasetError) as exc:
                r.read(2, "params")
            assert str(exc.value) == (
                f"{path}[000002]: field 'params': sample 2 has no such array (it has: cls, "
                "label, redshift, sim.box, x, y)"
            )


def _inspect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "datastore", "inspect", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_inspect_counts_samples_not_members(shards, tmp_path):
    out = _inspect(str(shards), "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert (summary["format"], summary["files"], summary["num_samples"]) == ("tar", 3, N)
    assert {n: (f["dtype"], f["shape"]) for n, f in summary["fields"].items()} == {
        "cls": ("<i8", []),
        "label": ("<i8", []),
        "redshift": ("<f8", []),
        "params": ("<i8", [2]),
        "sim.box": ("<i8", []),
        "x": ("<f4", [2, 4, 4, 4]),
        "y": ("<f4", [3]),
    }
    # a bad label in the last sample of the last shard: inspect looks at every sample
    bad = _broken(tmp_path, "late.tar", [*_without(9, "000009.cls"), ("000009.cls", b"1.5")])
    proc = _inspect(os.path.dirname(bad))
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == (
        f"datastore inspect: error: {bad}[000009.cls]: field 'cls': not a valid .cls file: "
        "not an integer class label: b'1.5'\n"
    )


def test_loader_delivers_fields_and_labels_in_batches(shards):
    loader = DataStoreLoader(str(shards), batch_size=4, seed=3, fields=["x", "cls", "redshift"])
    order = Schedule(N, 4, seed=3).order(0)
    steps = 0
    for step, batch in enumerate(loader):
        samples = [ORDER[k] for k in order[step * 4 : (step + 1) * 4]]
        assert sorted(batch) == ["cls", "redshift", "x"]
        assert batch["x"].dtype == torch.float32 and batch["x"].shape == (4, 2, 4, 4, 4)
        assert np.array_equal(batch["x"].numpy(), np.stack([_x(i) for i in samples]))
        assert batch["cls"].dtype == torch.int64
        assert batch["cls"].tolist() == [i % 4 for i in samples]
        assert batch["redshift"].tolist() == [float(_meta(i)["redshift"]) for i in samples]
        steps += 1
    assert steps == len(loader) == 2


def test_a_label_member_of_a_shard_replaced_after_it_was_read_is_refused(tmp_path):
    """A shard's ``.cls`` and ``.json`` members had no stamp: after the shard was replaced,
    the ``.npy`` member was refused but the labels read before were served (11, the shard
    held 21 now)."""

    def shard(label: int) -> None:
        members = [(f"{i}.x.npy", _npy(np.full(2, label + i, np.float32))) for i in range(2)]
        members += [(f"{i}.cls", f"{label + i}\n".encode()) for i in range(2)]
        members += [(f"{i}.json", json.dumps({"y": label + i}).encode()) for i in range(2)]
        _write_tar(tmp_path / "new.tar", members)
        os.replace(tmp_path / "new.tar", tmp_path / "shard-0.tar")

    shard(10)
    reader = open_dataset(str(tmp_path / "shard-0.tar"))
    out = {f: np.zeros((), np.int64) for f in ("cls", "y")}
    for f, got in out.items():
        reader.read(1, f, out=got)
    shard(20)
    path = tmp_path / "shard-0.tar"
    for f, got in out.items():
        with pytest.raises(DatasetError) as err:
            reader.read(1, f, out=got)
        assert (str(err.value), got.tolist()) == (
            f"{path}[1]: field {f!r}: cannot read sample 1: ValueError: {path} changed since "
            "the dataset was opened (replaced or rewritten): open it again to read the new data",
            11,
        )
    reader.close()
