"""Every compiled kernel of kvtier behind one typed face: a Python function per C entry point.

What is compiled, and why: each kernel (kernels/<name>.c) replaced numpy's or torch's ops that cost more.
    crc32c_units    a read's page crcs in one call: a Python call per page cost more than the crc itself
    sketch_scores   cold scores from the sketches' codes as they lie: dequantizing first in numpy cost ~4x more
    hot_dots        the hot pool's q.k in one pass over its key tiles: torch converted the whole pool to float first
    candidate_dots  the candidates' q.k and importance read where their records landed: four torch ops cost more
    chosen_values   softmax and weighted sums over values read in place: the copies and torch's dozen ops cost more
    summed_query    the lookahead's predicted query (norm, product, rotation) in one pass: five torch ops cost more
    top_share       each row's top scores in index order, and its split: numpy's argpartition and sort cost 3x more
    hit_table       the hit table's step and the migration check's scans: numpy's passes over every token cost more
One function here per C entry point: those named as their kernel, and weighted_values and attend (chosen_values),
split_chosen (top_share), record_hits, any_idle and any_hit (hit_table).

The arrays are numpy arrays (a CPU tensor's `.numpy()` shares its memory; bfloat16 goes in as its bits, a
`.view(torch.int16)`): this package imports numpy only, since the storage scorer process uses it and starts without
torch. Each function takes its arguments by keyword, checks them once and cheaply (dtypes, the C-contiguity the C
code relies on, the sizes that must agree: no copy and no pass over the elements) and raises ValueError naming the
argument; the C code checks again what needs such a pass (counts, slots and positions in range, rows within their
buffer). The decode step makes a few hundred of these calls, so the checks stay O(1).

The AVX2 + FMA kernels (hot_dots, candidate_dots, chosen_values, summed_query) run where `VECTORIZED` holds (an x86-64
CPU with both); elsewhere they raise RuntimeError and their callers keep torch's ops. setup.py builds the kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvtier.kernels import (_candidate_dots, _chosen_values, _crc32c_units, _hit_table, _hot_dots, _sketch_scores,
                            _summed_query, _top_share)

VECTORIZED = bool(_hot_dots.vectorized and _candidate_dots.vectorized and _chosen_values.vectorized
                  and _summed_query.vectorized)
MAX_ACCUMULATORS = _chosen_values.max_accumulators  # query heads x head_dim of one KV head that chosen_values takes
HOT_TILE = 16  # tokens per key tile of hot_dots' keys

_F32, _I64, _U8 = (np.dtype(np.float32),), (np.dtype(np.int64),), (np.dtype(np.uint8),)
_ROW_DTYPES = (np.dtype(np.float32), np.dtype(np.int16))  # float32, or bfloat16's bits
_AGGREGATIONS = {"sum": 0, "max": 1}  # how a token's dots over the query heads reduce to its importance
_NO_SCORES = np.empty((0, 0), dtype=np.float32)


class Rows(NamedTuple):
    """Rows [batch, heads, slots, head_dim] lying at any strides but the last in one buffer, as the kernels read a
    pool's or the candidates' records where they lie: the row of (b, h, s) is the head_dim elements from element
    first + b x strides[0] + h x strides[1] + s x strides[2] of `buffer` on."""

    buffer: np.ndarray  # the whole buffer (any shape, C-contiguous): float32, or int16 holding bfloat16 bits
    first: int
    strides: tuple[int, int, int]
    shape: tuple[int, int, int, int]


class Source(NamedTuple):
    """One source of `attend`: raw logits of its rows (q.k before the scaling) and their values; sequence b's chosen
    rows are slots[b, :counts[b]] of `values`."""

    logits: np.ndarray  # float32 [batch, heads, group, width]
    values: Rows  # [batch, heads, slots, head_dim]
    slots: np.ndarray | None = None  # int64 [batch, width]; None: row j is slot j
    counts: np.ndarray | None = None  # int64 [batch], each <= width; None: every sequence has width


def crc32c_units(data, *, unit: int) -> np.ndarray:
    """The CRC32C of each `unit`-byte piece of a buffer, in one call (crc32c_units.c; the GIL released).

    Args:
        data: any C-contiguous buffer (bytes, a numpy array) of a whole number of units.
        unit: bytes per unit, > 0.
    Returns:
        uint32 [units]: each unit's crc, equal to crc32c.crc32c's.
    """
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("data: not C-contiguous")
    if unit <= 0 or view.nbytes % unit:
        raise ValueError(f"data: {view.nbytes} bytes is not a whole number of {unit}-byte units")
    return np.frombuffer(_crc32c_units.units(view, unit), dtype=np.uint32)


def sketch_scores(records: np.ndarray, query: np.ndarray, out: np.ndarray, *, bits: int, heads: int, head_dim: int,
                  group: int, aggregation: str) -> None:
    """Each sketch record's importance straight from its codes (sketch_scores.c; the GIL released; layout:
    sparse/cold/sketch.py).

    Args:
        records: uint8 [tokens, record_bytes] (any shape of whole records): per token, float16 scales [heads x
            head_dim / group], then its int8 codes [heads x head_dim] (bits 8) or its int4 codes two to a byte, the low
            nibble the even dimension (bits 4).
        query: float32 [heads, per_head, head_dim] (any shape of that size): "sum" takes per_head 1 (each group of
            query heads summed), "max" every query head.
        out: float32 [at least tokens]; its first `tokens` values are written.
        bits: 8 or 4; group: dimensions per scale, dividing head_dim (at most 64).
        aggregation: "sum" (the sum over heads and queries) or "max" (their maximum).
    """
    if bits not in (8, 4) or heads <= 0 or group <= 0 or head_dim % group:
        raise ValueError(f"bits, heads, head_dim, group: {bits}-bit codes of {heads} heads of {head_dim} dims in "
                         f"groups of {group} are no sketch format")
    record_bytes = 2 * heads * (head_dim // group) + heads * head_dim * bits // 8
    _array("records", records, _U8, None)
    if records.size % record_bytes:
        raise ValueError(f"records: {records.size} bytes is not a whole number of {record_bytes}-byte records")
    _array("query", query, _F32, None)
    if not query.size or query.size % (heads * head_dim):
        raise ValueError(f"query: a query of {query.size} float32 values does not fit {heads} heads of {head_dim} dims")
    _array("out", out, _F32, 1)
    if len(out) < records.size // record_bytes:
        raise ValueError(f"out: holds fewer float32 values ({len(out)}) than there are records "
                         f"({records.size // record_bytes})")
    _sketch_scores.scores(records, query, out, bits, heads, head_dim, group, _aggregation(aggregation) == 1)


def hot_dots(keys: np.ndarray, query: np.ndarray, out: np.ndarray, importance: np.ndarray, *,
             aggregation: str) -> None:
    """The hot pool's raw q.k and each token's importance, in one pass over its key tiles (hot_dots.c; AVX2 + FMA;
    the GIL released).

    Args:
        keys: [batch, heads, tiles, head_dim, 16] float32, or int16 holding bfloat16 bits: 16 tokens a tile, each tile
            dimension-major.
        query: float32 [batch, heads, group, head_dim].
        out: float32 [batch, heads, group, used] (used <= tiles x 16), written: q.k of the first `used` tokens.
        importance: float32 [batch, used], written: each token's dots over heads and group summed, or their maximum.
        aggregation: "sum" or "max".
    """
    batch, heads, tiles, head_dim, tile = _array("keys", keys, _ROW_DTYPES, 5)
    if tile != HOT_TILE:
        raise ValueError(f"keys: tiles of {tile} tokens, not {HOT_TILE}")
    found = _array("query", query, _F32, 4)
    group = found[2]
    _agree("query", found, (batch, heads, group, head_dim), "keys' [batch, heads, _, head_dim]")
    found = _array("out", out, _F32, 4)
    used = found[3]
    _agree("out", found, (batch, heads, group, used), "query's [batch, heads, group, _]")
    _array("importance", importance, _F32, (batch, used), "out's [batch, used]")
    if not group or used > tiles * HOT_TILE:
        raise ValueError(f"out: {group} query heads of {used} tokens, need 1 or more of at most tiles x 16 = "
                         f"{tiles * HOT_TILE}")
    _hot_dots.dots(keys, query, out, importance, _aggregation(aggregation), keys.itemsize, batch * heads, heads, group,
                   head_dim, tiles, used)


def candidate_dots(keys: Rows, query: np.ndarray, counts: np.ndarray, out: np.ndarray, importance: np.ndarray, *,
                   aggregation: str) -> None:
    """The cold candidates' exact q.k and importance, read where their records landed (candidate_dots.c; AVX2 +
    FMA; the GIL released). Rows past a sequence's count are padding, never read: their dots and importance are -inf.

    Args:
        keys: rows [batch, heads, width, head_dim] (head_dim a multiple of 8).
        query: float32 [batch, heads, group, head_dim].
        counts: int64 [batch], each in [0, width]: sequence b's own rows are its first counts[b].
        out: float32 [batch, heads, group, width], written: q.k.
        importance: float32 [batch, width], written: each token's dots over heads and group summed, or their maximum.
        aggregation: "sum" or "max".
    """
    batch, heads, group, head_dim = _array("query", query, _F32, 4)
    width = _rows("keys", keys, batch, heads, head_dim, "query's [batch, heads, _, head_dim]")
    _array("counts", counts, _I64, (batch,), "query's [batch]")
    _array("out", out, _F32, (batch, heads, group, width), "query's and keys' [batch, heads, group, width]")
    _array("importance", importance, _F32, (batch, width), "keys' [batch, width]")
    _candidate_dots.dots(keys.buffer, keys.first, *keys.strides, query, counts, out, importance, keys.buffer.itemsize,
                         batch, heads, group, width, head_dim, _aggregation(aggregation))


def weighted_values(values: Rows, slots: np.ndarray, counts: np.ndarray, weights: np.ndarray, out: np.ndarray, *,
                    start: int) -> None:
    """Each query head's weighted sum of its sequence's chosen rows, read where they lie (chosen_values.c,
    `weighted`; AVX2 + FMA; the GIL released).

    Args:
        values: rows [batch, heads, slots, head_dim] (head_dim a multiple of 8, group x head_dim <= MAX_ACCUMULATORS).
        slots: int64 [batch, width]: sequence b's chosen slots (each below the values' slots), the first counts[b] of
            its row.
        counts: int64 [batch], each in [0, width].
        weights: float32 [batch, heads, group, stride]: the weights of the chosen are columns start.. start + width.
        out: float32 [batch, heads, group, head_dim], written: out[b, h, g] = sum over j < counts[b] of
            weights[b, h, g, start + j] x the row of (b, h, slots[b, j]).
        start: the first chosen column of `weights`.
    """
    batch, heads, group, head_dim = _array("out", out, _F32, 4)
    pool = _rows("values", values, batch, heads, head_dim, "out's [batch, heads, _, head_dim]")
    found = _array("slots", slots, _I64, 2)
    width = found[1]
    _agree("slots", found, (batch, width), "out's [batch, _]")
    _array("counts", counts, _I64, (batch,), "out's [batch]")
    found = _array("weights", weights, _F32, 4)
    stride = found[3]
    _agree("weights", found, (batch, heads, group, stride), "out's [batch, heads, group, _]")
    if start < 0 or start + width > stride:
        raise ValueError(f"start: columns {start}..{start + width} of the chosen do not lie within each weight row "
                         f"of {stride}")
    _chosen_values.weighted(values.buffer, values.first, *values.strides, slots, counts, weights, out,
                            values.buffer.itemsize, batch, heads, group, pool, width, stride, start, head_dim)


def attend(sources: tuple[Source, ...] | list[Source], out: np.ndarray, *, scaling: float) -> None:
    """A decode step's whole attention over its sources in one call: one softmax over every source's chosen logits
    x scaling, its weights times their values (chosen_values.c, `attend`; AVX2 + FMA; the GIL released).

    Args:
        sources: 1 to 8 `Source`s (the device window, the chosen hot tokens, the chosen candidates).
        out: float32 [batch, heads, group, head_dim] (head_dim a multiple of 8), written.
        scaling: the logits' factor (1 / sqrt(head_dim), or the model's).
    """
    batch, heads, group, head_dim = _array("out", out, _F32, 4)
    if not 1 <= len(sources) <= 8:
        raise ValueError(f"sources: {len(sources)} of them, attend takes 1 to 8 sources")
    held = []
    for index, source in enumerate(sources):
        if not isinstance(source, Source):
            raise TypeError(f"sources[{index}]: a source is a Source(logits, values, slots, counts), not "
                            f"{type(source).__name__}")
        try:
            held.append(_source(source, batch, heads, group, head_dim))
        except ValueError as error:
            raise ValueError(f"sources[{index}].{error}") from None
    _chosen_values.attend(tuple(held), out, batch, heads, group, head_dim, scaling)


def _source(source: Source, batch: int, heads: int, group: int, head_dim: int) -> tuple:
    """`source` checked against attend's out [batch, heads, group, head_dim], as chosen_values.c takes it."""
    found = _array("logits", source.logits, _F32, 4)
    width = found[3]
    _agree("logits", found, (batch, heads, group, width), "out's [batch, heads, group, _]")
    values, slots, counts = source.values, source.slots, source.counts
    pool = _rows("values", values, batch, heads, head_dim, "out's [batch, heads, _, head_dim]")
    if slots is None:
        slots = b""
    else:
        _array("slots", slots, _I64, (batch, width), "its logits' [batch, width]")
    if counts is None:
        counts = b""
    else:
        _array("counts", counts, _I64, (batch,), "out's [batch]")
    return (source.logits, width, values.buffer, values.first, *values.strides, values.buffer.itemsize, pool, slots,
            counts)


