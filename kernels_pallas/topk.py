"""Exact Top-k of non-negative fp32 scores without sorting: sampled window + radix select (Pallas, Triton lowering).

Input: scores as int32 bit patterns `bits [rows_b, heads, keys]` (non-negative floats order like their int32
bits; -1 marks keys that may not be chosen) and per-row budgets. Output: the indices of the `count` largest,
ties at the threshold taken lowest index first, which is `lax.top_k`'s order, so the set equals
`reference.select_topk_reference` on the same scores.

Why not a plain radix select: a 4-bit radix select needs 8 passes over the scores with 16 compares per element
per pass, and one program per row (too few programs at small batch). Instead, four launches, so that the scores are
read twice in full by wide grids and nothing serial touches more than ~1-2K elements:
1. `_sample_kernel` (grid batch x heads): gathers a strided sample of `SAMPLE` scores once, then radix-selects two
   of its ranks (3-bit digits over bits 30..16), 4.5 standard deviations either side of the target quantile: a
   value window [lo, hi] that holds the k-th largest score with overwhelming probability.
2. `_count_kernel` (grid batch x heads x chunks, all of the GPU): per chunk, #(x > hi) and #(x >= e) for the edges
   of 8 equal-width sub-buckets of [lo, hi] in bit space (16 for rows over LONG_ROW keys).
3. `_compact_kernel` (same grid): picks the sub-bucket holding the k-th score from the counts (exact: #(x > hi) <
   k <= #(x >= lo)), writes every id above it to the output and the sub-bucket's ids (~1/8 of the window) to a
   buffer in the same output row, one scatter store per key for both.
4. `_finish_kernel` (grid batch x heads): gathers the sub-bucket's values once and radix-selects from registers,
   only the passes from the first digit where its edges differ. Larger sub-buckets (ties) loop over the buffer; a
   missed window, or a sub-bucket over the buffer, takes the full-row fallback (exact, only ever slow; `pl.when`:
   free when not taken).
Counts #(x < e) are summed as the sign bit of x - e: 2 int instructions per edge and key, where `acc + (x >= e)`
compiles to 3. Timings, and the designs measured slower: benchmarks/notes_decode.md.

Short rows (`select_topk_short`, decode caches up to `DecodeTuning.short_select_max` keys): one launch, one program
per row holding the whole row in registers; bisection over its bits with no memory access inside the loop, then one
scan for the ranks. Same index sets as the four launches (the order within a row may differ).
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
_MAX_FINITE = 0x7F7FFFFF  # bits of the largest finite fp32
MIN_CAP = 1024  # window buffer floor (tests lower it to reach the window path on small rows)
FALLBACK = True  # tests switch it off (at trace time) to prove that the window path alone is exact
SUB_SHIFT = 3  # the count pass splits the window into 2**SUB_SHIFT equal-width sub-buckets (bit space),
LONG_ROW = 262144  # and into twice as many for rows longer than this (keeps the sub-bucket within FAST_BLOCKS)
FAST_BLOCKS = 4  # finish: sub-buckets of up to this many blocks are selected from registers
SAMPLE_SHIFTS = (28, 25, 22, 19, 16)  # sample: 3-bit digits over bits 30..16 (1/128 of a binade)
BLOCKS = dict(sample=256, count=1024, compact=1024, finish=512)  # (tests shrink `finish`)
WARPS = dict(sample=8, count=8, compact=4, finish=8)


def _radix_select(load, n_blocks, targets, block: int, shifts=SHIFTS, radix: int = 16):
    """For each target t: the largest V with #(x >= V) >= t, and #(x > V). `load(i)` -> (x [block], ids [block]).

    Counts are per-lane accumulators [radix * len(targets), block] (no reduction inside the loop), #(x < candidate)
    summed as the sign bit of x - candidate: exact for x >= -1 and candidates >= 0, which holds whenever the answer
    exists (a missing answer gives garbage either way, and is never used). With fewer `shifts` the values are the
    answers' top bits only (lower bits 0) and #(x > V) is not computed; radix < 16 (digits of fewer bits) only then.
    """
    nt = len(targets)
    lanes = jnp.arange(radix * nt, dtype=jnp.int32)
    which, digit = lanes // radix, lanes % radix
    prefixes = [jnp.int32(0) for _ in targets]
    cnt = jstars = None
    for shift in shifts:
        pref = prefixes[0]
        for t in range(1, nt):
            pref = jnp.where(which == t, prefixes[t], pref)
        thr = pref + (digit << shift)  # [radix * nt]

        def body(i, acc, thr=thr):
            x, _ = load(i)
            return acc + lax.shift_right_logical(x[None, :] - thr[:, None], 31)

        acc = lax.fori_loop(0, n_blocks, body, jnp.zeros((radix * nt, block), jnp.int32))
        cnt = n_blocks * block - jnp.sum(acc, axis=1)  # [radix * nt]: #(x >= candidate)
        jstars = []
        for t in range(nt):
            jstar = jnp.sum(((which == t) & (cnt >= targets[t])).astype(jnp.int32)) - 1
            prefixes[t] = prefixes[t] + (jstar << shift)
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


def _sample_kernel(kvlen_ref, thi_ref, tlo_ref, bits_ref, lo_ref, hi_ref, samp_ref, *, block: int, interpret: bool):
    """Gather the strided sample once (all SAMPLE loads in flight) into samp_ref, then radix-select lo and hi from
    that contiguous copy."""
    b = pl.program_id(0)
    n = jnp.clip(kvlen_ref[b], 1, bits_ref.shape[0])  # (the GPU has no bounds checks)
    samp_ref[...] = bits_ref[_sample_positions(n, jnp.arange(SAMPLE, dtype=jnp.int32))]
    if not interpret:  # other threads of the program read what this one wrote (interpret mode has no barrier)
        plgpu.debug_barrier()
    t_hi, t_lo = thi_ref[b], tlo_ref[b]

    def load(i):
        return samp_ref[pl.ds(i * block, block)], None

    (v_hi, v_lo), _ = _radix_select(load, SAMPLE // block, (t_hi, t_lo), block, shifts=SAMPLE_SHIFTS, radix=8)
    # lo/hi only have to bracket the k-th score (the count check is exact): round hi up to the end of its bucket
    v_hi = v_hi + ((1 << SAMPLE_SHIFTS[-1]) - 1)
    hi = jnp.where(t_hi >= 1, v_hi, _INT_MAX)
    lo = jnp.where(t_lo <= SAMPLE, v_lo, 0)
    lo = jnp.maximum(lo, 0)  # a sample with fewer than t_lo valid scores gives a negative lo: never let -1 keys in
    hi = jnp.minimum(hi, _MAX_FINITE)  # no finite score lies above: keeps hi + 1 and the sub-edges in int32
    lo = jnp.minimum(lo, hi)  # (a sample short of valid scores can give anything: keep 0 <= lo <= hi)
    lo_ref[...] = jnp.full((1,), lo, jnp.int32)
    hi_ref[...] = jnp.full((1,), hi, jnp.int32)


def _sub_edge(lo, hi, j, sub_shift: int):
    """Lower edge of sub-bucket j (< 2**sub_shift, may be traced) of the window [lo, hi]; hi + 1 if it is empty.

    Width w = (hi - lo) // 2**sub_shift + 1, so the last bucket ends at or past hi. No int32 overflow:
    0 <= lo <= hi <= _MAX_FINITE (the sample kernel clamps both) and lo + j * w <= hi + j.
    """
    w = ((hi - lo) >> sub_shift) + 1
    t = lo + j * w
    return jnp.where(t > hi, hi + 1, t)


def _radix_select_from(load, n_blocks, target, block: int, lo, hi):
    """One target of `_radix_select`, known to lie in [lo, hi]: the passes whose bits lo and hi share are never run
    (a loop from the first differing 4-bit digit), so they cost no reduction either. Returns (V, #(x > V)).
    Needs 0 <= lo <= V <= hi <= _MAX_FINITE and x >= -1, so that no x - candidate overflows."""
    digit = jnp.arange(16, dtype=jnp.int32)
    shift_of = lambda p: jnp.maximum(27 - 4 * p, 0)  # SHIFTS[p]
    p0 = sum(((lo >> s) == (hi >> s)).astype(jnp.int32) for s in SHIFTS[:-1])  # shared digits (a prefix)
    s0 = shift_of(p0 - 1)
    prefix0 = jnp.where(p0 > 0, (lo >> s0) << s0, 0)

    def one_pass(p, carry):
        prefix, _, _ = carry
        shift = shift_of(p)
        thr = prefix + (digit << shift)  # [16]

        def body(i, acc):  # #(x < thr) as the sign bit of x - thr: 2 int ops per compare, not 3
            x, _ = load(i)
            return acc + lax.shift_right_logical(x[None, :] - thr[:, None], 31)

        lt = jnp.sum(lax.fori_loop(0, n_blocks, body, jnp.zeros((16, block), jnp.int32)), axis=1)
        cnt = n_blocks * block - lt  # #(x >= thr): lanes past the data hold -1 and count as below
        jstar = jnp.sum((cnt >= target).astype(jnp.int32)) - 1
        return prefix + (jstar << shift), cnt, jstar

    v, cnt, jstar = lax.fori_loop(p0, len(SHIFTS), one_pass, (prefix0, jnp.zeros((16,), jnp.int32), jnp.int32(0)))
    # The last pass has shift 0 and at most bits 2..0 open, so candidate jstar + 1 is V + 1: it counts x > V.
    return v, jnp.sum(jnp.where(digit == jstar + 1, cnt, 0))


def _count_kernel(lo_ref, hi_ref, bits_ref, cge_ref, cgt_ref, *, block: int, chunk_len: int, sub_shift: int):
    """Per chunk: cge[j] = #(x >= edge_j) for every sub-bucket edge (edge_0 = lo) and cgt = #(x > hi).

    Counts #(x < e) as the sign bit of x - e (no overflow: x >= -1 and e <= hi + 1 <= _MAX_FINITE + 1): two int
    instructions per edge and key (sub, lea.hi) where `acc + (x >= e)` compiles to three (setp, add, predicated mov).
    """
    c = pl.program_id(2)
    lo, hi = lo_ref[0], hi_ref[0]
    n_sub = 1 << sub_shift
    edges = [hi + 1] + [_sub_edge(lo, hi, j, sub_shift) for j in range(n_sub)]  # scalars: 1-D accumulators
    start, n_blocks = c * chunk_len, chunk_len // block

    def body(i, carry):
        x, accs = carry
        x_next = bits_ref[pl.ds(start + jnp.minimum(i + 1, n_blocks - 1) * block, block)]  # in flight meanwhile
        return x_next, tuple(a + lax.shift_right_logical(x - e, 31) for a, e in zip(accs, edges))

    zeros = jnp.zeros((block,), jnp.int32)
    _, accs = lax.fori_loop(0, n_blocks, body, (bits_ref[pl.ds(start, block)], (zeros,) * (n_sub + 1)))
    lanes = jnp.arange(n_sub, dtype=jnp.int32)
    cge = jnp.zeros((n_sub,), jnp.int32)
    for j, a in enumerate(accs[1:]):
        cge = jnp.where(lanes == j, chunk_len - jnp.sum(a), cge)
    cge_ref[...] = cge
    cgt_ref[...] = jnp.full((1,), chunk_len - jnp.sum(accs[0]), jnp.int32)


def _sub_window(k, lo, hi, cge, cgt, cap: int):
    """The sub-bucket holding the k-th largest score, from cge [chunks, n_sub] and cgt [chunks].

    Returns (ok, sub_lo, sub_hi, above [chunks] = #(x > sub_hi), sub [chunks] = #(sub_lo <= x <= sub_hi)). ok is
    exact: #(x > hi) < k <= #(x >= lo) (the window holds the k-th score) and the sub-bucket fits the buffer.
    """
    n_sub = cge.shape[1]
    sub_shift = n_sub.bit_length() - 1
    j = lax.broadcasted_iota(jnp.int32, cge.shape, 1)
    tot = jnp.sum(cge, axis=0)  # [n_sub], non-increasing: #(x >= edge_j)
    jstar = jnp.sum((tot >= k).astype(jnp.int32)) - 1  # last edge with >= k scores at or above it
    last = jstar >= n_sub - 1
    above = jnp.where(last, cgt, jnp.sum(jnp.where(j == jstar + 1, cge, 0), axis=1))
    sub = jnp.sum(jnp.where(j == jstar, cge, 0), axis=1) - above
    ok = (jstar >= 0) & (jnp.sum(cgt) < k) & (jnp.sum(sub) <= cap)
    sub_lo = _sub_edge(lo, hi, jstar, sub_shift)
    sub_hi = jnp.where(last, hi, _sub_edge(lo, hi, jnp.minimum(jstar + 1, n_sub - 1), sub_shift) - 1)
    return ok, sub_lo, sub_hi, above, sub


def _compact_kernel(cnt_ref, lo_ref, hi_ref, cge_ref, cgt_ref, bits_ref, out_ref, *, block: int, chunk_len: int,
                     cap: int, k_max: int, buf: int, interpret: bool):
    """out [idx: k_max | pad | buffer: cap | slack]: ids of x > sub_hi go to idx, the sub-bucket's ids (in index
    order) to the buffer. One scatter store per key for both (each store costs a layout conversion)."""
    b, c = pl.program_id(0), pl.program_id(2)
    ok, sub_lo, sub_hi, above, sub = _sub_window(cnt_ref[b], lo_ref[0], hi_ref[0], cge_ref[...], cgt_ref[...], cap)
    before = jnp.arange(above.shape[0]) < c
    off_above = jnp.sum(jnp.where(before, above, 0))
    off_sub = buf + jnp.sum(jnp.where(before, sub, 0))
    lanes = jnp.arange(block)
    start = c * chunk_len
    n_blocks = chunk_len // block

    def body(i, carry):
        n_above, n_in, x = carry
        # Prefetch the next block (clamped on the last) so its load overlaps this block's scan and stores.
        x_next = bits_ref[pl.ds(start + jnp.minimum(i + 1, n_blocks - 1) * block, block)]
        # Flags as sign bits (no predicates to keep alive across the scan; no overflow: -1 <= x <= _MAX_FINITE).
        up = lax.shift_right_logical(sub_hi - x, 31)  # x > sub_hi
        ge = 1 - lax.shift_right_logical(x - sub_lo, 31)  # x >= sub_lo
        both = (up << 16) + ge - up  # up in the high half, mid = ge - up in the low (a block < 2**15 keys)
        incl = jnp.cumsum(both)  # a key's rank in its half is incl - 1 (the -1 goes into the scalar bases)
        slot = jnp.where(up > 0, (off_above - 1) + n_above + (incl >> 16), (off_sub - 1) + n_in + (incl & 0xFFFF))
        if interpret:  # its masked scatter rewrites every addressed slot: idle lanes get their own slack slots
            slot = jnp.where(ge > 0, slot, buf + cap + lanes)  # (on the GPU idle lanes' slots are in bounds)
        plgpu.store(out_ref.at[slot], start + i * block + lanes, mask=ge > 0)
        tot = jnp.sum(both)
        return n_above + (tot >> 16), n_in + (tot & 0xFFFF), x_next

    x0 = bits_ref[pl.ds(start, block)]
    lax.fori_loop(0, ok.astype(jnp.int32) * n_blocks, body, (jnp.int32(0), jnp.int32(0), x0))


def _finish_kernel(cnt_ref, lo_ref, hi_ref, cge_ref, cgt_ref, bits_ref, _, out_ref, *, block: int,
                    n_row_blocks: int, cap: int, k_max: int, buf: int):
    """Radix select inside the buffered sub-bucket: from registers if it fits FAST_BLOCKS blocks (the usual case:
    its values are gathered once), else looping over the buffer; the full row if the window or the buffer missed."""
    b = pl.program_id(0)
    k = cnt_ref[b]
    ok, sub_lo, sub_hi, above, sub = _sub_window(k, lo_ref[0], hi_ref[0], cge_ref[...], cgt_ref[...], cap)
    n_above, n_sub = jnp.sum(above), jnp.sum(sub)
    need = k - n_above
    lanes = jnp.arange(block)
    dummy = buf + cap  # slack: idle lanes of `_emit`

    def load_buf(i):
        ids = out_ref[pl.ds(buf + i * block, block)]
        live = i * block + lanes < n_sub
        return jnp.where(live, bits_ref[jnp.where(live, ids, 0)], -1), ids

    nb = pl.cdiv(n_sub, block)

    @pl.when(ok & (nb <= FAST_BLOCKS))
    def _registers():  # gather the sub-bucket's values once (all loads in flight), then select from registers
        held = [load_buf(j) for j in range(FAST_BLOCKS)]

        def load(i):
            x, ids = held[0]
            for j in range(1, FAST_BLOCKS):
                x, ids = jnp.where(i == j, held[j][0], x), jnp.where(i == j, held[j][1], ids)
            return x, ids

        thr, n_gt = _radix_select_from(load, nb, need, block, sub_lo, sub_hi)
        _emit(load, nb, thr, n_gt, need, out_ref, n_above, dummy, block)

    @pl.when(ok & (nb > FAST_BLOCKS))
    def _blocks():  # e.g. ties piled into the sub-bucket: correct, slower (re-gathers every pass)
        thr, n_gt = _radix_select_from(load_buf, nb, need, block, sub_lo, sub_hi)
        _emit(load_buf, nb, thr, n_gt, need, out_ref, n_above, dummy, block)

    if FALLBACK:
        @pl.when(jnp.logical_not(ok) & (k > 0))
        def _row():  # the window (or the buffer) missed the k-th score: exact, slow
            def load_row(i):
                return bits_ref[pl.ds(i * block, block)], i * block + lanes

            (thr, ), (n_gt, ) = _radix_select(load_row, n_row_blocks, (k,), block)
            _emit(load_row, n_row_blocks, thr, n_gt, k, out_ref, 0, dummy, block)


def select_topk_bits(bits, kv_len, counts, k_max: int, *, chunks: int, interpret=False):
    """bits [batch, heads, keys_padded] int32 (-1 = ineligible; keys_padded a multiple of chunks * 2048),
    kv_len [batch], counts [batch] (<= k_max) -> idx [batch, heads, k_max] int32, -1 past counts."""
    b, ih, s_pad = bits.shape
    n_sub = 1 << (SUB_SHIFT + (s_pad > LONG_ROW))
    count_block, compact_block, fin_block = BLOCKS["count"], BLOCKS["compact"], BLOCKS["finish"]
    chunk_len = s_pad // chunks
    assert chunk_len % count_block == 0 and chunk_len % compact_block == 0, (s_pad, chunks)
    slack = max(SLACK, compact_block, fin_block)  # every lane that stores nothing needs its own slack slot
    # The buffer holds one sub-bucket (~1/n_sub of the window), but is sized for a whole window,
    # so that ties piled into one sub-bucket still take the window path (the finish then loops over blocks). The
    # window holds ~9 sd of SAMPLE ranks (at most ~6.6% of the row, at q = 0.5) + 2 * 4 / SAMPLE.
    window_max = (9.0 * math.sqrt(SAMPLE * 0.25) + 10.0) / SAMPLE
    row_cap = pl.cdiv(s_pad, fin_block) * fin_block
    cap = min(pl.cdiv(int(1.3 * window_max * s_pad) + 1, fin_block) * fin_block, row_cap)
    cap = max(cap, min(MIN_CAP, row_cap))
    # Only rows the finish holds in registers take the whole row as their window: sub-buckets of [0, _MAX_FINITE]
    # split nothing (the scores' bits fill one or two of them), so longer rows use the sample even below cap.
    t_hi, t_lo = window_targets(kv_len, counts, min(cap, FAST_BLOCKS * fin_block))
    row = lambda *shape: pl.BlockSpec((None, None) + shape, lambda i, j, *_: (i, j) + (0,) * len(shape))
    vec = pl.BlockSpec((b,), lambda *_: (0,))

    lo, hi, _ = pl.pallas_call(
        functools.partial(_sample_kernel, block=BLOCKS["sample"], interpret=bool(interpret)),
        grid=(b, ih),
        in_specs=[vec, vec, vec, row(s_pad)],
        out_specs=[row(1), row(1), row(SAMPLE)],
        out_shape=[jax.ShapeDtypeStruct((b, ih, 1), jnp.int32)] * 2 + [jax.ShapeDtypeStruct((b, ih, SAMPLE),
                                                                                           jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=WARPS["sample"], num_stages=2),
        interpret=interpret, name="kascade_topk_sample",
    )(kv_len, t_hi, t_lo, bits)

    cge, cgt = pl.pallas_call(
        functools.partial(_count_kernel, block=count_block, chunk_len=chunk_len, sub_shift=n_sub.bit_length() - 1),
        grid=(b, ih, chunks),
        in_specs=[row(1), row(1), row(s_pad)],
        out_specs=[pl.BlockSpec((None, None, None, n_sub), lambda i, j, c: (i, j, c, 0)),
                   pl.BlockSpec((None, None, 1), lambda i, j, c: (i, j, c))],
        out_shape=[jax.ShapeDtypeStruct((b, ih, chunks, n_sub), jnp.int32),
                   jax.ShapeDtypeStruct((b, ih, chunks), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=WARPS["count"], num_stages=3),
        interpret=interpret, name="kascade_topk_count",
    )(lo, hi, bits)

    buf = pl.cdiv(k_max, 256) * 256  # the buffer's start in the output row (aligned)
    width = buf + max(cap + slack, FAST_BLOCKS * fin_block)  # the finish loads FAST_BLOCKS blocks unconditionally
    out_shape = jax.ShapeDtypeStruct((b, ih, width), jnp.int32)
    stats = [vec, row(1), row(1), row(chunks, n_sub), row(chunks)]
    out = pl.pallas_call(
        functools.partial(_compact_kernel, block=compact_block, chunk_len=chunk_len, cap=cap, k_max=k_max,
                          buf=buf, interpret=bool(interpret)),
        grid=(b, ih, chunks),
        in_specs=stats + [row(s_pad)],
        out_specs=row(width),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=WARPS["compact"], num_stages=2),
        interpret=interpret, name="kascade_topk_compact",
    )(counts, lo, hi, cge, cgt, bits)

    out = pl.pallas_call(
        functools.partial(_finish_kernel, block=fin_block, n_row_blocks=s_pad // fin_block, cap=cap, k_max=k_max,
                          buf=buf),
        grid=(b, ih),
        in_specs=stats + [row(s_pad), row(width)],
        out_specs=row(width),
        out_shape=out_shape,
        input_output_aliases={6: 0},
        compiler_params=plgpu.CompilerParams(num_warps=WARPS["finish"], num_stages=2),
        interpret=interpret, name="kascade_topk_finish",
    )(counts, lo, hi, cge, cgt, bits, out)
    # Ranks >= count were never written: mask them here (fuses with the slice).
    return jnp.where(jnp.arange(k_max)[None, None, :] < counts[:, None, None], out[..., :k_max], -1)


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


# ----------------------------------------------------------------------------------------------------------
# Short rows (decode caches up to DecodeTuning.short_select_max keys): one program per row, from registers.

SHORT_DIGIT = 1  # bits decided per pass of `select_topk_short` (DecodeTuning.short_select_digit's default)


def _short_passes(digit: int) -> tuple[int, tuple[int, ...]]:
    """(width of the first pass, shifts of the passes after it, `digit` bits each) over the 31 bits of x + 1."""
    first = 31 % digit or digit
    return first, tuple(range(31 - first - digit, -1, -digit))


def _short_kernel(cnt_ref, bits_ref, out_ref, *, s_len: int, k_max: int, digit: int, interpret: bool):
    """The row's top-`count` ids from registers, in id order, with `_emit`'s tie rule (the ids of x > V, then the
    lowest ids of x == V); -1 at ranks count..k_max written here, so no XLA mask follows.

    The threshold V: bisection (digit 1) over bits 30..0 of x + 1, which is >= 0, so a -1 key is a value like any
    other (a count over the eligible keys takes -1 keys lowest id first, as `select_topk_bits` does). A pass counts
    #(x + 1 >= c) for its 2**digit - 1 candidates as sign bits of x - (c - 1) (no overflow: -1 <= x <=
    _MAX_FINITE, 0 <= c - 1 <= 2**31 - 2), one block reduction each; `upper` keeps the count of the smallest
    candidate rejected so far, after the last pass V + 1's: #(x > V). Why bisection: in the SASS (triton 3.9 ptxas
    for sm_90, 16K keys over 8 warps) a count is 171 instructions a warp (a sub and a shift or lea.hi per key, an
    in-thread tree, REDUX.SUM) and two barriers, and a pass's reductions run one after another, so 2-bit digits (16
    passes of 3 counts: 508 instructions, 6 barriers each) issue 46 counts where bisection issues 31. The ranks: one
    scan of both flags packed in 16-bit halves (exclusive, so exact up to 2**16 keys).
    """
    s_pad = 1 << (s_len - 1).bit_length()
    lanes = jnp.arange(s_pad, dtype=jnp.int32)
    if s_pad == s_len:
        x = bits_ref[...]
    else:  # no pad in XLA: clamped in-bounds addresses, the lanes past the row read as -1
        x = plgpu.load(bits_ref.at[jnp.minimum(lanes, s_len - 1)], mask=lanes < s_len, other=-1)
    k = cnt_ref[pl.program_id(0)]

    def one_pass(shift, width, prefix, upper):
        cnts = [s_pad - jnp.sum(lax.shift_right_logical(x - (prefix + (j << shift) - 1), 31))
                for j in range(1, 1 << width)]  # #(x + 1 >= candidate j), non-increasing in j
        jstar = sum((c >= k).astype(jnp.int32) for c in cnts)
        for j in reversed(range(len(cnts))):
            upper = jnp.where(jstar == j, cnts[j], upper)
        return prefix + (jstar << shift), upper

    first, shifts = _short_passes(digit)
    prefix, upper = one_pass(31 - first, first, jnp.int32(0), jnp.int32(0))  # nothing lies at or above 2**31
    prefix, upper = lax.fori_loop(0, len(shifts), lambda p, c: one_pass(shifts[0] - digit * p, digit, *c),
                                  (prefix, upper))  # a loop, not unrolled: one pass's code stays in the icache
    thr, n_gt = prefix - 1, upper
    gt = lax.shift_right_logical(thr - x, 31)  # x > thr
    eq = (x == thr).astype(jnp.int32)
    both = (gt << 16) + eq  # ranks below 2**16 in each half; the int32 sum may wrap, the difference does not
    before = jnp.cumsum(both) - both
    gt_before, eq_before = lax.shift_right_logical(before, 16), before & 0xFFFF
    take = k - n_gt  # ids with x == thr taken, lowest first
    rank = gt_before + jnp.minimum(eq_before, take)
    keep = (gt > 0) | ((eq > 0) & (eq_before < take))  # (ranks of kept ids are < k: no guard needed)
    ranks = jnp.arange(1 << (k_max - 1).bit_length(), dtype=jnp.int32)
    plgpu.store(out_ref.at[ranks], jnp.full(ranks.shape, -1, jnp.int32), mask=(ranks >= k) & (ranks < k_max))
    if interpret:  # its masked scatter rewrites every addressed slot: idle lanes get their own slack slots
        rank = jnp.where(keep, rank, k_max + lanes)  # (on the GPU they store nothing: no select, fewer registers)
    plgpu.store(out_ref.at[rank], lanes, mask=keep)


def select_topk_short(bits, counts, k_max: int, *, digit: int = SHORT_DIGIT, warps: int = 0, interpret=False):
    """`select_topk_bits` for rows that fit one program's registers: bits [batch, heads, keys] int32 (-1 =
    ineligible; keys unpadded: a row that is not a power of two long is read masked), counts [batch] (<= k_max <=
    keys) -> idx [batch, heads, k_max] int32, -1 past counts. One launch, grid (batch, heads).

    warps 0: 64 keys a thread (the padded row / 2048, in [4, 16]). Registers (triton 3.9 ptxas for sm_90, read on
    the CPU): 16K keys over 8 warps take 255 a thread, 32K over 16 warps 128 (the cap at 512 threads); the search
    loop spills nothing at either, the scan spills a little (~30 / ~250 local loads and stores a thread). 64K keys
    spill inside the loop at 16 or 32 warps.
    """
    b, ih, s_len = bits.shape
    s_pad = 1 << (s_len - 1).bit_length()
    if not 1 <= k_max <= s_len:
        raise ValueError(f"k_max must be in [1, keys={s_len}], got {k_max}")
    warps = warps or min(16, max(4, s_pad // 2048))
    width = k_max + s_pad if interpret else k_max  # interpret mode: slack slots for the idle lanes
    row = lambda n: pl.BlockSpec((None, None, n), lambda i, j: (i, j, 0))
    out = pl.pallas_call(
        functools.partial(_short_kernel, s_len=s_len, k_max=k_max, digit=digit, interpret=bool(interpret)),
        grid=(b, ih),
        in_specs=[pl.BlockSpec((b,), lambda *_: (0,)), row(s_len)],
        out_specs=row(width),
        out_shape=jax.ShapeDtypeStruct((b, ih, width), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret, name="kascade_topk_short",
    )(counts, bits)
    return out[..., :k_max] if interpret else out
