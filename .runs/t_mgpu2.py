import sys, time; sys.path.insert(0, '.')
import jax, jax.numpy as jnp, numpy as np
from dsv41_jax.kernels import moe_mgpu as M, qmatmul as Q
for (E, O, K, NB, bm, nb, tiles) in [(3, 128, 128, 3, 128, 2, M.Tiles()), (4, 256, 256, 5, 32, 4, M.Tiles(tile_m=64, tile_k=128, steps=2)),
                                      (2, 256, 128, 2, 160, 2, M.Tiles(tile_m=128))]:
    k = jax.random.split(jax.random.key(E), 5)
    codes = jax.random.randint(k[0], (E, O, K), -12, 13, dtype=jnp.int8)
    sb = jax.random.randint(k[1], (E, O, K // 32), 118, 132).astype(jnp.uint8)
    x = jax.random.normal(k[2], (NB * bm, K)).astype(jnp.bfloat16)
    bg = jax.random.randint(k[3], (NB,), 0, E).astype(jnp.int32)
    ref = M.grouped_matmul_t(x.T, bg, nb, codes, sb, bm=bm, impl="xla")
    low = jax.jit(lambda *a: M.grouped_matmul_t(*a, bm=bm, impl="mosaic", tiles=tiles, num_sms=132)).trace(x.T, bg, nb, codes, sb).lower(lowering_platforms=("cuda",))
    t = time.time()
    out = M.grouped_matmul_t(x.T, bg, nb, codes, sb, bm=bm, impl="interpret", tiles=tiles, num_sms=2)
    o = np.asarray(out[:, :nb * bm].astype(jnp.float32)); r = np.asarray(ref[:, :nb * bm].astype(jnp.float32))
    print(tiles, bm, "s", round(time.time() - t, 1), "mismatch frac", np.mean(o != r), "max rel", np.max(np.abs(o - r) / (np.abs(r) + 1e-3)))
