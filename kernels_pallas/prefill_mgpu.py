"""Mosaic GPU (Hopper: TMA, wgmma, warp-specialised) versions of the two anchor-prefill sweeps of `prefill.py`.

(a) `flash_lse`: causal GQA flash attention with the per-row base-2 log-sum-exp of the scaled logits (and the dense
output for anchor layer 0), built on the FA3 structure of `jax.experimental.pallas.ops.gpu.attention_mgpu`: two
compute warpgroups of `block_q` rows each, one TMA producer warpgroup, a `max_concurrent_steps`-deep K/V ring.
(b) `pooled_scores`: for every query tile and KV head, sum over the tile's rows and the GQA group of the
post-softmax probabilities exp2(s * scale2 - lse_row) of each key strictly before the tile; -inf elsewhere
(`reference.pooled_scores_prefill_reference`). Computed transposed, S^T = K_blk . Q_tile^T (wgmma M = 64 keys per
compute warpgroup, N = tile rows x heads), so pooling over the tile's rows is a reduction within each thread quad
of the accumulator (no cross-warp reduction); the group's heads sit in N (or in a loop of sub-groups).
(c) `reuse_blocks`: the sparse reuse prefill over selections of whole key blocks, K/V moved by TMA block copies.

Decisions: wgmma accumulators start at zero (`run_scoped` ACC) and the PV product is added to the running output in
registers, and in interpret mode P goes to wgmma through shared memory: the Mosaic GPU interpreter of JAX 0.11.2
handles neither `run_state` (pre-initialised accumulators) nor a wgmma operand held in registers. On a GPU P stays
in registers (`p_in_regs`). Scope: batch 1, q_start 0, kv_len = q_len, q_len a multiple of the blocks; everything
else raises ValueError so that callers keep the Triton path (`supported`). `supported` checks q_start on the host;
`prefill.anchor_prefill` calls these kernels for any chunk at position 0, whatever its kv_len (traced or not): the keys
past the chunk are never visible from there, and padding rows get an infinite LSE, which takes them out of the
pooled scores.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import prefill as P

_LOG2E = 1.4426950408889634
_TILE_SIZES = (16, 32, 64)
_HEAD_DIMS = (64, 128)
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_FP8 = jnp.dtype(jnp.float8_e4m3fn)  # the score passes only (no P.V): `flash_lse(with_out=False)`, `pooled_scores`
_COMPUTE_WGS = 2
# Without Mosaic GPU's default 2 KB reduction scratch: no reduction here crosses warps (a WGMMA-layout tile's row max
# and sum stay within a warp; the lowering raises if one would need it), and those 2 KB are what kept 3-deep K/V
# rings out of sm_90's 227 KB (the block reuse at 128-key steps, the dense pass at 128, the LSE pass at 256).
_COMPILER_PARAMS = plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0)


@dataclasses.dataclass(frozen=True)
class MgpuTuning:
    """Block sizes of the two kernels (untuned: the GPU session picks them)."""

    block_q: int = 64  # query rows per compute warpgroup of the flash pass (two per program)
    block_kv: int = 128  # keys per pipeline step of the flash pass
    # ... of the LSE-only flash pass (no V ring, so 256 fits in shared memory at d 128; H100, 2026-12-05, 128K, the 8B
    # shape: 160.1 -> 150.6 ms); where q_len is not a multiple of it, block_kv
    lse_block_kv: int = 256
    # Query rows per compute warpgroup of the LSE-only pass: 128 halves the bytes of K streamed per logit (each
    # program reads every key before its rows into shared memory: 550 GB from L2 at 128K, 8B shape), at 128-key steps
    # (the same 64 x 256 fp32 accumulator). Where q_len is not a multiple of 256, block_q. Off until timed.
    lse_block_q: int = 64
    max_concurrent_steps: int = 2  # K/V (flash) or K (scores) ring depth
    use_schedule_barrier: bool = True  # FA3's ping-pong of the two compute warpgroups
    scores_block_k: int = 64  # keys per compute warpgroup per step of the scores pass (wgmma M: 64)
    scores_row_cap: int = 128  # wgmma N cap (tile tokens x heads of one product) of the scores pass
    p_in_regs: bool | None = None  # flash pass: P as a register wgmma operand; None: yes on GPU, no in interpret
    # Flash passes: the row max of the raw q.k (scaled once per row) and p = exp2(s * scale - m) as one FMA a logit,
    # as `attention_mgpu` does, instead of scaling every logit before the max (one multiply a logit fewer; the same
    # max: the scale is positive). On since it was timed (H100, 2026-12-06, 128K, 8B shape): the LSE pass 151.1 ->
    # 141.6 ms (its steady loop 730 -> 604 SASS instructions), dense+LSE within noise, the same errors.
    fma_softmax: bool = True
    # Score pass: the exp2 of this many of each product's query columns (tile rows x heads; where a product has more;
    # 0, 16, 32, 48 or 64) as a degree-3 polynomial on the FMA pipes (`_exp2_poly`, FA4's software exp2), the rest on
    # the MUFU. Off: 16 columns measured -8% once, inside that pass's +-4% spread (H100, 2026-12-06); the same lever
    # in the LSE pass and the block reuse gained nothing and was removed (benchmarks/NOTES.md session 35).
    scores_poly_exp2_cols: int = 0

    def __post_init__(self):
        if self.block_q != 64:
            raise ValueError(f"block_q must be 64 (one wgmma M per warpgroup), got {self.block_q}")
        if self.lse_block_q not in (64, 128):
            raise ValueError(f"lse_block_q must be 64 or 128, got {self.lse_block_q}")
        for name in ("block_kv", "lse_block_kv"):
            if getattr(self, name) not in (64, 128, 256):
                raise ValueError(f"{name} must be 64, 128 or 256, got {getattr(self, name)}")
        if self.scores_block_k != 64:
            raise ValueError(f"scores_block_k must be 64, got {self.scores_block_k}")
        if not 2 <= self.max_concurrent_steps <= 8:
            raise ValueError(f"max_concurrent_steps must be in [2, 8], got {self.max_concurrent_steps}")
        if self.scores_row_cap not in (64, 128, 256):
            raise ValueError(f"scores_row_cap must be 64, 128 or 256, got {self.scores_row_cap}")
        if self.scores_poly_exp2_cols not in (0, 16, 32, 48, 64):
            raise ValueError(f"scores_poly_exp2_cols must be 0, 16, 32, 48 or 64, got {self.scores_poly_exp2_cols}")


DEFAULT_TUNING = MgpuTuning()

# 2**f on [-1/2, 1/2], degree 3, fit for the least largest relative error (7.5e-5; P is rounded to bf16 anyway)
_EXP2_COEFFS = (0.99992807, 0.69326099, 0.24261115, 0.05517167)
_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: x + it holds round(x) in its low mantissa bits (|x| < 2**22)


def _exp2_poly(x):
    """2**x (fp32, x <= 1/2) without the MUFU: round x to j by the magic-number add, 2**(x - j) by a polynomial,
    then j added to the exponent field as an integer (the magic sum's bits shifted by 23 are j << 23 modulo 2**32).
    x is clamped at -126 (the polynomial's exponent field plus j stays >= 0), so -inf gives ~2**-126, not 0: a term
    of a sum that the row's max term (1) dwarfs."""
    x = jnp.maximum(x, -126.0)
    t = lax.optimization_barrier(x + _ROUND_MAGIC)  # (else a simplifier may fold (x + M) - M to x, as XLA's does)
    f = x - (t - _ROUND_MAGIC)
    c0, c1, c2, c3 = _EXP2_COEFFS
    p = c0 + f * (c1 + f * (c2 + f * c3))
    bits = lax.bitcast_convert_type(p, jnp.int32) + lax.shift_left(lax.bitcast_convert_type(t, jnp.int32),
                                                                     jnp.int32(23))
    return lax.bitcast_convert_type(bits, jnp.float32)


def _exp2_cols(x, n_poly: int):
    """exp2 of a [rows, cols] tile: its last n_poly columns by `_exp2_poly` on the FMA pipes, the rest on the MUFU
    (all on the MUFU unless 0 < n_poly < cols)."""
    if not 0 < n_poly < x.shape[1]:
        return jnp.exp2(x)
    cut = x.shape[1] - n_poly
    return jnp.concatenate([jnp.exp2(x[:, :cut]), _exp2_poly(x[:, cut:])], axis=1)


def _interpret_params(interpret):
    if interpret is True:
        return plgpu.InterpretGPUParams()
    return interpret or None


def _operand_reason(q, k, fp8_ok=False):
    """None if q [batch, len, q_heads, d] and k [batch, len, kv_heads, d] suit every kernel here (fp8_ok: also
    float8_e4m3fn, for the passes without P.V), else why not."""
    if q.ndim != 4 or k.ndim != 4:
        return f"q and k must be 4-D [batch, len, heads, d], got {q.shape} and {k.shape}"
    b, _, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        return f"k {k.shape} does not match q {q.shape} in batch or head_dim"
    if hq % k.shape[2]:
        return f"q_heads ({hq}) must be a multiple of kv_heads ({k.shape[2]})"
    if d not in _HEAD_DIMS:
        return f"head_dim must be one of {_HEAD_DIMS}, got {d}"
    ok = _DTYPES + ((_FP8,) if fp8_ok else ())
    if jnp.dtype(q.dtype) not in ok or k.dtype != q.dtype:
        names = "bfloat16, float16 or float8_e4m3fn" if fp8_ok else "bfloat16 or float16"
        return f"dtype must be {names} (q and k alike), got {q.dtype} / {k.dtype}"
    return None


def unsupported_reason(q, k, tile_size=None, *, q_start=None, tuning: MgpuTuning | None = None, fp8_ok=False):
    """None if these operands are in scope, else a one-line reason naming the parameter."""
    tuning = tuning or DEFAULT_TUNING
    why = _operand_reason(q, k, fp8_ok)
    if why is not None:
        return why
    b, t = q.shape[:2]
    if b != 1:
        return f"batch must be 1, got {b}"
    if k.shape[1] != t:
        return f"kv_len (k.shape[1]={k.shape[1]}) must equal q_len ({t})"
    blk = max(_COMPUTE_WGS * tuning.block_q, tuning.block_kv, tuning.scores_block_k * _COMPUTE_WGS)
    if t % blk:
        return f"q_len must be a multiple of {blk}, got {t}"
    if tile_size is not None and tile_size not in _TILE_SIZES:
        return f"tile_size must be one of {_TILE_SIZES}, got {tile_size}"
    if q_start is not None:  # (kv_len is no condition: see the module docstring)
        if isinstance(q_start, jax.core.Tracer):
            return "q_start must be concrete (host-checkable), got a tracer"
        qs = np.asarray(q_start)  # host-side: under a jit trace a jnp op on a concrete array is staged (a tracer)
        if qs.size != b or int(qs.reshape(-1)[0]) != 0:
            return f"q_start must be [0], got {q_start}"
    return None


def supported(q, k, tile_size=None, *, q_start=None, tuning: MgpuTuning | None = None) -> bool:
    """Whether `flash_lse` / `pooled_scores` take these operands (else keep the Triton path)."""
    return unsupported_reason(q, k, tile_size, q_start=q_start, tuning=tuning) is None


def _check(q, k, tile_size=None, tuning=None, fp8_ok=False):
    why = unsupported_reason(q, k, tile_size, tuning=tuning, fp8_ok=fp8_ok)
    if why is not None:
        raise ValueError(f"prefill_mgpu: {why}")


def _swizzled(shape, dtype):
    """Shared memory for a wgmma / TMA operand whose minor dimension is contiguous: 128-byte swizzle (64-byte for
    a row of 64 one-byte elements), tiles of 8 rows x one swizzle width."""
    width = min(128, shape[-1] * jnp.dtype(dtype).itemsize)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, width // jnp.dtype(dtype).itemsize)),
                                                plgpu.SwizzleTransform(width)))


