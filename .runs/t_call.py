import sys, time; sys.path.insert(0, '.')
import jax, jax.numpy as jnp, numpy as np
from dsv41_jax.kernels import moe_mgpu as MG
rng = np.random.default_rng(0)
K, steps = int(sys.argv[1]), int(sys.argv[2])
G, O, bm = 2, 128, 32
c1 = jnp.asarray(rng.integers(-12, 13, (G, O, K)), jnp.int8); s1 = jnp.asarray(rng.integers(118, 132, (G, O, K // 32)), jnp.uint8)
xt = jnp.asarray(rng.standard_normal((K, bm)), jnp.bfloat16)
bg = jnp.zeros((1,), jnp.int32); nb = jnp.ones((1,), jnp.int32)
out = MG._call(xt, bg, nb, [(c1, MG.scale_t(s1))] * 2, bm=bm, mult=0.5, tiles=MG.Tiles(steps=steps), num_sms=1, interpret=True, glu=(jnp.ones((bm,), jnp.float32), float(sys.argv[3])) if len(sys.argv) > 3 else None)
print("ok", K, steps, flush=True)
