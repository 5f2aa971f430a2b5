"""ckpt_core._internal.device_checksum on the host: deterministic, and it notices the faults it claims to."""

from __future__ import annotations

import pytest
import torch

from ckpt_core._internal.device_checksum import ROW_WORDS, device_payload_checksum

ROW_BYTES = ROW_WORDS * 8


def _payload(nbytes: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 9, 8 * 100 + 3, ROW_BYTES, ROW_BYTES + 5, 3 * ROW_BYTES + 8 * 17 + 6])
def test_digest_is_a_deterministic_64_bit_int_of_the_bytes(nbytes):
    payload = _payload(nbytes)
    digest = device_payload_checksum(payload)
    assert isinstance(digest, int) and 0 <= digest < 2**64
    assert device_payload_checksum(payload.clone()) == digest
    if nbytes:
        assert device_payload_checksum(payload[:-1]) != digest  # the length is part of it


def test_an_unaligned_view_gives_the_same_digest_as_the_same_bytes_aligned():
    base = _payload(4 * ROW_BYTES + 11)
    view = base[3 : 3 + 2 * ROW_BYTES + 5]
    assert device_payload_checksum(view) == device_payload_checksum(view.clone())


@pytest.mark.parametrize("position", [0, 5, 8 * 77 + 2, ROW_BYTES - 1, ROW_BYTES + 8 * 3, 3 * ROW_BYTES + 2])
@pytest.mark.parametrize("bit", [0, 7])
def test_every_single_bit_flip_changes_the_digest(position, bit):
    payload = _payload(3 * ROW_BYTES + 8 * 20 + 3)
    digest = device_payload_checksum(payload)
    payload[position] ^= 1 << bit
    assert device_payload_checksum(payload) != digest


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (0, 8),  # neighbouring words in one row
        (8 * 5, ROW_BYTES + 8 * 5),  # same column, different rows
        (8 * 3, 2 * ROW_BYTES + 8 * 100),  # different row and column
        (2 * ROW_BYTES + 8, 3 * ROW_BYTES + 8),  # a full-row word and a tail word
        (3 * ROW_BYTES + 8 * 20, 3 * ROW_BYTES + 8 * 20 + 1),  # the trailing bytes
    ],
)
def test_swapping_two_unequal_pieces_changes_the_digest(first, second):
    payload = _payload(3 * ROW_BYTES + 8 * 20 + 3, seed=1)
    width = 1 if second - first == 1 else 8
    digest = device_payload_checksum(payload)
    a, b = payload[first : first + width].clone(), payload[second : second + width].clone()
    assert not torch.equal(a, b)
    payload[first : first + width], payload[second : second + width] = b, a
    assert device_payload_checksum(payload) != digest


def test_a_stale_or_shifted_region_changes_the_digest():
    payload = _payload(2 * ROW_BYTES, seed=2)
    digest = device_payload_checksum(payload)
    shifted = payload.clone()
    shifted[8:ROW_BYTES] = payload[: ROW_BYTES - 8].clone()  # one region moved by a word
    assert device_payload_checksum(shifted) != digest
    stale = payload.clone()
    stale[ROW_BYTES:] = 0
    assert device_payload_checksum(stale) != digest


def test_non_byte_tensors_are_refused():
    with pytest.raises(ValueError, match="1-D uint8"):
        device_payload_checksum(torch.zeros(4, dtype=torch.float32))
    with pytest.raises(ValueError, match="1-D uint8"):
        device_payload_checksum(torch.zeros(2, 2, dtype=torch.uint8))
