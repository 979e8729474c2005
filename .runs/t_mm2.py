import sys, time; sys.path.insert(0, '.')
import jax, jax.numpy as jnp, numpy as np
from dsv41_jax.kernels import moe_mgpu as MG
rng = np.random.default_rng(0)
G, O, K, bm, blocks, nb, sms = [int(a) for a in sys.argv[1:8]]
steps = int(sys.argv[8]) if len(sys.argv) > 8 else 4
c1 = jnp.asarray(rng.integers(-12, 13, (G, O, K)), jnp.int8); s1 = jnp.asarray(rng.integers(118, 132, (G, O, K // 32)), jnp.uint8)
xt = jnp.asarray(rng.standard_normal((K, blocks * bm)), jnp.bfloat16)
bg = jnp.asarray(rng.integers(0, G, blocks), jnp.int32)
t = time.time()
out = MG.grouped_matmul_t(xt, bg, nb, c1, s1, bm=bm, impl="interpret", num_sms=sms, tiles=MG.Tiles(steps=steps))
want = MG.grouped_matmul_t(xt, bg, nb, c1, s1, bm=bm, impl="xla")
err = jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32))[:, :nb*bm]
print(sys.argv[1:], round(time.time() - t, 1), float(jnp.max(err)), "bad cols", np.unique(np.nonzero(np.asarray(err > 1))[1] // bm), flush=True)
