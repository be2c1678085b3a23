"""The decode kernels' sm_90 machine code on a machine without a GPU: resources and instruction mix, to predict
before a lease what limits a kernel (conversions, address arithmetic, occupancy).

Lowers a Pallas decode kernel for CUDA with JAX's own hooks (as `tests/conftest.py`'s `triton_sm90_modules`), then
compiles its Triton module with a pip-installed Triton (not JAX's bundled one: its SASS may differ in detail) to
PTX and a cubin, and prints registers, shared memory, programs per SM and the SASS opcode counts. Needs that Triton:

  python -m pip install --target /tmp/tri triton        # once (brings ptxas and cuobjdump)
  python benchmarks/triton_sass.py --triton /tmp/tri --kernel anchor_fp8 --batch 64 --context 131072
  python benchmarks/triton_sass.py --triton /tmp/tri --kernel reuse --batch 8 --tuning reuse_splits=10

Kernels: anchor (the whole-cache score pass, bf16 K), anchor_fp8 (on the fp8 K copy; `--tuning stream_fp8_f16=true`
for the float16 widening), anchor0 (the dense-output pass of anchor layer 0), reuse, and prefill_reuse (the
sparse prefill's reuse layers, batch 1 from position 0, tile 32; --tuning then takes PrefillTuning fields).
Shapes: --heads Q,KV,D (default the 8B's 32,8,128). Session 29 (benchmarks/NOTES.md) read the fp8 pass's F2F count
and the batch-8 reuse occupancy this way.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KERNELS = ("anchor", "anchor_fp8", "anchor0", "reuse", "prefill_reuse")
REGS_PER_SM, SMEM_PER_SM, THREADS_PER_SM = 65536, 228 * 1024, 2048


def lowered_modules(kernel: str, batch: int, context: int, heads, tuning_spec: str):
    """[(TTIR text, num_warps, num_stages, grid)] of the Triton modules the kernel's call lowers to for sm_90."""
    from jax._src.pallas.triton import gpu_info
    from jax._src.pallas.triton import pallas_call_registration as reg

    saved = reg.gpu_info_lib.get_gpu_info, reg.lowering.lower_jaxpr_to_triton_module
    lower_module, found = saved[1], []

    def keep(*args, **kwargs):
        res = lower_module(*args, **kwargs)
        found.append(res)
        return res

    reg.gpu_info_lib.get_gpu_info = lambda: gpu_info.GpuInfo(gpu_version=None, arch_name="sm_90",
                                                             compute_capability=90)
    reg.lowering.lower_jaxpr_to_triton_module = keep
    try:
        return _lower(kernel, batch, context, heads, tuning_spec, found)
    finally:  # JAX's hooks back as they were (a test process goes on lowering)
        reg.gpu_info_lib.get_gpu_info, reg.lowering.lower_jaxpr_to_triton_module = saved


