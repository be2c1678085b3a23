"""Exact Top-k of non-negative fp32 scores without sorting: sampled window + radix select (Pallas, Triton lowering).

Input: scores as int32 bit patterns `bits [rows_b, heads, keys]` (non-negative floats order like their int32
bits; -1 marks keys that may not be chosen) and per-row budgets. Output: the indices of the `count` largest,
ties at the threshold taken lowest index first, which is `lax.top_k`'s order, so the set equals
`reference.select_topk_reference` on the same scores.

Why not a plain radix select: a 4-bit radix select needs 8 passes over the scores with 16 compares per element
per pass, and one program per row (too few programs at small batch). Instead, four launches:
1. `_sample_kernel` (grid batch x heads): radix-select two ranks of a strided sample of `SAMPLE` scores, chosen
   4.5 standard deviations either side of the target quantile, giving a value window [lo, hi] that holds the
   k-th largest score with overwhelming probability.
2. `_count_kernel` (grid batch x heads x chunks, all of the GPU): per chunk, #(x > hi) and #(lo <= x <= hi).
3. `_compact_kernel` (same grid): if the window holds the k-th score (checked exactly from the counts), write the
   indices of every x > hi, and copy the window's (value, index) pairs in index order to a small buffer.
4. `_finish_kernel` (grid batch x heads): radix select inside the buffer (passes whose bits lo and hi share are
   skipped) and append the chosen indices. If the check failed (it is exact, so this is only ever slow, never
   wrong) the row falls back to a full radix select over all of its scores.
So the scores are read twice in full, by wide grids, and everything serial touches a few thousand elements.
`version=3` (opt-in via `DecodeTuning.select_version`, same results, verified in interpret mode but not yet timed
on the H200) trims the serial and compute-bound parts that the H200 profile showed (benchmarks/notes_decode.md).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

SHIFTS = (27, 23, 19, 15, 11, 7, 3, 0)  # 4-bit digits over bits 30..0 (the sign bit of a valid score is 0)
SAMPLE = 4096  # sampled scores per row
SLACK = 1024  # extra slots past every output buffer: lanes that store nothing point there (see _emit)
_INT_MAX = 2**31 - 1
MIN_CAP = 8192  # window buffer floor (tests lower it to reach the window path on small rows)
FALLBACK = True  # tests switch it off (at trace time) to prove that the window path alone is exact


def _radix_select(load, n_blocks, targets, block: int, lo=None, hi=None, shifts=SHIFTS):
    """For each target t: the largest V with #(x >= V) >= t, and #(x > V). `load(i)` -> (x [block], ids [block]).

    Counts are per-lane accumulators [16 * len(targets), block] (no reduction inside the loop). With lo/hi (the
    answer is known to lie in [lo, hi]), passes whose bits lo and hi share are skipped; the last never is.
    With fewer `shifts` the values are the answers' top bits only (lower bits 0) and #(x > V) is not computed.
    """
    nt = len(targets)
    lanes = jnp.arange(16 * nt, dtype=jnp.int32)
    which, digit = lanes // 16, lanes % 16
    prefixes = [jnp.int32(0) for _ in targets]
    cnt = jstars = None
    for shift in shifts:
        pref = prefixes[0]
        for t in range(1, nt):
            pref = jnp.where(which == t, prefixes[t], pref)
        thr = pref + (digit << shift)  # [16 * nt]
        skip = None
        nb = n_blocks
        if lo is not None and shift:
            skip = (lo >> shift) == (hi >> shift)
            nb = (1 - skip.astype(jnp.int32)) * n_blocks  # (a where() here lowers to an i1 loop bound)

        def body(i, acc, thr=thr):
            x, _ = load(i)
            return acc + (x[None, :] >= thr[:, None]).astype(jnp.int32)

        acc = lax.fori_loop(0, nb, body, jnp.zeros((16 * nt, block), jnp.int32))
        cnt = jnp.sum(acc, axis=1)  # [16 * nt]: #(x >= candidate)
        jstars = []
        for t in range(nt):
            jstar = jnp.sum(((which == t) & (cnt >= targets[t])).astype(jnp.int32)) - 1
            new = prefixes[t] + (jstar << shift)
            if skip is not None:
                new = jnp.where(skip, (lo >> shift) << shift, new)
            prefixes[t] = new
            jstars.append(jstar)
    if shifts[-1]:
        return prefixes, None
    # After the shift-0 pass candidate jstar + 1 is V + 1 (jstar <= 7: only bits 2..0 were open), so it counts x > V.
    n_gt = [jnp.sum(jnp.where((which == t) & (digit == jstars[t] + 1), cnt, 0)) for t in range(nt)]
    return prefixes, n_gt


def _emit(load, n_blocks, thr, n_gt, target, out_ref, base, dummy: int, block: int):
    """Store the ids of x > thr and of the first (target - n_gt) x == thr at out_ref[base + rank], rank < target."""
    n_eq_take = target - n_gt

    def body(i, carry):
        n_sel, n_eq = carry
        x, ids = load(i)
        eq = (x == thr).astype(jnp.int32)
        eq_rank = n_eq + jnp.cumsum(eq) - eq
        sel = ((x > thr) | ((eq > 0) & (eq_rank < n_eq_take))).astype(jnp.int32)
        rank = n_sel + jnp.cumsum(sel) - sel
        keep = (sel > 0) & (rank < target)
        # Lanes that store nothing point at distinct slack slots: interpret mode's masked scatter rewrites every
        # addressed slot, so a shared dummy slot could clobber a real write.
        slot = jnp.where(keep, base + rank, dummy + jnp.arange(block))
        plgpu.store(out_ref.at[slot], ids, mask=keep)
        return n_sel + jnp.sum(sel), n_eq + jnp.sum(eq)

    lax.fori_loop(0, n_blocks, body, (jnp.int32(0), jnp.int32(0)))


def _sample_positions(n, j):
    """floor(j * n / SAMPLE) without int32 overflow."""
    return j * (n // SAMPLE) + (j * (n % SAMPLE)) // SAMPLE


def _sample_kernel(kvlen_ref, thi_ref, tlo_ref, bits_ref, lo_ref, hi_ref, *, block: int, version: int):
    b = pl.program_id(0)
    n = jnp.maximum(kvlen_ref[b], 1)
    t_hi, t_lo = thi_ref[b], tlo_ref[b]

    if version >= 3:  # bits_ref holds the gathered sample [SAMPLE]: contiguous loads, and 16 bits are enough
        shifts = SHIFTS[:4]

        def load(i):
            return bits_ref[pl.ds(i * block, block)], None
    else:
        shifts = SHIFTS

        def load(i):
            pos = _sample_positions(n, i * block + jnp.arange(block))
            return bits_ref[pos], pos

    (v_hi, v_lo), _ = _radix_select(load, SAMPLE // block, (t_hi, t_lo), block, shifts=shifts)
    # lo/hi only have to bracket the k-th score (the count check is exact): round hi up to the end of its bucket
    v_hi = v_hi + ((1 << shifts[-1]) - 1)
    hi = jnp.where(t_hi >= 1, v_hi, _INT_MAX)
    lo = jnp.where(t_lo <= SAMPLE, v_lo, 0)
    lo_ref[...] = jnp.full((1,), lo, jnp.int32)
    hi_ref[...] = jnp.full((1,), hi, jnp.int32)


def _count_kernel(lo_ref, hi_ref, bits_ref, cgt_ref, cwin_ref, *, block: int, chunk_len: int):
    c = pl.program_id(2)
    lo, hi = lo_ref[0], hi_ref[0]

    def body(i, carry):
        gt, win = carry
        x = bits_ref[pl.ds(c * chunk_len + i * block, block)]
        return gt + (x > hi).astype(jnp.int32), win + ((x >= lo) & (x <= hi)).astype(jnp.int32)

    zeros = jnp.zeros((block,), jnp.int32)
    gt, win = lax.fori_loop(0, chunk_len // block, body, (zeros, zeros))
    cgt_ref[...] = jnp.full((1,), jnp.sum(gt), jnp.int32)
    cwin_ref[...] = jnp.full((1,), jnp.sum(win), jnp.int32)


def _window_ok(k, cgt, cwin, cap: int):
    tot_gt, tot_win = jnp.sum(cgt), jnp.sum(cwin)
    return (tot_gt < k) & (k <= tot_gt + tot_win) & (tot_win <= cap), tot_gt, tot_win


def _compact_kernel(cnt_ref, lo_ref, hi_ref, cgt_ref, cwin_ref, bits_ref, idx_ref, *buf_refs,
                    block: int, chunk_len: int, cap: int, k_max: int, version: int):
    bufi_ref = buf_refs[-1]  # version 2 also keeps the values (buf_refs[0]); version 3 re-gathers them later
    b, c = pl.program_id(0), pl.program_id(2)
    k = cnt_ref[b]
    lo, hi = lo_ref[0], hi_ref[0]
    cgt, cwin = cgt_ref[...], cwin_ref[...]  # [chunks]
    ok, _, _ = _window_ok(k, cgt, cwin, cap)
    before = jnp.arange(cgt.shape[0]) < c
    off_gt = jnp.sum(jnp.where(before, cgt, 0))
    off_win = jnp.sum(jnp.where(before, cwin, 0))
    lanes = jnp.arange(block)

    def body(i, carry):
        n_gt, n_win = carry
        pos = c * chunk_len + i * block + lanes
        x = bits_ref[pl.ds(c * chunk_len + i * block, block)]
        gt = (x > hi).astype(jnp.int32)
        win = ((x >= lo) & (x <= hi)).astype(jnp.int32)
        if version >= 3:  # one scan of both flags packed in 16-bit halves (a block holds < 2**16 keys)
            both = (gt << 16) | win
            excl = jnp.cumsum(both) - both
            r_gt = off_gt + n_gt + (excl >> 16)
            r_win = off_win + n_win + (excl & 0xFFFF)
        else:
            r_gt = off_gt + n_gt + jnp.cumsum(gt) - gt
            r_win = off_win + n_win + jnp.cumsum(win) - win
        plgpu.store(idx_ref.at[jnp.where(gt > 0, r_gt, k_max + lanes)], pos, mask=gt > 0)
        wslot = jnp.where(win > 0, r_win, cap + lanes)
        if version < 3:
            plgpu.store(buf_refs[0].at[wslot], x, mask=win > 0)
        plgpu.store(bufi_ref.at[wslot], pos, mask=win > 0)
        return n_gt + jnp.sum(gt), n_win + jnp.sum(win)

    lax.fori_loop(0, ok.astype(jnp.int32) * (chunk_len // block), body, (jnp.int32(0), jnp.int32(0)))


def _finish_kernel(cnt_ref, lo_ref, hi_ref, cgt_ref, cwin_ref, *refs, block: int, n_row_blocks: int, cap: int,
                   k_max: int, version: int):
    if version >= 3:
        bufi_ref, bits_ref, _, idx_ref = refs  # the third is aliased with idx_ref (holds the compact writes)
        bufv_ref = None
    else:
        bufv_ref, bufi_ref, bits_ref, _, idx_ref = refs
    b = pl.program_id(0)
    k = cnt_ref[b]
    lo, hi = lo_ref[0], hi_ref[0]
    ok, tot_gt, tot_win = _window_ok(k, cgt_ref[...], cwin_ref[...], cap)
    lanes = jnp.arange(block)

    # Window path: the (need)-th largest of the buffered window values is the k-th of the row.
    n_items = ok.astype(jnp.int32) * tot_win
    need = k - tot_gt

    def load_buf(i):
        pos = i * block + lanes
        live = pos < n_items
        ids = bufi_ref[pl.ds(i * block, block)]
        if bufv_ref is None:  # re-gather the window's values (index-ordered, so mostly nearby)
            vals = bits_ref[jnp.where(live, ids, 0)]
        else:
            vals = bufv_ref[pl.ds(i * block, block)]
        return jnp.where(live, vals, -1), ids

    nb = pl.cdiv(n_items, block)
    (thr,), (n_gt,) = _radix_select(load_buf, nb, (need,), block, lo=lo, hi=hi)
    _emit(load_buf, nb, thr, n_gt, jnp.where(ok, need, 0), idx_ref, tot_gt, k_max, block)

    # Fallback (window missed the k-th score): full radix select over the row.
    def load_row(i):
        return bits_ref[pl.ds(i * block, block)], i * block + lanes

    nb_row = (1 - ok.astype(jnp.int32)) * (n_row_blocks if FALLBACK else 0)
    (thr_r,), (n_gt_r,) = _radix_select(load_row, nb_row, (k,), block)
    _emit(load_row, nb_row, thr_r, n_gt_r, jnp.where(ok, 0, k), idx_ref, 0, k_max, block)


def window_targets(kv_len, counts, cap: int):
    """Sample ranks (1-based) of hi and lo for each row: 4.5 sd either side of the expected rank of the k-th score."""
    n = jnp.maximum(kv_len, 1).astype(jnp.float32)
    qf = jnp.clip(counts.astype(jnp.float32) / n, 0.0, 1.0)
    e = SAMPLE * qf
    margin = 4.5 * jnp.sqrt(SAMPLE * qf * (1.0 - qf)) + 4.0
    t_hi = jnp.floor(e - margin).astype(jnp.int32)
    t_lo = jnp.ceil(e + margin).astype(jnp.int32)
    small = kv_len <= cap  # the whole row fits the buffer: window = everything
    return jnp.where(small, 0, t_hi), jnp.where(small, SAMPLE + 1, t_lo)


def row_pad(keys: int, target_programs: int, rows: int, count_block: int = 2048) -> tuple[int, int]:
    """(chunks, pad unit): the count/compact grid splits each row in `chunks`; keys are padded to a multiple of unit."""
    chunks = 1
    while chunks * 2 * rows <= target_programs and chunks * 2 * count_block <= keys:
        chunks *= 2
    return chunks, chunks * count_block


def select_topk_bits(bits, kv_len, counts, k_max: int, *, chunks: int, interpret=False, version: int = 2):
    """bits [batch, heads, keys_padded] int32 (-1 = ineligible; keys_padded a multiple of chunks * 2048),
    kv_len [batch], counts [batch] (<= k_max) -> idx [batch, heads, k_max] int32, -1 past counts.

    version 2 is the one measured on the H200 (benchmarks/decode.md). version 3 (same results, not yet timed)
    gathers the sample once into a contiguous array and radix-selects only its top 16 bits, scans the two
    compaction flags in one packed cumsum, keeps no value buffer (finish re-gathers values through the indices)
    and lowers the buffer floor so short rows also take the window path (notes_decode.md, next steps 1-3).
    """
    if version not in (2, 3):
        raise ValueError(f"select version must be 2 or 3, got {version!r}")
    b, ih, s_pad = bits.shape
    count_block, compact_block, sel_block = 2048, 1024, 512
    chunk_len = s_pad // chunks
    assert chunk_len % count_block == 0 and chunk_len % compact_block == 0, (s_pad, chunks)
    # The window holds ~9 sd of SAMPLE ranks (at most ~6.6% of the row, at q = 0.5) + 2 * 4 / SAMPLE.
    window_max = (9.0 * math.sqrt(SAMPLE * 0.25) + 10.0) / SAMPLE
    row_cap = pl.cdiv(s_pad, sel_block) * sel_block
    cap = min(pl.cdiv(int(1.3 * window_max * s_pad) + 1, sel_block) * sel_block, row_cap)
    cap = max(cap, min(MIN_CAP if version < 3 else min(MIN_CAP, 1024), row_cap))
    t_hi, t_lo = window_targets(kv_len, counts, cap)
    params = plgpu.CompilerParams(num_warps=8, num_stages=2)
    row = lambda *shape: pl.BlockSpec((None, None) + shape, lambda i, j, *_: (i, j) + (0,) * len(shape))
    vec = pl.BlockSpec((b,), lambda *_: (0,))

    if version >= 3:
        pos = _sample_positions(jnp.maximum(kv_len, 1)[:, None], jnp.arange(SAMPLE, dtype=jnp.int32)[None, :])
        sample_src = jnp.take_along_axis(bits, jnp.broadcast_to(pos[:, None, :], (b, ih, SAMPLE)), axis=2)
    else:
        sample_src = bits
    lo, hi = pl.pallas_call(
        functools.partial(_sample_kernel, block=sel_block, version=version),
        grid=(b, ih),
        in_specs=[vec, vec, vec, row(sample_src.shape[2])],
        out_specs=[row(1), row(1)],
        out_shape=[jax.ShapeDtypeStruct((b, ih, 1), jnp.int32)] * 2,
        compiler_params=params, interpret=interpret, name="kascade_topk_sample",
    )(kv_len, t_hi, t_lo, sample_src)

    per_chunk = pl.BlockSpec((None, None, 1), lambda i, j, c: (i, j, c))
    cgt, cwin = pl.pallas_call(
        functools.partial(_count_kernel, block=count_block, chunk_len=chunk_len),
        grid=(b, ih, chunks),
        in_specs=[row(1), row(1), row(s_pad)],
        out_specs=[per_chunk, per_chunk],
        out_shape=[jax.ShapeDtypeStruct((b, ih, chunks), jnp.int32)] * 2,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3), interpret=interpret,
        name="kascade_topk_count",
    )(lo, hi, bits)

    n_bufs = 1 if version >= 3 else 2
    idx_shape = jax.ShapeDtypeStruct((b, ih, k_max + SLACK), jnp.int32)
    buf_shape = jax.ShapeDtypeStruct((b, ih, cap + SLACK), jnp.int32)
    outs = pl.pallas_call(
        functools.partial(_compact_kernel, block=compact_block, chunk_len=chunk_len, cap=cap, k_max=k_max,
                          version=version),
        grid=(b, ih, chunks),
        in_specs=[vec, row(1), row(1), row(chunks), row(chunks), row(s_pad)],
        out_specs=[row(k_max + SLACK)] + [row(cap + SLACK)] * n_bufs,
        out_shape=[idx_shape] + [buf_shape] * n_bufs,
        compiler_params=plgpu.CompilerParams(num_warps=8 if version >= 3 else 4, num_stages=2), interpret=interpret,
        name="kascade_topk_compact",
    )(counts, lo, hi, cgt, cwin, bits)
    idx_raw, bufs = outs[0], list(outs[1:])

    idx_raw = pl.pallas_call(
        functools.partial(_finish_kernel, block=sel_block, n_row_blocks=s_pad // sel_block, cap=cap, k_max=k_max,
                          version=version),
        grid=(b, ih),
        in_specs=[vec, row(1), row(1), row(chunks), row(chunks)] + [row(cap + SLACK)] * n_bufs + [row(s_pad),
                                                                                                   row(k_max + SLACK)],
        out_specs=row(k_max + SLACK),
        out_shape=idx_shape,
        input_output_aliases={6 + n_bufs: 0},
        compiler_params=params, interpret=interpret, name="kascade_topk_finish",
    )(counts, lo, hi, cgt, cwin, *bufs, bits, idx_raw)
    # Ranks >= count were never written: mask them here (fuses with the slice).
    return jnp.where(jnp.arange(k_max)[None, None, :] < counts[:, None, None], idx_raw[..., :k_max], -1)
