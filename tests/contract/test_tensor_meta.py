"""``TensorMeta``: the seed's fields, ``nbytes``, and its JSON form (``to_dict``/``from_dict``)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

from ckpt_core import TensorMeta, split_weight_chunks
from ckpt_core.errors import WireFormatError
from ckpt_core.tensors import dtype_name, transferable_dtypes

GOOD = {"name": "w", "shape": [3, 5], "dtype": "float32", "chunk_offset": 8, "chunk_size": 4, "offset": 16}


def test_fields_follow_the_seed() -> None:
    fields = dataclasses.fields(TensorMeta)
    assert [f.name for f in fields] == ["name", "shape", "dtype", "chunk_offset", "chunk_size", "offset"]
    assert fields[-1].default is None
    meta = TensorMeta("w", torch.Size([2]), torch.float32, 0, 8)
    assert meta.offset is None


def test_an_engine_may_assign_offsets_to_split_metas() -> None:
    """NeMo RL's NIXL engine lays out its own buckets: it sets ``meta.offset`` on each meta
    ``split_weight_chunks`` yields, so a meta must take the assignment (as NeMo RL's does)."""
    ((meta, chunk),) = split_weight_chunks((item for item in [("w", torch.ones(4))]), 64)
    meta.offset = 32
    assert meta.offset == 32 and meta == TensorMeta("w", torch.Size([4]), torch.float32, 0, 16, 32)
    assert chunk.numel() == 16


@pytest.mark.parametrize(
    "shape,dtype,expected",
    [
        ([3, 5], torch.float32, 60),
        ([], torch.float64, 8),
        ([0, 7], torch.complex128, 0),
        ([2, 3], torch.bool, 6),
        ([4], torch.complex32, 16),
        ([9], torch.uint4, 9),  # type: ignore[attr-defined]  # torch's stubs omit the sub-byte dtypes
        ([1024, 1024], torch.bfloat16, 2 << 20),
    ],
)
def test_nbytes_is_the_whole_tensor(shape: list[int], dtype: torch.dtype, expected: int) -> None:
    meta = TensorMeta("w", torch.Size(shape), dtype, chunk_offset=0, chunk_size=1, offset=0)
    assert meta.nbytes == expected
    assert meta.nbytes == torch.empty(shape, dtype=dtype).nbytes


@pytest.mark.parametrize("dtype", transferable_dtypes(), ids=dtype_name)
def test_json_round_trip(dtype: torch.dtype) -> None:
    for shape in ([], [0], [2, 0, 3], [4, 5]):
        for offset in (None, 0, 24):
            size = torch.Size(shape).numel() * dtype.itemsize
            meta = TensorMeta("layers.0.mlp.weight", torch.Size(shape), dtype, size // 2, size - size // 2, offset)
            data = json.loads(json.dumps(meta.to_dict()))
            assert data["dtype"] == dtype_name(dtype) and isinstance(data["shape"], list)
            back = TensorMeta.from_dict(data)
            assert back == meta
            assert isinstance(back.shape, torch.Size) and back.dtype is dtype


def test_to_dict_is_plain_json_data() -> None:
    meta = TensorMeta("w", torch.Size([3, 5]), torch.float32, 8, 4, 16)
    assert meta.to_dict() == GOOD
    assert json.loads(json.dumps(meta.to_dict(), allow_nan=False)) == GOOD


def test_unicode_names_round_trip() -> None:
    meta = TensorMeta("gewichte.ß.层.🙂", torch.Size([1]), torch.int8, 0, 1, 0)
    assert TensorMeta.from_dict(json.loads(json.dumps(meta.to_dict()))) == meta


def _with(**changes: Any) -> dict[str, Any]:
    return {**GOOD, **changes}


def _without(key: str) -> dict[str, Any]:
    return {k: v for k, v in GOOD.items() if k != key}


MALFORMED: dict[str, Any] = {
    "not a mapping": [GOOD],
    "none": None,
    "string": json.dumps(GOOD),
    **{f"missing {key}": _without(key) for key in GOOD},
    "extra key": _with(extra=1),
    "name int": _with(name=3),
    "name none": _with(name=None),
    "shape tuple": _with(shape=(3, 5)),
    "shape int": _with(shape=15),
    "shape negative": _with(shape=[3, -5]),
    "shape bool": _with(shape=[True, 5]),
    "shape float": _with(shape=[3.0, 5]),
    "shape string": _with(shape=["3", 5]),
    "dtype unknown": _with(dtype="float9"),
    "dtype with torch prefix": _with(dtype="torch.float32"),
    "dtype int": _with(dtype=6),
    "dtype none": _with(dtype=None),
    "chunk_offset bool": _with(chunk_offset=True),
    "chunk_offset negative": _with(chunk_offset=-4),
    "chunk_offset float": _with(chunk_offset=8.0),
    "chunk_offset string": _with(chunk_offset="8"),
    "chunk_offset none": _with(chunk_offset=None),
    "chunk_size bool": _with(chunk_size=False),
    "chunk_size negative": _with(chunk_size=-1),
    "chunk_size float": _with(chunk_size=4.5),
    "offset bool": _with(offset=True),
    "offset negative": _with(offset=-16),
    "offset float": _with(offset=16.0),
    "chunk past the tensor end": _with(chunk_offset=56, chunk_size=8),
    "chunk starts past the end": _with(chunk_offset=61, chunk_size=0),
    "chunk in an empty tensor": _with(shape=[0, 5], chunk_offset=0, chunk_size=1),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_from_dict_rejects_malformed_data(case: str) -> None:
    with pytest.raises(WireFormatError):
        TensorMeta.from_dict(MALFORMED[case])


def test_from_dict_errors_say_what_is_wrong() -> None:
    with pytest.raises(WireFormatError, match="'w'.*chunk_offset.*-4"):
        TensorMeta.from_dict(_with(chunk_offset=-4))
    with pytest.raises(WireFormatError, match="float9"):
        TensorMeta.from_dict(_with(dtype="float9"))
    with pytest.raises(WireFormatError, match=r"\[56, 64\).*60"):
        TensorMeta.from_dict(_with(chunk_offset=56, chunk_size=8))
    with pytest.raises(WireFormatError, match="extra"):
        TensorMeta.from_dict(_with(extra=1))


@pytest.mark.parametrize("name", ["qint8", "quint8", "qint32", "quint4x2", "quint2x4"])
def test_from_dict_rejects_quantized_dtypes(name: str) -> None:
    """Quantized dtypes are not transferable (their scale is not in their bytes): a peer that
    names one sent something ``split_weight_chunks`` never produces."""
    with pytest.raises(WireFormatError, match=name):
        TensorMeta.from_dict(_with(dtype=name, shape=[4], chunk_offset=0, chunk_size=0))


@pytest.mark.parametrize("shape", [[2**63], [2**70], [2**40, 2**40], [2**31, 2**31, 2]], ids=str)
def test_from_dict_rejects_shapes_too_large_for_torch(shape: list[int]) -> None:
    """Sizes past int64 must not reach ``torch.Size`` (which overflows or wraps to 0)."""
    with pytest.raises(WireFormatError):
        TensorMeta.from_dict(_with(shape=shape, chunk_offset=0, chunk_size=0))