def summed_query(hidden: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, rotation: np.ndarray,
                 out: np.ndarray, *, epsilon: float) -> None:
    """The lookahead's predicted query in one pass: RMS-normalized hidden state, times the folded projection, plus its
    bias, rotated (summed_query.c; AVX2 + FMA; the GIL released).

    Args:
        hidden: float32 [batch, width].
        weight: float32 [heads x head_dim, width]: the projection (sparse/lookahead.py, FoldedProjection).
        bias: float32 [heads x head_dim], or None.
        rotation: float32 [batch or 1, 2, head_dim] (head_dim even, <= 1024): cos, then sin with its first half
            negated; one per sequence, or one for all.
        out: float32 [batch, heads, head_dim], written: q x cos + rotate_half(q) x sin, q the normalized product.
        epsilon: the norm's.
    """
    batch, width = _array("hidden", hidden, _F32, 2)
    found = _array("weight", weight, _F32, 2)
    rows = found[0]
    _agree("weight", found, (rows, width), "hidden's [_, width]")
    if bias is not None:
        _array("bias", bias, _F32, (rows,), "weight's [rows]")
    rotations, two, head_dim = _array("rotation", rotation, _F32, 3)
    if two != 2 or rotations not in (1, batch):
        raise ValueError(f"rotation: shape {rotation.shape} does not match [1 or batch {batch}, 2, head_dim]")
    if not head_dim or rows % head_dim:
        raise ValueError(f"weight: {rows} rows are not a whole number of heads of rotation's head_dim {head_dim}")
    _array("out", out, _F32, (batch, rows // head_dim, head_dim), "[batch, heads, head_dim] of weight and rotation")
    _summed_query.summed_query(hidden, weight, b"" if bias is None else bias, rotation, out, batch, width, rows,
                               head_dim, epsilon)


def top_share(scores: np.ndarray, *, count: int, more: np.ndarray | None = None) -> np.ndarray:
    """Each row's `count` largest scores as ascending indices (top_share.c; the GIL released); among equal scores the
    lowest indices, NaN ranked lowest, -0 equal to +0.

    Args:
        scores: [rows, n] (converted to contiguous float32 where it is not).
        count: 0 to n + m.
        more: [rows, m], or None: each row continued by its row of more, at indices n.. (converted as scores).
    Returns:
        int64 [rows, count].
    """
    more = _NO_SCORES if more is None else more
    if scores.ndim != 2:
        raise ValueError(f"scores: shape {scores.shape}, need [rows, n]")
    if more.ndim != 2 or (more.size and len(more) != len(scores)):
        raise ValueError(f"more: shape {more.shape} does not match scores' [rows, _] {scores.shape}")
    n, m = scores.shape[1], more.shape[1]
    if not 0 <= count <= n + m:
        raise ValueError(f"count: {count} of a row of {n} + {m} scores")
    chosen = np.empty((len(scores), count), dtype=np.int64)
    if count:
        _top_share.top_share(np.ascontiguousarray(scores, dtype=np.float32),
                             np.ascontiguousarray(more, dtype=np.float32), chosen, len(scores), n, m, count)
    return chosen


def split_chosen(chosen: np.ndarray, *, positions: np.ndarray,
                 more_positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`top_share`'s choice over rows of n scores then m more, split at n in one pass (top_share.c, `split`).

    Args:
        chosen: int64 [rows, count], each row ascending within [0, n + m) (converted to contiguous int64 where not).
        positions: int [rows, n]: the token positions of the n scores (at a row stride in place, as a pool's used
            columns; other layouts copied).
        more_positions: int [rows, m]: those of the m more (converted as chosen).
    Returns:
        counts: int64 [rows]: how many of a row's chosen lie below n (they come first).
        indices: int64 [rows, count]: those again, then 0.
        chosen_positions: int64 [rows, count]: the chosen tokens' positions.
        more_chosen: bool [rows, m]: which of the m more were chosen.
    """
    if chosen.ndim != 2 or positions.ndim != 2 or more_positions.ndim != 2:
        raise ValueError(f"chosen, positions, more_positions: shapes {chosen.shape}, {positions.shape}, "
                         f"{more_positions.shape}, need [rows, _] each")
    rows, count = chosen.shape
    if len(positions) != rows or len(more_positions) != rows:
        raise ValueError(f"positions, more_positions: {len(positions)} and {len(more_positions)} rows do not match "
                         f"chosen's {rows}")
    n, m = positions.shape[1], more_positions.shape[1]
    first_rows, stride = _strided_rows(positions)
    out, indices = np.empty((rows, count), dtype=np.int64), np.empty((rows, count), dtype=np.int64)
    counts, more_chosen = np.empty(rows, dtype=np.int64), np.empty((rows, m), dtype=np.uint8)
    _top_share.split(np.ascontiguousarray(chosen, dtype=np.int64), first_rows,
                     np.ascontiguousarray(more_positions, dtype=np.int64), out, indices, counts, more_chosen, rows,
                     count, n, m, stride)
    return counts, indices, out, more_chosen.view(bool)


def record_hits(hits: np.ndarray, stamp: np.ndarray, *, positions: np.ndarray, now: int) -> None:
    """One decode step of the hit table: each chosen token gets a hit (up to 255) and the step's stamp (hit_table.c,
    `record`).

    Args:
        hits, stamp: uint8 [rows, capacity], updated: hits[row, p] += 1 and stamp[row, p] = now for each position p
            of the row.
        positions: int [rows, n], distinct within a row, each in [0, capacity) (at a row stride in place, as a pool's
            used columns; other layouts copied).
        now: the step, mod 256.
    """
    rows, capacity = _array("hits", hits, _U8, 2)
    _array("stamp", stamp, _U8, (rows, capacity), "hits' [rows, capacity]")
    flat, stride = _table_positions(positions, rows)
    _byte("now", now)
    _hit_table.record(hits, stamp, flat, rows, capacity, positions.shape[1], stride, now)


def any_idle(stamp: np.ndarray, *, positions: np.ndarray, now: int, steps: int) -> np.ndarray:
    """Per row, whether one of its tokens has gone unchosen `steps` steps or more: a scan that stops at the first
    (hit_table.c).

    Args:
        stamp: uint8 [rows, capacity]: each token's last step, mod 256.
        positions: int [rows, n], each in [0, capacity) (at a row stride in place; other layouts copied).
        now: the step, mod 256; steps: 1 to 255 (the stamps wrap).
    Returns:
        bool [rows]: whether some position p of the row has (now - stamp[row, p]) mod 256 >= steps.
    """
    rows, capacity = _array("stamp", stamp, _U8, 2)
    flat, stride = _table_positions(positions, rows)
    _byte("now", now)
    idle = np.empty(rows, dtype=np.uint8)
    _hit_table.any_idle(stamp, flat, idle, rows, capacity, positions.shape[1], stride, now, steps)
    return idle.view(bool)


def any_hit(hits: np.ndarray, *, positions: np.ndarray, first: np.ndarray, needed: int) -> np.ndarray:
    """Per row, whether one of its tokens from column first[row] on has `needed` hits or more: a scan that stops at
    the first (hit_table.c).

    Args:
        hits: uint8 [rows, capacity].
        positions: int [rows, n], each in [0, capacity) (at a row stride in place; other layouts copied).
        first: int64 [rows], each in [0, n].
        needed: the hits that count (256: none does).
    Returns:
        bool [rows].
    """
    rows, capacity = _array("hits", hits, _U8, 2)
    flat, stride = _table_positions(positions, rows)
    _array("first", first, _I64, (rows,), "hits' [rows]")
    found = np.empty(rows, dtype=np.uint8)
    _hit_table.any_hit(hits, flat, first, found, rows, capacity, positions.shape[1], stride, needed)
    return found.view(bool)


def _array(name: str, array: np.ndarray, dtypes: tuple[np.dtype, ...], shape: tuple[int, ...] | int | None,
           meaning: str = "") -> tuple[int, ...]:
    """`array`'s shape, once it is a C-contiguous numpy array of one of `dtypes` and of `shape` (a tuple), of that many
    dimensions (an int) or of any shape (None); else ValueError naming the argument (`meaning`: what `shape`
    follows). One expression on the way through: the decode step makes a few hundred of these calls."""
    try:
        found = array.shape
        if (array.dtype in dtypes and array.flags.c_contiguous
                and (found == shape or len(found) == shape or shape is None)):
            return found
    except AttributeError:
        raise ValueError(f"{name}: a {type(array).__name__}, not a numpy array") from None
    if array.dtype not in dtypes or not array.flags.c_contiguous:
        layout = "" if array.flags.c_contiguous else " not C-contiguous"
        raise ValueError(f"{name}: {array.dtype} {found}{layout}, need C-contiguous "
                         f"{' or '.join(str(dtype) for dtype in dtypes)}")
    if isinstance(shape, int):
        raise ValueError(f"{name}: shape {found}, need {shape} dimensions")
    raise ValueError(f"{name}: shape {found} does not match {meaning} {shape}")


def _agree(name: str, found: tuple[int, ...], wanted: tuple[int, ...], meaning: str) -> None:
    """ValueError naming the argument unless its shape `found` is `wanted` (`meaning`: what that shape follows)."""
    if found != wanted:
        raise ValueError(f"{name}: shape {tuple(found)} does not match {meaning} {wanted}")


def _rows(name: str, rows: Rows, batch: int, heads: int, head_dim: int, meaning: str) -> int:
    """The slots of `rows`, once its buffer is C-contiguous float32 or int16 and its shape [batch, heads, _,
    head_dim]."""
    buffer, shape = rows.buffer, rows.shape
    try:
        fits = buffer.dtype in _ROW_DTYPES and buffer.flags.c_contiguous
    except AttributeError:
        fits = False
    if not fits:
        _array(f"{name}.buffer", buffer, _ROW_DTYPES, None)  # raises, saying why
    if len(shape) != 4 or shape[0] != batch or shape[1] != heads or shape[3] != head_dim:
        raise ValueError(f"{name}: shape {tuple(shape)} does not match {meaning} ({batch}, {heads}, _, {head_dim})")
    return shape[2]


def _aggregation(aggregation: str) -> int:
    """The kernels' code of an aggregation name."""
    code = _AGGREGATIONS.get(aggregation)
    if code is None:
        raise ValueError(f"aggregation: {aggregation!r}, need one of {tuple(_AGGREGATIONS)}")
    return code


def _byte(name: str, value: int) -> None:
    """ValueError naming the argument unless `value` is a step mod 256 (the hit table's stamps are uint8)."""
    if not 0 <= value < 256:
        raise ValueError(f"{name}: {value}, need a step mod 256")


def _table_positions(positions: np.ndarray, rows: int) -> tuple[np.ndarray, int]:
    """`_strided_rows` of a hit table's positions [rows, n]."""
    if positions.ndim != 2 or len(positions) != rows:
        raise ValueError(f"positions: shape {positions.shape} does not match the table's [rows, _] of {rows} rows")
    return _strided_rows(positions)


def _strided_rows(rows: np.ndarray) -> tuple[np.ndarray, int]:
    """A 2-D array's rows [count, n] as top_share.c and hit_table.c take them: a flat int64 buffer in which row r
    starts at element r x stride, and that stride. A pool's used columns (`positions[:, :used]`) go in place, without
    a copy; another dtype, a column stride or overlapping rows (a broadcast) are copied into contiguous rows."""
    count, n = rows.shape
    item = 8
    if (rows.dtype != np.int64 or (n > 1 and rows.strides[1] != item)
            or (count > 1 and (rows.strides[0] < n * item or rows.strides[0] % item))):
        rows = np.ascontiguousarray(rows, dtype=np.int64)
    stride = rows.strides[0] // item if count > 1 else n
    flat = np.lib.stride_tricks.as_strided(rows, ((count - 1) * stride + n if count else 0,), (item,))
    return flat, stride
