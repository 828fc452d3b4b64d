"""`read_gguf` reads what gguf's own GGUFReader reads, value for value and byte for byte (it only
reads it ~30x faster), and refuses a file that is not a whole GGUF with a clear error."""

from pathlib import Path

import gguf
import numpy as np
import pytest

from kvpark.pod.model import gguf_file
from kvpark.pod.model.gguf_file import dequantize, read_gguf
from kvpark.pod.model.loader import builtin_gguf_path


def as_gguf_reader_sees_it(path: Path) -> tuple[dict, list]:
    reader = gguf.GGUFReader(path)
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return metadata, reader.tensors


def assert_same_as_gguf_reader(path: Path) -> None:
    ours = read_gguf(path)
    metadata, tensors = as_gguf_reader_sees_it(path)
    assert ours.metadata == metadata
    assert [t.name for t in ours.tensors] == [t.name for t in tensors]
    for mine, theirs in zip(ours.tensors, tensors):
        assert mine.shape == tuple(int(d) for d in theirs.shape), mine.name
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert np.array_equal(mine.data, theirs.data), mine.name


def test_the_builtin_model_reads_as_gguf_reads_it():
    assert_same_as_gguf_reader(builtin_gguf_path())


@pytest.fixture
def every_kind(tmp_path) -> Path:
    """A file with every metadata value type and float, integer and block tensors."""
    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for add, value in ((writer.add_uint8, 7), (writer.add_int8, -7), (writer.add_uint16, 700),
                       (writer.add_int16, -700), (writer.add_uint32, 70000),
                       (writer.add_int32, -70000), (writer.add_float32, 0.1),
                       (writer.add_uint64, 2**40), (writer.add_int64, -(2**40)),
                       (writer.add_float64, 0.1), (writer.add_bool, True),
                       (writer.add_string, "héllo ✓")):
        add(f"test.{add.__name__}", value)
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, 1.5])
    writer.add_array("test.strings", ["a", "", "Ġthe", "<|im_end|>"])
    writer.add_array("test.bools", [True, False])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    writer.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
    for kind in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1):
        values = rng.standard_normal((4, 64)).astype(np.float32)
        writer.add_tensor(kind.name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_value_type_and_tensor_kind_reads_as_gguf_reads_it(every_kind):
    assert_same_as_gguf_reader(every_kind)
    metadata = read_gguf(every_kind).metadata
    assert metadata["test.add_string"] == "héllo ✓" and metadata["test.add_bool"] is True
    assert metadata["test.strings"] == ["a", "", "Ġthe", "<|im_end|>"]


def test_block_tensors_dequantize_as_gguf_reader_gives_them(every_kind):
    ours = {t.name: t for t in read_gguf(every_kind).tensors}
    for t in gguf.GGUFReader(every_kind).tensors:
        if t.tensor_type is gguf.GGMLQuantizationType.I32:
            continue  # integers are not dequantised (gguf has no such path)
        assert np.array_equal(gguf.quants.dequantize(ours[t.name].data, t.tensor_type),
                              gguf.quants.dequantize(t.data, t.tensor_type))


# every block kind gguf dequantises (K-quants and IQ kinds included)
BLOCK_KINDS = [k for k in gguf.GGMLQuantizationType if k not in gguf_file.TYPED_TENSORS
               and hasattr(getattr(gguf.quants, k.name, None), "dequantize_rows")]


@pytest.mark.parametrize("rows_a_group", [1, 3, 1000])
@pytest.mark.parametrize("kind", BLOCK_KINDS, ids=lambda k: k.name)
def test_dequantize_gives_the_bytes_gguf_gives(kind, rows_a_group, monkeypatch):
    """`dequantize` runs gguf's own block arithmetic over groups of DEQUANTIZE_GROUP_VALUES
    values (gguf's own loop: 16 rows): one call a group, and the same float32 bytes in the same
    shape, for a group of one row, groups with a remainder (14 rows in threes) and one group, of
    a 3-D tensor of random blocks. (The kinds the C kernel takes go to it where it loads:
    tests/unit/test_dequantize.py; here every kind takes gguf's path.)"""
    monkeypatch.setattr(gguf_file.c_dequantize, "can_take", lambda kind: False)
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    per_row = 2 * max(block_size, 256)  # two K-quant blocks, or several small ones
    raw = np.random.default_rng(kind.value).integers(
        0, 256, (2, 7, per_row // block_size * type_size), dtype=np.uint8)
    monkeypatch.setattr(gguf_file, "DEQUANTIZE_GROUP_VALUES", rows_a_group * per_row)
    quant = getattr(gguf.quants, kind.name)
    rows_of, groups = quant.dequantize_rows, []
    with np.errstate(all="ignore"):  # random scales overflow, alike in both
        theirs = gguf.quants.dequantize(raw, kind)
        monkeypatch.setattr(quant, "dequantize_rows",
                            lambda rows: groups.append(len(rows)) or rows_of(rows))
        ours = dequantize(raw, kind)
    assert groups == [min(rows_a_group, 14 - i) for i in range(0, 14, rows_a_group)]
    assert ours.dtype == theirs.dtype == np.float32
    assert ours.shape == theirs.shape == (2, 7, per_row)
    assert ours.tobytes() == theirs.tobytes()


@pytest.mark.parametrize("keep,message", [(3, "not a GGUF file"), (40, "not a whole GGUF file"),
                                          (None, "not a GGUF file")])
def test_a_file_that_is_not_a_whole_gguf_is_refused_clearly(every_kind, tmp_path, keep, message):
    bad = tmp_path / "bad.gguf"
    data = every_kind.read_bytes()
    bad.write_bytes(b"NOPE" + data[4:] if keep is None else data[:keep])
    with pytest.raises(ValueError, match=message):
        read_gguf(bad)


def test_a_tensor_cut_off_by_the_end_of_the_file_is_refused(every_kind, tmp_path):
    bad = tmp_path / "short.gguf"
    bad.write_bytes(every_kind.read_bytes()[:-10])
    with pytest.raises(ValueError, match="not a whole GGUF file .tensor 'Q4_1' runs past"):
        read_gguf(bad)
