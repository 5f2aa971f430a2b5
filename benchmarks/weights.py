"""Benchmark payloads, as weights factories (``"module:function"`` targets, see
:mod:`ckpt_core.orchestration.workload`).

The harness writes each transformer-shaped payload once (:func:`write_payload`), one file per
tensor, into a directory on tmpfs. Every worker maps those files shared (:func:`mapped_weights`),
so the many worker processes of one run hold a payload once in physical memory, and each tensor
still has its own storage, as in a trainer's state dict. Reading a mapped page costs what reading
an anonymous one does once the mapping is populated, which the warm-up refit of every case does.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ckpt_core.bench.synthetic import transformer_shapes
from ckpt_core.tensors import dtype_from_name, dtype_name

MANIFEST = "manifest.json"
Weights = tuple[tuple[str, torch.Tensor], ...]


@dataclasses.dataclass(frozen=True)
class Payload:
    """One payload on disk: where it is and what it holds."""

    label: str
    payload_bytes: int
    tensors: int
    largest_tensor_bytes: int
    weights: str
    """The weights factory, ``"module:function"``."""
    weights_params: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def write_payload(directory: Path, size_bytes: int, *, label: str, seed: int = 0) -> Payload:
    """Write a transformer-shaped state dict of about ``size_bytes`` (random bits, every byte
    pattern exercised) into the new directory ``directory``: one raw file per tensor and a JSON
    manifest."""
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    entries: list[dict[str, Any]] = []
    for index, (name, shape, dtype) in enumerate(transformer_shapes(size_bytes)):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        raw = torch.randint(-(2**31), 2**31 - 1, ((nbytes + 3) // 4,), dtype=torch.int32, generator=generator)
        file = f"{index:05d}.bin"
        raw.view(torch.uint8)[:nbytes].numpy().tofile(directory / file)
        entries.append({"name": name, "shape": list(shape), "dtype": dtype_name(dtype), "file": file, "nbytes": nbytes})
    manifest = {"label": label, "tensors": entries}
    (directory / MANIFEST).write_text(json.dumps(manifest))
    return Payload(
        label=label,
        payload_bytes=sum(e["nbytes"] for e in entries),
        tensors=len(entries),
        largest_tensor_bytes=max(e["nbytes"] for e in entries),
        weights="benchmarks.weights:mapped_weights",
        weights_params={"dir": str(directory)},
    )


def _map(directory: str) -> Weights:
    manifest = json.loads((Path(directory) / MANIFEST).read_text())
    weights = []
    for entry in manifest["tensors"]:
        dtype = dtype_from_name(entry["dtype"])
        shape = tuple(entry["shape"])
        numel = torch.Size(shape).numel()
        if numel == 0:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            path = os.path.join(directory, entry["file"])
            tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
        weights.append((entry["name"], tensor))
    return tuple(weights)


_current: tuple[str, Weights] | None = None


def load_payload(directory: str) -> Weights:
    """The payload in ``directory``, mapped once per process. Only the latest payload stays
    mapped: selecting another drops the previous mappings first."""
    global _current
    if _current is None or _current[0] != directory:
        _current = None
        _current = (directory, _map(directory))
    return _current[1]


def mapped_weights(params: dict[str, Any], *, refit_index: int, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``params = {"dir": str}``: the tensors of a payload written by :func:`write_payload`."""
    yield from load_payload(str(params["dir"]))


@functools.lru_cache(maxsize=1)
def _small(count: int, nbytes: int) -> Weights:
    if count < 1 or nbytes < 4 or nbytes % 4:
        raise ValueError(f"need count >= 1 and nbytes a positive multiple of 4, got {count}, {nbytes}")
    source = torch.randint(
        -(2**31), 2**31 - 1, (count, nbytes // 4), dtype=torch.int32, generator=torch.Generator().manual_seed(7)
    ).view(torch.float32)
    return tuple((f"blocks.{i}.weight", source[i].clone()) for i in range(count))


def small_payload(count: int, nbytes: int) -> Payload:
    """The per-tensor overhead payload: ``count`` tensors of ``nbytes`` (see :func:`small_tensors`)."""
    return Payload(
        label=f"{count}x{nbytes}B",
        payload_bytes=count * nbytes,
        tensors=count,
        largest_tensor_bytes=nbytes,
        weights="benchmarks.weights:small_tensors",
        weights_params={"count": count, "nbytes": nbytes},
    )


def small_tensors(params: dict[str, Any], *, refit_index: int, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``params = {"count": int, "nbytes": int}``: ``count`` float32 tensors of ``nbytes`` each,
    each with its own storage, materialized once per process (the per-tensor overhead case)."""
    yield from _small(int(params["count"]), int(params["nbytes"]))


@functools.lru_cache(maxsize=1)
def _on_device(size_bytes: int, device: str, seed: int) -> Weights:
    target = torch.device(device)
    generator = torch.Generator(device=target).manual_seed(seed)
    weights = []
    for name, shape, dtype in transformer_shapes(size_bytes):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        raw = torch.randint(
            -(2**31), 2**31 - 1, ((nbytes + 3) // 4,), dtype=torch.int32, generator=generator, device=target
        )
        weights.append((name, raw.view(torch.uint8)[:nbytes].view(dtype).reshape(shape).clone()))
    return tuple(weights)


def device_weights(params: dict[str, Any], *, refit_index: int, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``params = {"size_bytes": int, "device": str, "seed": int = 0}``: a transformer-shaped
    state dict generated on ``device`` (a GPU, for :mod:`benchmarks.gpu`), once per process."""
    yield from _on_device(int(params["size_bytes"]), str(params["device"]), int(params.get("seed", 0)))
