import sys, time; sys.path.insert(0, '.')
import jax, jax.numpy as jnp, numpy as np
from dsv41_jax.kernels import moe_mgpu as MG
print(getattr(jax.devices()[0], "core_count", None), MG._num_sms())
rng = np.random.default_rng(0)
G, O, K, bm, blocks = 3, 128, 128, 32, 3
c1 = jnp.asarray(rng.integers(-12, 13, (G, O, K)), jnp.int8); s1 = jnp.asarray(rng.integers(118, 132, (G, O, K // 32)), jnp.uint8)
xt = jnp.asarray(rng.standard_normal((K, blocks * bm)), jnp.bfloat16)
bg = jnp.asarray([0, 1, 2], jnp.int32); ws = jnp.asarray(rng.random(blocks * bm), jnp.float32)
for sms in (int(sys.argv[1]),):
    t = time.time()
    out = MG.grouped_glu_t(xt, ws, bg, 3, (c1, s1), (c1, s1), bm=bm, limit=0.0, impl="interpret", num_sms=sms)
    want = MG.grouped_glu_t(xt, ws, bg, 3, (c1, s1), (c1, s1), bm=bm, limit=0.0, impl="xla")
    print(sms, time.time() - t, float(jnp.max(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32)))), flush=True)