def _lower(kernel, batch, context, heads, tuning_spec, found):
    """`lowered_modules` with the hooks in place: lower the kernel's call, pick its modules from `found`."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas import decode as dec
    from kernels_pallas import reference as ref

    tuning = dec.tuning_from_string("" if kernel == "prefill_reuse" else tuning_spec)
    hq, kvh, d = heads
    k_max = ref.max_budget(context, 0.1, 128)
    q = jax.ShapeDtypeStruct((batch, 1, hq, d), jnp.bfloat16)
    kc = jax.ShapeDtypeStruct((batch, context, kvh, d), jnp.bfloat16)
    k8 = jax.ShapeDtypeStruct((batch, context, kvh, d), jnp.float8_e4m3fn)
    kv = jax.ShapeDtypeStruct((batch,), jnp.int32)
    mult = jax.ShapeDtypeStruct((batch,), jnp.float32)
    idx = jax.ShapeDtypeStruct((batch, kvh, k_max), jnp.int32)
    kw = dict(topk_frac=0.1, min_k=128, k_max=k_max, impl="pallas", tuning=tuning)
    if kernel == "prefill_reuse":  # the sparse prefill's reuse layers: batch 1 from position 0, tile 32
        from kernels_pallas import prefill as pf

        ptuning, tiles = pf.tuning_from_string(tuning_spec), context // 32
        qp = jax.ShapeDtypeStruct((batch, context, hq, d), jnp.bfloat16)
        pidx = jax.ShapeDtypeStruct((batch, kvh, tiles, k_max), jnp.int32)
        cnt = jax.ShapeDtypeStruct((batch, tiles), jnp.int32)
        fn = lambda q, k, v, s0, l, i, c: pf.reuse_prefill(q, k, v, s0, l, i, c, jnp.arange(kvh), 32,  # noqa: E731
                                                           impl="pallas", tuning=ptuning)
        jax.jit(fn).trace(qp, kc, kc, kv, kv, pidx, cnt).lower(lowering_platforms=("cuda",))
        lay = pf._layout(qp, kc, 32, ptuning.reuse_rows)  # the reuse kernel's own row packing and warps
        return [(str(r.module), ptuning.reuse_warps or lay.warps, ptuning.reuse_stages,
                 getattr(r, "grid", None)) for r in found if "prefill_reuse" in str(r.module)]
    if kernel == "reuse":
        fn, args = (lambda q, k, v, l, i: dec.reuse_decode(q, k, v, l, i, l // 10, jnp.arange(kvh), impl="pallas",
                                                           tuning=tuning)), (q, kc, kc, kv, idx)
    elif kernel == "anchor_fp8":
        fn, args = (lambda q, k, v, l, k8, m: dec.anchor_decode(q, k, v, l, score_keys=(k8, m), **kw)), \
            (q, kc, kc, kv, k8, mult)
    else:
        fn, args = (lambda q, k, v, l: dec.anchor_decode(q, k, v, l, dense_out=kernel == "anchor0", **kw)), \
            (q, kc, kc, kv)
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    want = "reuse_decode" if kernel == "reuse" else "anchor_scores"
    warps, stages = ((tuning.reuse_warps or None, tuning.reuse_stages) if kernel == "reuse"
                     else (tuning.stream_warps, tuning.stream_stages))
    out = []
    for res in found:
        text = str(res.module)
        if want in text:
            w = warps or (8 if "128x128" in text and kernel == "reuse" else 4)
            out.append((text, w, stages, getattr(res, "grid", None)))
    if not out:
        raise SystemExit(f"no {want} module among the {len(found)} lowered for --kernel {kernel}")
    return out


def sass_report(text: str, warps: int, stages: int, triton_dir: str) -> dict:
    """Compile one TTIR module with the pip Triton in triton_dir: resources and SASS opcode counts."""
    sys.path.insert(0, triton_dir)
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(text)
        compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps, num_stages=stages))
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        tool = os.path.join(triton_dir, "triton", "backends", "nvidia", "bin", "cuobjdump")
        res = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    stack = int(m.group(1)) if (m := re.search(r"STACK:(\d+)", res)) else 0  # spills land on the stack
    ops = collections.Counter(m.group(1).split(".")[0]
                              for m in re.finditer(r"^\s+/\*[0-9a-f]{4}\*/\s+([A-Z0-9_.]+)", sass, re.M))
    threads = 32 * warps
    smem = compiled.metadata.shared
    fit = min(REGS_PER_SM // max(regs * threads, 1), SMEM_PER_SM // max(smem, 1), THREADS_PER_SM // threads)
    return dict(registers=regs, stack=stack, shared=smem, warps=warps, stages=stages, programs_per_sm=fit,
                instructions=sum(ops.values()), ops=ops)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--triton", required=True, help="folder of a pip-installed Triton (pip install --target DIR)")
    ap.add_argument("--kernel", choices=KERNELS, default="anchor_fp8")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--heads", default="32,8,128", help="q_heads,kv_heads,head_dim")
    ap.add_argument("--tuning", default="", help="DecodeTuning overrides, field=value,...")
    ap.add_argument("--top", type=int, default=14, help="opcodes to list")
    a = ap.parse_args()
    heads = tuple(int(x) for x in a.heads.split(","))
    if len(heads) != 3 or heads[0] % heads[1]:
        raise SystemExit(f"--heads takes q_heads,kv_heads,head_dim with kv_heads dividing q_heads, got {a.heads!r}")
    if not os.path.isdir(os.path.join(a.triton, "triton")):
        raise SystemExit(f"--triton {a.triton!r} holds no triton package: python -m pip install --target DIR triton")
    for text, warps, stages, grid in lowered_modules(a.kernel, a.batch, a.context, heads, a.tuning):
        r = sass_report(text, warps, stages, a.triton)
        programs = 1
        for g in grid or ():
            programs *= g
        waves = f", {programs} programs = {programs / (132 * max(r['programs_per_sm'], 1)):.2f} waves on 132 SMs" \
            if grid else ""
        print(f"{a.kernel} b={a.batch} s={a.context} heads={heads} tuning='{a.tuning}': grid {grid}{waves}")
        print(f"  {r['registers']} registers ({r['stack']} B stack), {r['shared'] / 1024:.1f} KB shared, "
              f"{r['warps']} warps, {r['stages']} stages -> {r['programs_per_sm']} programs an SM; "
              f"{r['instructions']} SASS instructions")
        print("  " + "  ".join(f"{op} {n}" for op, n in r["ops"].most_common(a.top)))


if __name__ == "__main__":
    main()
