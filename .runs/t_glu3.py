import sys, time; sys.path.insert(0, '.')
import jax, jax.numpy as jnp, numpy as np
from dsv41_jax.kernels import moe_mgpu as MG
rng = np.random.default_rng(0)
G, O, K, bm, blocks, nb, sms = [int(a) for a in sys.argv[1:8]]
c1 = jnp.asarray(rng.integers(-12, 13, (G, O, K)), jnp.int8); s1 = jnp.asarray(rng.integers(118, 132, (G, O, K // 32)), jnp.uint8)
c3 = jnp.asarray(rng.integers(-12, 13, (G, O, K)), jnp.int8)
xt = jnp.asarray(rng.standard_normal((K, blocks * bm)), jnp.bfloat16)
bg = jnp.asarray(rng.integers(0, G, blocks), jnp.int32); ws = jnp.asarray(rng.random(blocks * bm), jnp.float32)
t = time.time()
out = MG.grouped_glu_t(xt, ws, bg, nb, (c1, s1), (c3, s1), bm=bm, limit=0.0, impl="interpret", num_sms=sms, tiles=MG.Tiles(steps=int(sys.argv[8])))
want = MG.grouped_glu_t(xt, ws, bg, nb, (c1, s1), (c3, s1), bm=bm, limit=0.0, impl="xla")
err = jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32))[:, :nb*bm]
print(sys.argv[1:], round(time.time() - t, 1), float(jnp.max(err / (jnp.abs(want.astype(jnp.float32)[:, :nb*bm]) + 1))), "bad blocks", np.unique(np.nonzero(np.asarray(err > 1))[1] // bm), flush=True)
