"""Quick CUPTI profile of one decode step of the 8B Llama shape (random bf16 weights): dense vs Kascade."""
import functools, collections, json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.experimental.mosaic.gpu import profiler
from models.config import ModelConfig
from models.transformer import Transformer
from models.cache import KVCache
from models import generate as gen
from models.attention import DenseStrategy
from kascade_jax.registry import make_strategy

LLAMA = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192), max_position_embeddings=131072,
             tie_word_embeddings=False)
cfg = ModelConfig.from_hf(LLAMA)
VARIANT = os.environ.get("VARIANT", "")
if VARIANT == "pad":
    import models.transformer as mt
    class PadLinear(nnx.Linear):
        def __call__(self, x):
            lead = x.shape[:-1]
            if int(np.prod(lead)) == 1:
                x2 = jnp.pad(x.reshape(1, x.shape[-1]), ((0, 1), (0, 0)))
                return super().__call__(x2)[:1].reshape(*lead, -1)
            return super().__call__(x)
    def _lin(i, o, bias, dtype, param_dtype, rngs):
        return PadLinear(i, o, use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                         kernel_init=nnx.initializers.normal(0.02), precision=jax.lax.Precision.HIGHEST)
    mt._linear = _lin
JIT_KW = {}
if os.environ.get("PREC") == "default":
    import models.transformer as mt
    _old = mt._linear
    def _lin2(i, o, bias, dtype, param_dtype, rngs):
        l = _old(i, o, bias, dtype, param_dtype, rngs); l.precision = None; return l
    mt._linear = _lin2
t0 = time.time()
model = Transformer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
graphdef, params = nnx.split(model)
jax.block_until_ready(params)
print("init", time.time() - t0, flush=True)
out = {}
N = 16
SHAPES = [tuple(map(int, x.split("x"))) for x in os.environ.get("SHAPES", "130816x1,32512x8").split(",")]
for (ctx, b) in SHAPES:
    max_len = ctx + 256
    key = jax.random.key(1)
    ks = [jax.random.normal(jax.random.fold_in(key, i), (b, max_len, 8, 128), jnp.bfloat16) for i in range(2)]
    cache0 = KVCache(k=tuple(ks[0] for _ in range(32)), v=tuple(ks[1] for _ in range(32)),
                     lengths=jnp.full((b,), ctx, jnp.int32))
    for sname in os.environ.get("STRATS", "dense,kascade").split(","):
        st = DenseStrategy() if sname == "dense" else make_strategy(
            "kascade", 32, 8, anchors="0,2,8,13,14", topk_frac=0.1, min_k=128, kernels="pallas")

        @functools.partial(jax.jit, **JIT_KW)
        def loop(params, cache):
            cache = jax.tree.map(lambda x: x, cache)
            tok = jnp.zeros((b,), jnp.int32)
            outb = jnp.full((b, 128), -1, jnp.int32)
            carry = (cache, tok, jnp.zeros((b,), bool), jnp.asarray(0, jnp.int32), outb)
            c = gen._decode_loop(graphdef, params, carry, 0, st, jnp.int32(N), jnp.int32(N), 0.0, 1.0, 0, ())
            return c[1]
        # distinct buffers per layer would be real; sharing one buffer across layers is fine for timing reads
        t0 = time.time()
        _, timings = profiler.measure(loop, aggregate=False)(params, cache0)
        agg = collections.defaultdict(lambda: [0, 0.0])
        for name, t in timings:
            agg[name][0] += 1; agg[name][1] += t
        total = sum(t for _, t in timings)
        top = sorted(agg.items(), key=lambda kv: -kv[1][1])[:12]
        print(f"\n== {os.environ.get('TAG','')} {sname} ctx={ctx} b={b}: total {total:.2f} ms for {N} steps -> {total/N:.3f} ms/step "
              f"(kernels {len(timings)}, wall {time.time()-t0:.1f}s)", flush=True)
        for name, (c, t) in top:
            print(f"  {t/N:8.3f} ms/step  n/step={c/N:6.1f}  {name[:110]}")
        out[f"{sname}_{ctx}_{b}"] = dict(total_ms_per_step=total / N,
                                         top=[(n, c, t) for n, (c, t) in top])
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), f"profile_decode{os.environ.get('TAG','')}.json"), "w"), indent=1)