def _p_operand(p, dtype, p_smem):
    """P for the P.V wgmma: in registers, or through `p_smem` when given (the interpreter reads wgmma operands from
    shared memory only)."""
    p16 = p.astype(dtype)
    if p_smem is None:
        return p16
    p_smem[...] = p16
    plgpu.commit_smem()
    return p_smem


def _mult_operand(scale_mult):
    """() or (scale_mult as fp32 [1]): the kernels' optional first operand."""
    if scale_mult is None:
        return ()
    m = jnp.asarray(scale_mult, jnp.float32)
    if m.size != 1:
        raise ValueError(f"prefill_mgpu: scale_mult must hold one number, got shape {m.shape}")
    return (jnp.reshape(m, (1,)),)


def _producer_ring(n_steps, steps: int, load, consumed):
    """The producer warpgroup's ring: the first `steps` loads, then step j + steps into step j's slot once
    `consumed(j)` has waited for it. The last phases are observed too: the interpreter checks, when a barrier is
    freed, that every thread that waits on it saw all its phases."""
    for i in range(steps):
        pl.when(i < n_steps)(lambda i=i: load(jnp.int32(i), i))
    last = jnp.maximum(n_steps - steps, 0)

    @pl.loop(0, last)
    def _(j):
        consumed(j)
        load(j + steps, lax.rem(j, steps))

    pl.loop(last, n_steps)(consumed)


