"""Shared reads: small pieces of a load fetched once per chunk object, not once per rank.

On an object store every read is a request, and a request costs the same for 4 KiB as for
4 MiB. A load of many small shards (grouped chunks hold one inner chunk per saved shard,
spec Appendix C.1) makes each rank read, per chunk object, its shard index and then its
inner chunk: two requests per rank per chunk, 2 x arrays x ranks for the job (16,024 GETs
for 1,000 small arrays on 8 ranks; 4.4 million for a 70B model at 1,024 ranks), where the
checkpoint has only as many objects as chunks. Here each chunk object has one **owner**
rank (a hash of its key, so the reading spreads over the ranks); the other ranks send it
what they need of that chunk, it fetches the object with one GET, decodes it (the spec's
uncompressed chains, every CRC-32C checked) and sends each rank its pieces over the process
group. Requests: about one per chunk object for the whole job.

The load-side mirror of the save's exchange (:mod:`zarrckpt.api.save`), in rounds of
about ``round_bytes`` of pieces per rank so memory stays bounded: each rank keeps at most a
round of its own pieces and of the pieces it serves, plus the chunk being decoded.
A piece is one chunk's part of one target region, of at most ``piece_bytes``; larger
pieces, compressed chains and packed leaves are read by each rank itself, as before.
An owner asked for less than half of a chunk reads just those boxes (its usual reads).

Every rank takes part in every collective of a round, also after a local failure: a
failure is shared by one all-reduce before each exchange, and the load then fails on every
rank (at C2 of :func:`zarrckpt.load`).
"""

from __future__ import annotations

import json
import math
import zlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np
import torch

from ..distributed import group as zdist
from ..errors import CorruptChunkError
from ..format import dtypes
from ..format.layout import slices as _slices
from ..storage import ChunkCodec, check_index, chunk_codec, inner_offset, misplaced
from ..storage.inflight import wait_all

__all__ = ["PIECE_BYTES", "Piece", "ROUND_BYTES", "decode", "owner", "run", "split"]

Box = tuple[tuple[int, int], ...]

