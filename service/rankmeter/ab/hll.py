"""Distinct users per arm: Redis's HyperLogLog, read and reproduced in NumPy.

Redis counts an arm's users with PFADD into one key per partition (redis_store.py); a
look reads each key with GET and merges the partitions here, because PFCOUNT of several
keys needs them in one slot and a partition's keys each have their own (Redis Cluster).
The memory store keeps the same registers with the same hash (:func:`add`), so both
stores give the same count for the same users.

Redis's layout (src/hyperloglog.c, Redis ≥ 5): 2^14 = 16,384 registers; an element's
64-bit MurmurHash64A (seed 0xadc83b19) gives the register (its low 14 bits) and the
value (1 + the number of trailing zeros of the other 50 bits, at most 51); a register
keeps the largest value. A key is a 16-byte header ("HYLL", the encoding: 0 dense, 1
sparse, 3 unused bytes, 8 bytes of cached cardinality) and either 12,288 bytes of 6-bit
registers (dense) or run-length opcodes (sparse, up to ``hll-sparse-max-bytes``, 3,000 by
default, then converted to dense). The count is Ertl's improved estimator ("New
cardinality estimation algorithms for HyperLogLog sketches", 2017), as ``hllCount``.

Its relative standard error is about 1.04/√16384 ≈ 0.81% (below ~0.6% up to a few
thousand elements per key), whatever the number of users: it does not shrink as they
grow, and it is a fixed function of the set of users (ab/users.py accounts for both).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["REGISTERS", "RELATIVE_ERROR", "add", "count", "dense", "element", "parse", "user_hashes"]

P = 14
REGISTERS = 1 << P
Q = 64 - P                     # the bits that give a register's value
#: The relative standard error of one count (Flajolet et al. 2007: 1.04/√m).
RELATIVE_ERROR = 1.04 / math.sqrt(REGISTERS)
_M = np.uint64(0xC6A4A7935BD1E995)
_SEED = 0xADC83B19
_DENSE_BYTES = (REGISTERS * 6 + 7) // 8
_MAGIC = b"HYLL"


def element(user_hash: int) -> bytes:
    """What is added for a user: their 64-bit hash (ab/clusters.py `user_hash`), 8 bytes big-endian."""
    return user_hash.to_bytes(8, "big")


def _murmur(elements: np.ndarray) -> np.ndarray:
    """MurmurHash64A (Redis's ``MurmurHash64A(ele, 8, 0xadc83b19)``) of 8-byte elements,
    given as the unsigned integers their bytes are read as little-endian (one block, no tail)."""
    m, r = _M, np.uint64(47)
    h = np.full(elements.shape, np.uint64(_SEED ^ ((8 * 0xC6A4A7935BD1E995) & 0xFFFFFFFFFFFFFFFF)))
    with np.errstate(over="ignore"):
        k = elements * m
        k ^= k >> r
        k *= m
        h ^= k
        h *= m
        h ^= h >> r
        h *= m
        h ^= h >> r
    return h


def user_hashes(user_hash: np.ndarray) -> np.ndarray:
    """The 64-bit Murmur hash Redis computes of each user's :func:`element` (vectorised)."""
    big_endian = np.asarray(user_hash, dtype=np.uint64)
    return _murmur(big_endian.byteswap())   # the element's bytes, read little-endian


def add(registers: np.ndarray, user_hash: np.ndarray) -> None:
    """PFADD the users (their 64-bit hashes) into ``registers`` (uint8, REGISTERS), in place."""
    h = user_hashes(user_hash)
    index = (h & np.uint64(REGISTERS - 1)).astype(np.intp)
    rest = (h >> np.uint64(P)) | np.uint64(1 << Q)
    lowest = rest & (~rest + np.uint64(1))          # the lowest set bit, a power of two
    value = (np.log2(lowest.astype(np.float64)) + 1).astype(np.uint8)
    np.maximum.at(registers, index, value)


def count(registers: np.ndarray) -> float:
    """Ertl's improved estimate of the distinct elements (Redis's ``hllCount``), over the
    last axis: a float, or an array for a stack of register sets."""
    r = np.asarray(registers)
    flat = r.reshape(-1, REGISTERS)
    out = np.array([_estimate(np.bincount(row, minlength=Q + 2)) for row in flat])
    return float(out[0]) if r.ndim == 1 else out.reshape(r.shape[:-1])


def _estimate(histogram: np.ndarray) -> float:
    m = float(REGISTERS)
    z = m * _tau((m - histogram[Q + 1]) / m)
    for j in range(Q, 0, -1):
        z = (z + histogram[j]) * 0.5
    z += m * _sigma(histogram[0] / m)
    return float(round(0.5 / math.log(2) * m * m / z))


def _sigma(x: float) -> float:
    if x == 1.0:
        return math.inf
    y, z = 1.0, x
    while True:
        x *= x
        before = z
        z += x * y
        y += y
        if z == before:
            return z


def _tau(x: float) -> float:
    if x == 0.0 or x == 1.0:
        return 0.0
    y, z = 1.0, 1.0 - x
    while True:
        x = math.sqrt(x)
        before = z
        y *= 0.5
        z -= (1.0 - x) ** 2 * y
        if z == before:
            return z / 3.0


def parse(data: bytes) -> np.ndarray:
    """The registers of a stored Redis HyperLogLog (dense or sparse). ValueError when the
    bytes are not one (another type's value, a truncated or foreign string)."""
    if len(data) < 16 or data[:4] != _MAGIC:
        raise ValueError("not a Redis HyperLogLog (no HYLL header)")
    body = np.frombuffer(data, dtype=np.uint8, offset=16)
    if data[4] == 0:
        if len(body) != _DENSE_BYTES:
            raise ValueError(f"a dense HyperLogLog of {len(body)} bytes, not {_DENSE_BYTES}")
        bits = np.unpackbits(body, bitorder="little").reshape(REGISTERS, 6)
        return (bits @ (1 << np.arange(6))).astype(np.uint8)
    if data[4] != 1:
        raise ValueError(f"unknown HyperLogLog encoding {data[4]}")
    if len(body) > REGISTERS:  # (at least one register an opcode: a longer one is no count, and slow to walk)
        raise ValueError(f"a sparse HyperLogLog of {len(body)} bytes, more than {REGISTERS}")
    registers, i, at = np.zeros(REGISTERS, dtype=np.uint8), 0, 0
    raw = bytes(body)
    while i < len(raw):
        op = raw[i]
        if op & 0x80:                    # VAL: 1vvvvvxx, value vvvvv + 1 repeated xx + 1 times
            run = (op & 0x3) + 1
            if at + run > REGISTERS:
                break
            registers[at:at + run] = ((op >> 2) & 0x1F) + 1
        elif op & 0x40:                  # XZERO: 01xxxxxx yyyyyyyy, 1 to 16,384 zeros
            if i + 1 >= len(raw):
                raise ValueError("a sparse HyperLogLog cut inside an opcode")
            run = (((op & 0x3F) << 8) | raw[i + 1]) + 1
            i += 1
        else:                            # ZERO: 00xxxxxx, 1 to 64 zeros
            run = (op & 0x3F) + 1
        at += run
        i += 1
    if at != REGISTERS:
        raise ValueError(f"a sparse HyperLogLog of {at} registers, not {REGISTERS}")
    return registers


def dense(registers: np.ndarray) -> bytes:
    """Registers as Redis stores a dense HyperLogLog (its cached cardinality marked stale)."""
    bits = ((registers.astype(np.uint8)[:, None] >> np.arange(6)) & 1).astype(np.uint8).reshape(-1)
    header = _MAGIC + bytes([0, 0, 0, 0]) + bytes(7) + bytes([0x80])
    return header + np.packbits(bits, bitorder="little").tobytes()