# ---------------------------------------------------------------------------------------------------------------
# (a) Causal flash pass: base-2 LSE [batch, q_heads, q_len] (+ dense output).


def flash_lse(q, k, v=None, *, scale=None, with_out=True, tuning: MgpuTuning | None = None, interpret=False,
              scale_mult=None):
    """q [1, T, q_heads, d], k/v [1, T, kv_heads, d] -> (out like q or None, lse [1, q_heads, T] fp32), lse the
    base-2 log-sum-exp of the base-2 logits s * scale * log2(e) over the causal keys (`prefill._dense_kernel`'s
    convention; `lse_for_triton` gives its packed rows). with_out=False also takes float8_e4m3fn q and k (the logits
    of the fp8 values, accumulated in fp32). scale_mult: fp32 [1] (may be traced), a factor on every logit on top of
    `scale` (the fp8 operands' scales, `reference.fp8_score_operands`); None: no such operand."""
    tuning = tuning or DEFAULT_TUNING
    _check(q, k, tuning=tuning, fp8_ok=not with_out)
    if with_out and (v is None or v.shape != k.shape or v.dtype != k.dtype):
        raise ValueError(f"prefill_mgpu: v must match k {k.shape} {k.dtype} when with_out, got "
                         f"{None if v is None else (v.shape, v.dtype)}")
    b, t, hq, d = q.shape
    kvh = k.shape[2]
    group = hq // kvh
    dtype = q.dtype
    scale2 = (1.0 / math.sqrt(d) if scale is None else float(scale)) * _LOG2E
    wgs = _COMPUTE_WGS
    block_q, block_kv = tuning.block_q, tuning.block_kv
    if not with_out and t % tuning.lse_block_kv == 0:
        block_kv = tuning.lse_block_kv
    if not with_out and t % (wgs * tuning.lse_block_q) == 0:
        block_q = tuning.lse_block_q
        block_kv = min(block_kv, 64 * 256 // block_q)  # the logit tile stays 64 x 256 fp32 registers
    steps = min(tuning.max_concurrent_steps, t // block_kv)
    interp = _interpret_params(interpret)
    p_regs = tuning.p_in_regs if tuning.p_in_regs is not None else interp is None

    def kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, scoped, mult_ref=None):
        bi = lax.axis_index("batch")
        q_head = lax.axis_index("heads")
        wg = lax.axis_index("wg")
        s2 = scale2 if mult_ref is None else scale2 * mult_ref[0]
        (qo_smem2, k_smem, v_smem, lse_smem2, p_smem2), (k_bar, v_bar, q_bar), (k_free, v_free), sched = scoped

        def schedule_barrier():
            if tuning.use_schedule_barrier:
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(sched)

        q_blk = lax.axis_index("q_seq")
        prog_kv_steps = pl.cdiv((q_blk + 1) * (wgs * block_q), jnp.array(block_kv, jnp.int32))

        @pl.when(wg < wgs)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            qo_smem, lse_smem = qo_smem2.at[wg], lse_smem2.at[wg]
            q_base = q_blk * (wgs * block_q) + wg * block_q
            kv_steps = pl.cdiv(q_base + block_q, jnp.array(block_kv, jnp.int32))
            plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(q_base, block_q), q_head], qo_smem, q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
            m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((block_q,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((block_q, d), 0, jnp.float32), plgpu.Layout.WGMMA)

            @pl.when(kv_steps > 0)
            def _():
                plgpu.barrier_wait(k_bar.at[0])

            pl.when(wg == 1)(schedule_barrier)

            def kv_loop(step, carry, causal=False):
                acc, m_i, l_i = carry
                slot = lax.rem(step, jnp.array(steps, step.dtype))

                def compute_qk(acc_ref):
                    plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                    schedule_barrier()
                    return acc_ref[...]

                s = pl.run_scoped(compute_qk, plgpu.ACC((block_q, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if not tuning.fma_softmax:
                    s = s * s2
                if causal:
                    rows = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1, layout=plgpu.Layout.WGMMA)
                    s = jnp.where(rows + q_base >= cols + step * block_kv, s, -jnp.inf)
                if tuning.fma_softmax:  # m in base-2 logit units, s raw: exp2(s * s2 - m) is one FMA
                    m_new = jnp.maximum(m_i, s.max(axis=1) * s2)
                    x = s * s2 - lax.broadcast_in_dim(m_new, s.shape, [0])
                else:
                    m_new = jnp.maximum(m_i, s.max(axis=1))
                    x = s - lax.broadcast_in_dim(m_new, s.shape, [0])
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(x)
                l_i = l_i * alpha + p.sum(axis=1)
                if not with_out:
                    schedule_barrier()
                    pl.when(step + 1 < kv_steps)(lambda: plgpu.barrier_wait(k_bar.at[lax.rem(
                        step + 1, jnp.array(steps, step.dtype))]))
                    return acc, m_new, l_i
                p_op = _p_operand(p, dtype, None if p_regs else p_smem2.at[wg])
                acc, l_i, m_new = lax.optimization_barrier((acc, l_i, m_new))
                if tuning.use_schedule_barrier:
                    plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_bar.at[slot])
                if tuning.use_schedule_barrier:
                    plgpu.barrier_wait(sched)

                def compute_pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_op, v_smem.at[slot])
                    nxt = step + 1

                    @pl.when(nxt < kv_steps)
                    def _():
                        plgpu.barrier_wait(k_bar.at[lax.rem(nxt, jnp.array(steps, step.dtype))])

                    return acc_ref[...]

                pv = pl.run_scoped(compute_pv, plgpu.ACC((block_q, d), jnp.float32))
                plgpu.barrier_arrive(v_free.at[slot])
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
                return acc, m_new, l_i

            def flush(step, _):  # the producer loads the blocks the other warpgroup needs: take them and hand back
                slot = lax.rem(step, jnp.array(steps, step.dtype))
                # (waiting is needed only to keep this warpgroup's view of the barrier phases exact: the interpreter
                # checks it when the barriers are freed)
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                if with_out:
                    plgpu.barrier_wait(v_bar.at[slot])
                    plgpu.barrier_arrive(v_free.at[slot])
                schedule_barrier()
                schedule_barrier()

            full = lax.div(q_base, jnp.array(block_kv, jnp.int32))
            carry = lax.fori_loop(0, full, kv_loop, (acc, m_i, l_i))
            acc, m_i, l_i = lax.fori_loop(full, kv_steps, lambda j, c: kv_loop(j, c, True), carry)
            lax.fori_loop(kv_steps, prog_kv_steps, flush, None)
            pl.when(wg == 0)(schedule_barrier)
            lse_smem[...] = m_i + jnp.log2(l_i)
            if with_out:
                qo_smem[...] = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(dtype)
            plgpu.commit_smem()
            if with_out:
                plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[bi, pl.ds(q_base, block_q), q_head])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bi, q_head, pl.ds(q_base, block_q)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == wgs)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            kv_head = lax.div(q_head, jnp.array(group, q_head.dtype))

            def load(step, slot):
                src = (bi, pl.ds(step * block_kv, block_kv), kv_head)
                plgpu.copy_gmem_to_smem(k_ref.at[src], k_smem.at[slot], k_bar.at[slot])
                if with_out:
                    plgpu.copy_gmem_to_smem(v_ref.at[src], v_smem.at[slot], v_bar.at[slot])

            def consumed(j):  # wait until both compute warpgroups are done with step j's buffers
                plgpu.barrier_wait(k_free.at[lax.rem(j, steps)])
                if with_out:
                    plgpu.barrier_wait(v_free.at[lax.rem(j, steps)])

            _producer_ring(prog_kv_steps, steps, load, consumed)

    def kascade_prefill_lse_mgpu(*refs):
        mult_ref, refs = (refs[0], refs[1:]) if scale_mult is not None else (None, refs)
        if with_out:
            q_ref, k_ref, v_ref, out_ref, lse_ref = refs
        else:
            (q_ref, k_ref, lse_ref), v_ref, out_ref = refs, None, None
        smem = [_swizzled((wgs, block_q, d), dtype), _swizzled((steps, block_kv, d), dtype),
                _swizzled((steps, block_kv, d), dtype) if with_out else None,
                plgpu.SMEM((wgs, block_q), jnp.float32),
                _swizzled((wgs, block_q, block_kv), dtype) if with_out and not p_regs else None]
        pl.run_scoped(
            lambda *scoped: kernel(q_ref, k_ref, v_ref, out_ref, lse_ref, scoped, mult_ref),
            smem,
            (plgpu.Barrier(num_barriers=steps), plgpu.Barrier(num_barriers=steps), plgpu.Barrier(num_barriers=wgs)),
            (plgpu.Barrier(num_arrivals=wgs, num_barriers=steps),) * 2,
            plgpu.Barrier(num_arrivals=wgs),
            collective_axes="wg",
        )

    lse_type = jax.ShapeDtypeStruct((b, hq, t), jnp.float32)
    out_type = [jax.ShapeDtypeStruct(q.shape, dtype), lse_type] if with_out else [lse_type]
    res = plgpu.kernel(
        kascade_prefill_lse_mgpu, out_type=out_type, grid=(hq, t // (wgs * block_q), b),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=wgs + 1, thread_name="wg", compiler_params=_COMPILER_PARAMS, interpret=interp,
    )(*_mult_operand(scale_mult), *((q, k, v) if with_out else (q, k)))
    return (res[0], res[1]) if with_out else (None, res[0])


# ---------------------------------------------------------------------------------------------------------------
# (b) Pooled post-softmax scores of every tile over the keys strictly before it.


@dataclasses.dataclass(frozen=True)
class _Rows:
    """How one tile's rows (tile tokens x GQA heads) are packed into wgmma N: row = tile_row * g_sub + head."""

    tile: int
    group: int
    g_sub: int  # heads per product
    n_sub: int  # products per tile

    @property
    def n(self) -> int:
        return self.tile * self.g_sub


def _rows(tile_size, group, cap) -> _Rows:
    g_sub = P._group_split(group, tile_size, cap)
    return _Rows(tile_size, group, g_sub, group // g_sub)


def _pack_q(q, kv_heads, rows: _Rows):
    """[1, T, q_heads, d] -> [1, kv_heads, n_sub, tiles, tile * g_sub, d] (row = tile_row * g_sub + head)."""
    b, t, _, d = q.shape
    nt = t // rows.tile
    x = q.reshape(b, nt, rows.tile, kv_heads, rows.n_sub, rows.g_sub, d).transpose(0, 3, 4, 1, 2, 5, 6)
    return x.reshape(b, kv_heads, rows.n_sub, nt, rows.n, d)


def _pack_lse(lse, kv_heads, rows: _Rows):
    """`flash_lse`'s [1, q_heads, T] -> [1, kv_heads, n_sub, tiles, tile * g_sub], rows as `_pack_q`."""
    b, _, t = lse.shape
    nt = t // rows.tile
    x = lse.reshape(b, kv_heads, rows.n_sub, rows.g_sub, nt, rows.tile).transpose(0, 1, 2, 4, 5, 3)
    return x.reshape(b, kv_heads, rows.n_sub, nt, rows.n)


def lse_for_triton(lse, q, k, tile_size):
    """`flash_lse`'s [1, q_heads, T] -> the packed base-2 rows `prefill._scores_kernel` reads (`prefill._layout`)."""
    lay = P._layout(q, k, tile_size)
    return P.pack_lse(jnp.transpose(lse, (0, 2, 1)) / _LOG2E, lay)


def pack_scores_inputs(q, k, lse, tile_size, tuning: MgpuTuning | None = None):
    """(q, lse) in the packed layouts `pooled_scores` reads, for `pooled_scores(..., packed=)`: a caller looping over
    windows of tiles packs once outside its loop (XLA does not hoist the transposes out of a while loop: at 128K on
    the 8B shape the 16 windows' copies of q cost 10.8 ms of an anchor layer's 402)."""
    tuning = tuning or DEFAULT_TUNING
    rows = _rows(tile_size, q.shape[2] // k.shape[2], tuning.scores_row_cap)
    return _pack_q(q, k.shape[2], rows), _pack_lse(lse, k.shape[2], rows)


def pooled_scores(q, k, lse, tile_size, *, scale=None, tuning: MgpuTuning | None = None, interpret=False,
                  first_tile=None, n_tiles=None, width=None, packed=None, scale_mult=None):
    """q [1, T, q_heads, d], k [1, T, kv_heads, d], lse [1, q_heads, T] (`flash_lse`) -> [1, kv_heads, tiles, T]
    fp32: per tile and KV head, the sum over the tile's rows and the group's heads of exp2(s * scale2 - lse_row) for
    every key strictly before the tile, -inf at and after the tile start (`pooled_scores_prefill_reference`).

    A window of tiles (the anchor pipeline bounds the scores held at once): `first_tile` (int32 [1], may be traced)
    and `n_tiles` (static) give [1, kv_heads, n_tiles, width] for the tiles first_tile, first_tile + 1, ...; rows
    of tiles past the last one are all -inf. `width` (static, a multiple of 128, >= T): keys past T are -inf.
    `packed`: `pack_scores_inputs(q, k, lse, tile_size, tuning)`, computed once by a caller that loops over windows.
    q and k may be float8_e4m3fn (the logits of the fp8 values, accumulated in fp32); scale_mult as `flash_lse`'s."""
    tuning = tuning or DEFAULT_TUNING
    _check(q, k, tile_size, tuning, fp8_ok=True)
    b, t, hq, d = q.shape
    kvh = k.shape[2]
    if lse.shape != (b, hq, t) or lse.dtype != jnp.float32:
        raise ValueError(f"prefill_mgpu: lse must be float32 [{b}, {hq}, {t}], got {lse.dtype} {lse.shape}")
    rows = _rows(tile_size, hq // kvh, tuning.scores_row_cap)
    n, n_sub, nt = rows.n, rows.n_sub, t // tile_size
    n_w = nt if n_tiles is None else int(n_tiles)
    width = t if width is None else int(width)
    if n_w < 1 or width < t or width % (_COMPUTE_WGS * tuning.scores_block_k):
        raise ValueError(f"prefill_mgpu: n_tiles must be >= 1 and width a multiple of "
                         f"{_COMPUTE_WGS * tuning.scores_block_k} >= q_len {t}, got {n_tiles} / {width}")
    first = jnp.zeros((1,), jnp.int32) if first_tile is None else jnp.reshape(first_tile, (1,)).astype(jnp.int32)
    scale2 = (1.0 / math.sqrt(d) if scale is None else float(scale)) * _LOG2E
    bk = tuning.scores_block_k
    wgs = _COMPUTE_WGS
    step_k = wgs * bk  # keys per pipeline step (each compute warpgroup takes bk of them)
    steps = tuning.max_concurrent_steps
    qp, lsep = pack_scores_inputs(q, k, lse, tile_size, tuning) if packed is None else packed
    if qp.shape != (b, kvh, n_sub, nt, n, d) or lsep.shape != (b, kvh, n_sub, nt, n):
        raise ValueError(f"prefill_mgpu: packed must be pack_scores_inputs(q, k, lse, {tile_size}) of these operands, "
                         f"got shapes {qp.shape} / {lsep.shape}")
    interp = _interpret_params(interpret)

    def kascade_prefill_scores_mgpu(*refs, q_smem, lse_smem, k_smem, o_smem, q_bar, k_bar, k_free):
        mult_ref, refs = (refs[0], refs[1:]) if scale_mult is not None else (None, refs)
        first_ref, q_ref, lse_ref, k_ref, out_ref = refs
        s2 = scale2 if mult_ref is None else scale2 * mult_ref[0]
        bi = lax.axis_index("batch")
        h = lax.axis_index("kvh")
        tl = n_w - 1 - lax.axis_index("tile")  # later tiles have more keys: they start first
        tw = first_ref[0] + tl
        tt = jnp.minimum(tw, nt - 1)  # (a window past the last tile reads the last tile's rows and writes -inf)
        wg = lax.axis_index("wg")
        e = jnp.where(tw < nt, tt * tile_size, 0)  # eligible keys [0, e)
        n_steps = pl.cdiv(e, jnp.array(step_k, jnp.int32))

        @pl.when(wg < wgs)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            plgpu.barrier_wait(q_bar)
            lses = [plgpu.load(lse_smem.at[s], layout=plgpu.Layout.WGMMA.reduce(0)) for s in range(n_sub)]
            o_smem[wg, 2] = plgpu.layout_cast(jnp.full((bk,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))

            def step(j, carry):
                slot = lax.rem(j, jnp.array(steps, j.dtype))
                bar = wg * steps + slot
                plgpu.barrier_wait(k_bar.at[bar])
                tot = plgpu.layout_cast(jnp.zeros((bk,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
                for s in range(n_sub):
                    def qk(acc_ref, s=s):
                        plgpu.wgmma(acc_ref, k_smem.at[wg, slot], q_smem.at[s].transpose((1, 0)))
                        return acc_ref[...]

                    st = pl.run_scoped(qk, plgpu.ACC((bk, n), jnp.float32))
                    # (a key at or after the tile start may overflow either exp2: its sum is replaced by -inf below)
                    x = st * s2 - lax.broadcast_in_dim(lses[s], (bk, n), [1])
                    tot = tot + _exp2_cols(x, tuning.scores_poly_exp2_cols).sum(axis=1)
                plgpu.barrier_arrive(k_free.at[bar])
                kidx = j * step_k + wg * bk + plgpu.broadcasted_iota(jnp.int32, (bk,), 0,
                                                                     layout=plgpu.Layout.WGMMA.reduce(1))
                buf = lax.rem(j, 2)
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the copy that last read this buffer is done
                o_smem[wg, buf] = jnp.where(kidx < e, tot, -jnp.inf)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[wg, buf], out_ref.at[bi, h, tl, pl.ds(j * step_k + wg * bk, bk)])
                return carry

            lax.fori_loop(0, n_steps, step, None)
            plgpu.commit_smem()

            @pl.loop(n_steps, width // step_k)
            def _(j):  # keys at and after the tile start: -inf
                plgpu.copy_smem_to_gmem(o_smem.at[wg, 2], out_ref.at[bi, h, tl, pl.ds(j * step_k + wg * bk, bk)])

            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == wgs)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            for s in range(n_sub):  # (one [n, d] box each: a swizzled d-128 box with the n_sub axis has too many
                # dimensions for one TMA copy)
                plgpu.copy_gmem_to_smem(q_ref.at[bi, h, s, tt], q_smem.at[s], q_bar)
            plgpu.copy_gmem_to_smem(lse_ref.at[bi, h, :, tt], lse_smem, q_bar)

            def load(j, slot):
                for w in range(wgs):
                    plgpu.copy_gmem_to_smem(k_ref.at[bi, pl.ds(j * step_k + w * bk, bk), h], k_smem.at[w, slot],
                                            k_bar.at[w * steps + slot])

            def consumed(j):
                for w in range(wgs):
                    plgpu.barrier_wait(k_free.at[w * steps + lax.rem(j, steps)])

            _producer_ring(n_steps, steps, load, consumed)

    return plgpu.kernel(
        kascade_prefill_scores_mgpu, out_type=jax.ShapeDtypeStruct((b, kvh, n_w, width), jnp.float32),
        scratch_types=dict(
            q_smem=_swizzled((n_sub, n, d), q.dtype), lse_smem=plgpu.SMEM((n_sub, n), jnp.float32),
            k_smem=_swizzled((wgs, steps, bk, d), q.dtype), o_smem=plgpu.SMEM((wgs, 3, bk), jnp.float32),
            q_bar=plgpu.Barrier(num_arrivals=n_sub + 1), k_bar=plgpu.Barrier(num_barriers=wgs * steps),
            k_free=plgpu.Barrier(num_barriers=wgs * steps)),
        grid=(n_w, kvh, b), grid_names=("tile", "kvh", "batch"), num_threads=wgs + 1, thread_name="wg",
        compiler_params=_COMPILER_PARAMS, interpret=interp,
    )(*_mult_operand(scale_mult), first, qp, lsep, k)


# ---------------------------------------------------------------------------------------------------------------
# (c) Sparse reuse prefill over selections of whole key blocks (`anchor_prefill(..., key_block=kb)`).


@dataclasses.dataclass(frozen=True)
class ReuseTuning:
    """Pipeline of `reuse_blocks` (untuned: the GPU session picks it)."""

    block_kv: int = 128  # keys per pipeline step (block_kv // key_block TMA copies each of K and V)
    steps: int = 2  # K/V ring depth (3 fits at block_kv 128, d 128: `_COMPILER_PARAMS`)
    p_in_regs: bool | None = None  # P as a register wgmma operand; None: yes on GPU, no in interpret mode
    # Steps wholly inside the selection mask each key column with one additive bias (0 or -inf from its id) and skip
    # the per-element causal compare (a selected key is before the tile, so before every row); only the steps that
    # reach the diagonal build the full mask. Same logits either way; on since it measured 14-31% faster (H100, 128K).
    column_mask: bool = True
    # (FA3's ping-pong between the two compute warpgroups and P.V accumulated inside the wgmma were options until
    # session 32: ping-pong measured 9-24% slower, the in-wgmma accumulation +1%, on the H100 and the H200; part of
    # each step's exp2 on the FMA pipes until session 35: the step reads at 3.0 TB/s and gained nothing.)

    def __post_init__(self):
        if self.block_kv not in (64, 128):
            raise ValueError(f"block_kv must be 64 or 128, got {self.block_kv}")
        if not 2 <= self.steps <= 4:
            raise ValueError(f"steps must be in [2, 4], got {self.steps}")


DEFAULT_REUSE_TUNING = ReuseTuning()
_REUSE_ROWS = _COMPUTE_WGS * 64  # packed query rows (tile tokens x GQA heads) per program: 64 per warpgroup
_KEY_BLOCKS = (8, 16, 32, 64)


def reuse_unsupported_reason(q, k, tile_size, key_block, tuning: ReuseTuning | None = None):
    """None if `reuse_blocks` takes these operands, else a one-line reason naming the parameter."""
    tuning = tuning or DEFAULT_REUSE_TUNING
    why = _operand_reason(q, k)
    if why is not None:
        return why
    if tile_size not in _TILE_SIZES:
        return f"tile_size must be one of {_TILE_SIZES}, got {tile_size}"
    if key_block not in _KEY_BLOCKS or tile_size % key_block or tuning.block_kv % key_block:
        return (f"key_block must be one of {_KEY_BLOCKS} and divide tile_size ({tile_size}) and block_kv "
                f"({tuning.block_kv}), got {key_block}")
    if k.shape[1] % key_block:
        return f"the cache length ({k.shape[1]}) must be a multiple of key_block ({key_block})"
    return None


def _pack_rows(q, kv_heads, tile_size):
    """[b, T, q_heads, d] -> [b, kv_heads, tiles, rows_pad, d]: `_pack_q`'s rows with the whole group in one product
    (row = tile token * group + head), T padded to whole tiles, zero rows past tile * group up to a whole number of
    programs' rows."""
    t, hq = q.shape[1], q.shape[2]
    g = hq // kv_heads
    nt = -(-t // tile_size)
    x = jnp.pad(q, ((0, 0), (0, nt * tile_size - t), (0, 0), (0, 0)))
    x = _pack_q(x, kv_heads, _Rows(tile_size, g, g, 1))[:, :, 0]  # [b, kv_heads, tiles, tile * group, d]
    n = x.shape[3]
    return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, -(-n // _REUSE_ROWS) * _REUSE_ROWS - n), (0, 0)))


def _unpack_rows(o, q_shape, tile_size):
    b, t, hq, d = q_shape
    kvh, nt = o.shape[1], o.shape[2]
    g = hq // kvh
    x = o[:, :, :, : tile_size * g].reshape(b, kvh, nt, tile_size, g, d).transpose(0, 2, 3, 1, 4, 5)
    return x.reshape(b, nt * tile_size, hq, d)[:, :t]


def reuse_blocks(q, k, v, q_start, kv_len, idx, counts, head_map_row, tile_size, key_block, *, scale=None,
                 tuning: ReuseTuning | None = None, interpret=False):
    """`prefill.reuse_prefill` for a selection of whole key blocks: every tile attends its selected keys plus its
    causal diagonal tile, K/V moved by TMA copies of `key_block` rows.

    idx [batch, idx_heads, tiles, W] as `anchor_prefill(..., key_block=kb)` writes it: lanes j*kb ... j*kb + kb - 1
    hold one block's kb consecutive key ids, its first a multiple of kb; counts [batch, tiles] (keys, multiples of
    kb, <= W). A lane past its tile's count, or an id outside [0, min(kv_len, tile start)), attends nothing. The
    copies read whole blocks and the diagonal from rows clamped into the cache: masks, not loads, decide what a
    row attends, so nothing is read outside the cache on the GPU or in interpret mode."""
    tuning = tuning or DEFAULT_REUSE_TUNING
    why = reuse_unsupported_reason(q, k, tile_size, key_block, tuning)
    if why is not None:
        raise ValueError(f"prefill_mgpu.reuse_blocks: {why}")
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"prefill_mgpu.reuse_blocks: v {v.shape} {v.dtype} must match k {k.shape} {k.dtype}")
    b, t, hq, d = q.shape
    s_len, kvh = k.shape[1], k.shape[2]
    g = hq // kvh
    nt = -(-t // tile_size)
    if idx.ndim != 4 or idx.shape[0] != b or idx.shape[2] != nt or idx.shape[3] % key_block:
        raise ValueError(f"prefill_mgpu.reuse_blocks: idx must be [batch={b}, idx_heads, tiles={nt}, W] with W a "
                         f"multiple of key_block={key_block}, got {idx.shape}")
    bkv, kb, steps = tuning.block_kv, key_block, tuning.steps
    runs = bkv // kb
    w = max(-(-idx.shape[3] // bkv), 1) * bkv  # the consumers read whole steps of ids
    idx = jnp.pad(idx.astype(jnp.int32), ((0, 0), (0, 0), (0, 0), (0, w - idx.shape[3])), constant_values=-1)
    counts = jnp.clip(-(-jnp.asarray(counts, jnp.int32) // kb) * kb, 0, idx.shape[3])  # whole runs (lanes past a
    # block's ids are -1)
    scale2 = (1.0 / math.sqrt(d) if scale is None else float(scale)) * _LOG2E
    qp = _pack_rows(q, kvh, tile_size)
    n_sub = qp.shape[3] // _REUSE_ROWS
    interp = _interpret_params(interpret)
    p_regs = tuning.p_in_regs if tuning.p_in_regs is not None else interp is None
    wgs, bq = _COMPUTE_WGS, 64
    col = plgpu.Layout.WGMMA.reduce(0)
    row = plgpu.Layout.WGMMA.reduce(1)

    def kascade_prefill_reuse_mgpu(qs_ref, kvl_ref, cnt_ref, hm_ref, q_ref, k_ref, v_ref, idx_ref, out_ref,
                                   q_smem, k_smem, v_smem, id_smem, p_smem, q_bar, k_bar, id_bar, v_bar, k_free,
                                   v_free):
        bi = lax.axis_index("batch")
        h = lax.axis_index("kvh")
        prog = lax.axis_index("tile")
        tt = nt - 1 - lax.div(prog, jnp.int32(n_sub))  # later tiles attend more keys: they start first
        sub = lax.rem(prog, jnp.int32(n_sub))
        wg = lax.axis_index("wg")
        src = hm_ref[h]
        ts = qs_ref[bi] + tt * tile_size
        kvl = kvl_ref[bi]
        cnt = cnt_ref[bi, tt]
        # The diagonal as whole blocks from d0 (TMA boxes into the tiled ring must start at a multiple of the
        # tiling's 8 rows): one block more when the tile does not start on a block boundary.
        d0 = lax.div(ts, jnp.int32(kb)) * kb
        d_len = ts + tile_size - d0 + lax.rem(kb - lax.rem(ts + tile_size, jnp.int32(kb)), jnp.int32(kb))
        n_steps = lax.div(cnt + d_len + bkv - 1, jnp.int32(bkv))

        @pl.when(wg < wgs)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            r0 = sub * _REUSE_ROWS + wg * bq
            plgpu.copy_gmem_to_smem(q_ref.at[bi, h, tt, pl.ds(r0, bq)], q_smem.at[wg], q_bar.at[wg])
            pos = ts + lax.div(r0 + plgpu.broadcasted_iota(jnp.int32, (bq,), 0, layout=row), jnp.int32(g))
            lim = jnp.minimum(kvl, ts)
            plgpu.barrier_wait(q_bar.at[wg])

            def step(j, carry, full_mask=True):
                acc, m_i, l_i = carry
                slot = lax.rem(j, jnp.int32(steps))
                plgpu.barrier_wait(k_bar.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))
                plgpu.barrier_wait(id_bar.at[slot])
                ids = plgpu.load(id_smem.at[slot], layout=col)
                plgpu.barrier_arrive(k_free.at[slot])
                if full_mask:
                    p = j * bkv + plgpu.broadcasted_iota(jnp.int32, (bkv,), 0, layout=col)
                    act = d0 + (p - cnt)  # the diagonal's key in this lane (a run clamped at the cache end holds
                    # rows before its own: those keys are >= s_len >= kv_len, so masked)
                    sel = (p < cnt) & (ids >= 0) & (ids < lim)
                    diag = (p >= cnt) & (act >= ts) & (act < jnp.minimum(ts + tile_size, kvl))
                    key = jnp.where(p < cnt, ids, act)
                    ok = lax.broadcast_in_dim(sel | diag, (bq, bkv), [1]) & (
                        lax.broadcast_in_dim(key, (bq, bkv), [1]) <= lax.broadcast_in_dim(pos, (bq, bkv), [0]))
                    s = jnp.where(ok, s * scale2, -jnp.inf)
                else:  # every lane inside the count: a selected id, before the tile
                    bias = jnp.where((ids >= 0) & (ids < lim), 0.0, -jnp.inf).astype(jnp.float32)
                    s = s * scale2 + lax.broadcast_in_dim(bias, (bq, bkv), [1])
                m_new = jnp.maximum(m_i, s.max(axis=1))
                alpha = jnp.exp2(m_i - m_new)
                pr = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l_i = l_i * alpha + pr.sum(axis=1)
                p_op = _p_operand(pr, q.dtype, None if p_regs else p_smem.at[wg])
                plgpu.barrier_wait(v_bar.at[slot])

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_op, v_smem.at[slot])
                    return acc_ref[...]

                o = pl.run_scoped(pv, plgpu.ACC((bq, d), jnp.float32))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + o, m_new, l_i

            init = (plgpu.layout_cast(jnp.full((bq, d), 0, jnp.float32), plgpu.Layout.WGMMA),
                    plgpu.layout_cast(jnp.full((bq,), -1e30, jnp.float32), row),
                    plgpu.layout_cast(jnp.full((bq,), 0, jnp.float32), row))
            n_sel = lax.div(cnt, jnp.int32(bkv)) if tuning.column_mask else jnp.int32(0)  # steps inside the count
            carry = lax.fori_loop(0, n_sel, lambda j, c: step(j, c, False), init)
            acc, _, l_i = lax.fori_loop(n_sel, n_steps, step, carry)
            l_i = jnp.where(l_i > 0, l_i, 1.0)
            q_smem[wg] = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(q.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[wg], out_ref.at[bi, h, tt, pl.ds(r0, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == wgs)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def load(j, slot):
                off = pl.multiple_of(jnp.minimum(j * bkv, w - bkv), bkv)  # (a step past the selection reads no
                # selected id)
                plgpu.copy_gmem_to_smem(idx_ref.at[bi, src, tt, pl.ds(off, bkv)], id_smem.at[slot], id_bar.at[slot])
                for r in range(runs):
                    p0 = j * bkv + r * kb
                    first = idx_ref[bi, src, tt, jnp.minimum(p0, w - 1)]
                    chosen = jnp.clip(lax.div(first, jnp.int32(kb)) * kb, 0, s_len - kb)
                    diag = jnp.minimum(d0 + jnp.maximum(p0 - cnt, 0), s_len - kb)
                    start = jnp.where(p0 < cnt, chosen, jnp.where(p0 < cnt + d_len, diag, 0))
                    blk = pl.ds(pl.multiple_of(start, kb), kb)  # (every branch is a multiple of kb)
                    plgpu.copy_gmem_to_smem(k_ref.at[bi, blk, h], k_smem.at[slot, pl.ds(r * kb, kb)], k_bar.at[slot])
                    plgpu.copy_gmem_to_smem(v_ref.at[bi, blk, h], v_smem.at[slot, pl.ds(r * kb, kb)], v_bar.at[slot])

            def consumed(j):  # both compute warpgroups are done with step j's buffers
                plgpu.barrier_wait(k_free.at[lax.rem(j, steps)])
                plgpu.barrier_wait(v_free.at[lax.rem(j, steps)])

            _producer_ring(n_steps, steps, load, consumed)

    out = plgpu.kernel(
        kascade_prefill_reuse_mgpu, out_type=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        scratch_types=dict(
            q_smem=_swizzled((wgs, bq, d), q.dtype), k_smem=_swizzled((steps, bkv, d), q.dtype),
            v_smem=_swizzled((steps, bkv, d), q.dtype), id_smem=plgpu.SMEM((steps, bkv), jnp.int32),
            p_smem=None if p_regs else _swizzled((wgs, bq, bkv), q.dtype),
            q_bar=plgpu.Barrier(num_barriers=wgs),
            k_bar=plgpu.Barrier(num_arrivals=runs, num_barriers=steps), id_bar=plgpu.Barrier(num_barriers=steps),
            v_bar=plgpu.Barrier(num_arrivals=runs, num_barriers=steps),
            k_free=plgpu.Barrier(num_arrivals=wgs, num_barriers=steps),
            v_free=plgpu.Barrier(num_arrivals=wgs, num_barriers=steps)),
        grid=(nt * n_sub, kvh, b), grid_names=("tile", "kvh", "batch"), num_threads=wgs + 1, thread_name="wg",
        compiler_params=_COMPILER_PARAMS, interpret=interp,
    )(jnp.asarray(q_start, jnp.int32), jnp.asarray(kv_len, jnp.int32), counts,
      jnp.asarray(head_map_row, jnp.int32), qp, k, v, idx)
    return _unpack_rows(out, q.shape, tile_size)