PIECE_BYTES = 4 << 20  # pieces up to this size are read through their chunk's owner
ROUND_BYTES = 256 << 20  # pieces of one rank per round
_ALIGN = 16  # pieces start at multiples of this in the buffers exchanged (views of any dtype)


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    """(offsets, total) of pieces of these sizes, each starting at a multiple of _ALIGN."""
    pos, at = [], 0
    for n in sizes:
        pos.append(at)
        at += -(-n // _ALIGN) * _ALIGN
    return pos, at


@dataclass
class Piece:
    key: str  # the checkpoint key
    index: tuple[int, ...]  # the chunk
    box: Box  # global box, inside the chunk
    dst: torch.Tensor  # where it goes (a view of the target)
    nbytes: int  # stored bytes


def split(ckpt: Any, infos: dict, todo: list, piece_bytes: int = PIECE_BYTES) -> tuple[list, list[Piece]]:
    """(the reads left to each rank, the pieces to read through owners) of a load's
    ``todo`` list of ``(key, [(global box, local box)], local target)``."""
    rest, pieces = [], []
    for key, boxes, local in todo:
        info = infos[key]
        codec = None if ckpt.is_packed(key) else chunk_codec(info.metadata)
        if codec is None:
            rest.append((key, boxes, local))
            continue
        itemsize = info.dtype.numpy.itemsize
        keep = []
        for gbox, lbox in boxes:
            if any(a == b for a, b in gbox):
                continue
            mine = list(_per_chunk(gbox, lbox, codec.chunk))
            if max(math.prod(b - a for a, b in g) for _, g, _ in mine) * itemsize > piece_bytes:
                keep.append((gbox, lbox))
                continue
            for index, g, lb in mine:
                dst = local[_slices(lb)] if lb else local
                pieces.append(Piece(key, index, g, dst, math.prod(b - a for a, b in g) * itemsize))
        if keep:
            rest.append((key, keep, local))
    return rest, pieces


def _per_chunk(gbox: Box, lbox: Box, chunk: tuple[int, ...]):
    """(chunk index, global box, local box) of ``gbox``'s part in each chunk it meets."""
    first = [a // c for (a, _), c in zip(gbox, chunk)]
    last = [(b - 1) // c for (_, b), c in zip(gbox, chunk)]
    for off in np.ndindex(*[l - f + 1 for f, l in zip(first, last)]):
        index = tuple(f + o for f, o in zip(first, off))
        g = tuple((max(a, i * c), min(b, (i + 1) * c)) for (a, b), i, c in zip(gbox, index, chunk))
        lb = tuple((la + ga - a, la + gb - a) for (ga, gb), (a, _), (la, _) in zip(g, gbox, lbox)) if lbox else lbox
        yield index, g, lb


def owner(key: str, index: tuple[int, ...], world: int) -> int:
    return zlib.crc32(f"{key}/{'/'.join(map(str, index))}".encode()) % world


def run(g: zdist.Group, ckpt: Any, make_pieces: Any, *, round_bytes: int = ROUND_BYTES) -> dict:
    """Read the pieces ``make_pieces()`` returns through their chunks' owners. Collective
    over ``g`` (every rank calls it, with or without pieces, whatever fails). Returns
    counters (bytes needed here, bytes fetched here as an owner, chunk objects fetched
    whole, rounds). Raises this rank's error, if any; a rank whose peers failed returns
    early (the load's C2 agreement fails it)."""
    world, me = g.size, g.rank
    stats = {"bytes_needed": 0, "bytes_fetched": 0, "whole_chunks": 0, "rounds": 0, "requests_sent": 0}
    error: BaseException | None = None
    asks: dict[int, list[int]] = defaultdict(list)  # owner -> my pieces it serves, in order
    rounds_of: list[int] = []
    pieces: list[Piece] = []
    try:
        pieces = make_pieces()
        order = sorted(range(len(pieces)), key=lambda i: (pieces[i].key, pieces[i].index, pieces[i].box))
        acc = 0
        rounds_of = [0] * len(pieces)
        for i in order:
            rounds_of[i] = acc // round_bytes
            acc += pieces[i].nbytes
            asks[owner(pieces[i].key, pieces[i].index, world)].append(i)
        stats["bytes_needed"] = acc
        payload = {o: json.dumps([[pieces[i].key, pieces[i].index, pieces[i].box, rounds_of[i]] for i in idx]
                                 ).encode() for o, idx in asks.items()}
    except BaseException as e:  # noqa: BLE001 - shared below
        error, asks, payload = e, defaultdict(list), {}
    mine_rounds = max(rounds_of, default=-1) + 1
    views = g.all_gather([error is None, mine_rounds, [len(payload.get(o, b"")) for o in range(world)]])
    if not all(v[0] for v in views):
        if error is not None:
            raise error
        return stats
    rounds = max(v[1] for v in views)
    stats["rounds"] = rounds
    # the requests themselves
    sends = [(g.global_rank(o), torch.frombuffer(bytearray(p), dtype=torch.uint8)) for o, p in payload.items()
             if o != me and p]
    recvs = [(r, torch.empty(views[r][2][me], dtype=torch.uint8)) for r in range(world)
             if r != me and views[r][2][me]]
    g.exchange(sends, [(g.global_rank(r), t) for r, t in recvs])
    stats["requests_sent"] = len(sends)
    served: dict[int, list] = {}  # requester -> [(key, index, box, round)]
    for r, t in recvs:
        served[r] = [(k, tuple(i), tuple(tuple(x) for x in b), rd) for k, i, b, rd in json.loads(bytes(t.numpy()))]
    if me in asks:
        served[me] = [(pieces[i].key, pieces[i].index, pieces[i].box, rounds_of[i]) for i in asks[me]]
    for k in range(rounds):
        out: dict[int, np.ndarray] = {}
        try:
            if error is None:
                out = _serve(ckpt, {r: [q for q in qs if q[3] == k] for r, qs in served.items()}, stats)
        except BaseException as e:  # noqa: BLE001 - shared below
            error = e
        if not g.all_true(error is None):
            if error is not None:
                raise error
            return stats
        sends = [(g.global_rank(r), torch.from_numpy(buf)) for r, buf in out.items() if r != me and buf.size]
        want = {o: [i for i in idx if rounds_of[i] == k] for o, idx in asks.items()}
        recvs = [(o, torch.empty(_layout([pieces[i].nbytes for i in idx])[1], dtype=torch.uint8))
                 for o, idx in want.items() if idx and o != me]
        g.exchange(sends, [(g.global_rank(o), t) for o, t in recvs])
        got = list(recvs)
        if want.get(me):
            got.append((me, torch.from_numpy(out[me])))
        try:
            _unpack(ckpt, pieces, want, got)
        except BaseException as e:  # noqa: BLE001 - shared at the next round's check, or below
            error = error or e
    if not g.all_true(error is None) and error is not None:
        raise error
    return stats


def _unpack(ckpt: Any, pieces: list[Piece], want: dict[int, list[int]], got: list) -> None:
    """Copy the received buffers' pieces into their targets (casting as the target needs)."""
    with torch.no_grad():
        for o, t in got:
            for i, at in zip(want[o], _layout([pieces[i].nbytes for i in want[o]])[0]):
                p = pieces[i]
                saved = dtypes.torch_dtype(ckpt.array_info(p.key).dtype)
                p.dst.copy_(t[at:at + p.nbytes].view(saved).reshape(tuple(b - a for a, b in p.box)))


def _serve(ckpt: Any, asked: dict[int, list], stats: dict) -> dict[int, np.ndarray]:
    """One round of an owner: fetch the chunks asked for, and per requester one buffer
    holding its pieces in the order it asked for them."""
    chunks: dict[tuple, list[tuple[int, int, Box]]] = defaultdict(list)  # (key, index) -> (requester, pos, box)
    out: dict[int, np.ndarray] = {}
    offsets: dict[int, list[int]] = {}
    for r, qs in asked.items():
        sizes = []
        for j, (key, index, box, _) in enumerate(qs):
            sizes.append(math.prod(b - a for a, b in box) * ckpt.array_info(key).dtype.numpy.itemsize)
            chunks[(key, index)].append((r, j, box))
        offsets[r], total = _layout(sizes)
        out[r] = np.empty(total, np.uint8)
    storage = ckpt.storage
    by_key = list(chunks.items())
    whole = []
    reads = []
    for (key, index), users in by_key:
        info = ckpt.array_info(key)
        codec = chunk_codec(info.metadata)
        cbox = tuple((i * c, min((i + 1) * c, n)) for i, c, n in zip(index, codec.chunk, info.shape))
        asked_elems = sum(math.prod(b - a for a, b in box) for _, _, box in users)
        if 2 * asked_elems >= math.prod(b - a for a, b in cbox):
            whole.append((key, index, users, codec, cbox))
        else:  # a small part of a large chunk: read those boxes only
            for r, j, box in users:
                reads.append((key, ckpt.read_into(key, box, _view(out[r], offsets[r][j], box, info.dtype.numpy))))
                stats["bytes_fetched"] += math.prod(b - a for a, b in box) * info.dtype.numpy.itemsize
    futures = [storage.get(f"{ckpt._full(key)}/{codec.chunk_key(index)}") for key, index, _, codec, _ in whole]
    positions = {key: ckpt.unit_crcs(key) for key in {w[0] for w in whole}}  # each table decoded once
    for (key, index, users, codec, cbox), fut in zip(whole, futures):
        raw = fut.result()
        where = f"chunk {codec.chunk_key(index)} of {key!r}"
        if raw is None:
            raise CorruptChunkError(f"{where} is missing from storage")
        stats["bytes_fetched"] += len(raw)
        stats["whole_chunks"] += 1
        data = decode(raw, codec, index, cbox, where, positions[key])
        for r, j, box in users:
            sub = data[tuple(slice(a - c0, b - c0) for (a, b), (c0, _) in zip(box, cbox))]
            _view(out[r], offsets[r][j], box, codec.dtype)[...] = sub
    wait_all(reads)
    return out


def _view(buf: np.ndarray, at: int, box: Box, dtype: np.dtype) -> np.ndarray:
    n = math.prod(b - a for a, b in box) * dtype.itemsize
    return buf[at:at + n].view(dtype).reshape(tuple(b - a for a, b in box))


def decode(raw: bytes, codec: ChunkCodec, index: tuple[int, ...], cbox: Box, where: str,
           positions: np.ndarray | None = None) -> np.ndarray:
    """The values of one chunk object (the part inside the array: ``cbox``) from its bytes,
    for the two uncompressed chains of spec §5.5, every checksum checked; with ``positions``
    (format 1.3, spec §6.6) each checked CRC-32C must also be the one recorded for its place."""
    mv = memoryview(raw)
    out = np.empty(tuple(b - a for a, b in cbox), codec.dtype)
    enc = codec.inner_nbytes + 4

    def placed(crc: Any, j: tuple[int, ...], at: str) -> None:
        if positions is not None:
            got, want = int.from_bytes(crc, "little"), int(positions[codec.unit_linear(index, j)])
            if got != want:
                raise misplaced(at, got, want)

    if not codec.sharded:
        if len(mv) != enc:
            raise CorruptChunkError(f"{where}: {len(mv)} bytes, expected {enc}")
        _check(mv[:-4], mv[-4:], where)
        placed(mv[-4:], (0,) * len(index), where)
        tile = np.frombuffer(mv[:-4], np.uint8).view(codec.dtype).reshape(codec.chunk)
        out[...] = tile[tuple(slice(0, b - a) for a, b in cbox)]
        return _bools(out, where)
    n = codec.index_nbytes
    if len(mv) < n:
        raise CorruptChunkError(f"{where} is truncated: {len(mv)} bytes, the index alone is {n}")
    end = len(mv) - n
    _check(mv[end:-4], mv[-4:], where + " (its shard index)")
    table = np.frombuffer(mv[end:-4], dtype="<u8").reshape(codec.count, 2)
    check_index(table, codec, end, lambda j: f"{where}, inner chunk {list(j)}")  # padding entries too
    for j in codec.present(index):
        off = inner_offset(table, codec, j, end, f"{where}, inner chunk {j}")
        body = mv[off:off + codec.inner_nbytes]
        _check(body, mv[off + codec.inner_nbytes:off + enc], f"{where}, inner chunk {j}")
        placed(mv[off + codec.inner_nbytes:off + enc], j, f"{where}, inner chunk {j}")
        ibox = codec.inner_box(index, j)
        tile = np.frombuffer(body, np.uint8).view(codec.dtype).reshape(codec.inner)
        out[tuple(slice(a - c0, b - c0) for (a, b), (c0, _) in zip(ibox, cbox))] = \
            tile[tuple(slice(0, b - a) for a, b in ibox)]
    return _bools(out, where)


def _bools(out: np.ndarray, where: str) -> np.ndarray:
    """Spec §5.2: a bool element stored as a byte other than 0 or 1 is damage, even when its
    CRC-32C holds (as the direct reader and TensorStore refuse it)."""
    if out.dtype == np.bool_ and out.size and out.view(np.uint8).max() > 1:
        raise CorruptChunkError(f"{where}: a bool element is stored as the byte "
                                f"{int(out.view(np.uint8).max())}, not 0 or 1 (spec §5.2)")
    return out


def _check(body: Any, crc: Any, where: str) -> None:
    if crc32c.crc32c(body) != int.from_bytes(crc, "little"):
        raise CorruptChunkError(f"{where} fails its crc32c checksum")
