import functools, sys, types
import jax, jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax._src.pallas.mosaic_gpu.interpret import params as IP

def grouped_t(xT, block_group, n_blocks, codes, svals, *, bm=128, tile_m=64, tile_k=64, steps=4, num_sms=132, wg_m=True, interpret=False):
    K, R = xT.shape
    E, O, _ = codes.shape
    NB = R // bm
    cta_m = tile_m * (2 if wg_m else 1)
    cta_n = bm
    tile_n = bm if wg_m else bm // 2
    m_iters = O // cta_m
    k_iters = K // tile_k
    a_sw = plgpu.find_swizzle(tile_k * 8, "lhs")
    b_sw = 64
    o_sw = plgpu.find_swizzle(64 * 16, "out")
    a_tr = (plgpu.TilingTransform((8, a_sw)), plgpu.SwizzleTransform(a_sw))
    b_tr = (plgpu.TilingTransform((8, b_sw // 2)), plgpu.SwizzleTransform(b_sw))
    o_tr = (plgpu.TilingTransform((8, o_sw // 2)), plgpu.SwizzleTransform(o_sw))
    nc = tile_k // 32

    def kernel(bg_gmem, nb_gmem, a_gmem, s_gmem, b_gmem, out_gmem, out_smem, lhs_smem):
        def get_pipeline(body, ctx):
            return plgpu.emit_pipeline_warp_specialized(
                body, grid=(k_iters,), memory_registers=40,
                in_specs=[plgpu.BlockSpec((cta_m, tile_k), lambda k: (0, k), transforms=a_tr, memory_space=plgpu.SMEM),
                          plgpu.BlockSpec((nc, cta_m), lambda k: (k, 0), memory_space=plgpu.SMEM),
                          plgpu.BlockSpec((tile_k, cta_n), lambda k: (k, 0), transforms=b_tr, memory_space=plgpu.SMEM)],
                wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=steps, compute_context=ctx)
        ignore = lambda *_, **__: None
        nb = nb_gmem[0]

        @functools.partial(pl.run_scoped, pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(
            a_gmem.at[0], s_gmem.at[0], b_gmem), collective_axes="wg")
        def _scope(pipeline_allocs):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((m_iters * NB,), collective_axes="sm")
            def _loop(info):
                (lin,) = info.index
                n_idx = lin // m_iters
                m_idx = lin % m_iters

                @pl.when(n_idx < nb)
                def _live():
                    e = bg_gmem[n_idx]
                    m_sl = pl.ds(m_idx * cta_m, cta_m)
                    n_sl = pl.ds(n_idx * cta_n, cta_n)
                    wm = pl.ds(wg * tile_m, tile_m) if wg_m else slice(None)
                    wn = slice(None) if wg_m else pl.ds(wg * tile_n, tile_n)

                    def ctx(eval_pipeline):
                        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
                        def _acc(acc_ref):
                            eval_pipeline(acc_ref)
                            acc = acc_ref[...].astype(jnp.bfloat16)
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                            for ei in range(tile_n // 64):
                                es = slice(ei * 64, (ei + 1) * 64)
                                slot = ei % 2
                                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                                out_smem[wg, slot] = acc[:, es]
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(out_smem.at[wg, slot],
                                                        out_gmem.at[m_sl, n_sl].at[wm, wn].at[:, es])

                    def body(_, a_smem, s_smem, b_smem, acc_ref):
                        a = a_smem[wm].astype(jnp.bfloat16)
                        for c in range(nc):
                            s = s_smem[c, wm]
                            ac = a[:, c * 32:(c + 1) * 32] * lax.broadcast_in_dim(s, (tile_m, 32), (0,))
                            if interpret:
                                lhs_smem[wg] = ac
                                plgpu.commit_smem()
                                ac = lhs_smem.at[wg]
                            plgpu.wgmma(acc_ref, ac, b_smem.at[pl.ds(c * 32, 32), wn])
                            if interpret:
                                plgpu.wgmma_wait(0)
                        plgpu.wgmma_wait(0)
                        return acc_ref

                    get_pipeline(body, ctx)(a_gmem.at[e, m_sl, :], s_gmem.at[e, :, m_sl], b_gmem.at[:, n_sl],
                                            allocations=pipeline_allocs)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    f = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((O, R), jnp.bfloat16), grid=(num_sms,), grid_names=("sm",),
                     num_threads=3, thread_name="wg",
                     compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
                     scratch_types=dict(out_smem=plgpu.SMEM((2, 2, tile_m, 64), jnp.bfloat16, transforms=o_tr),
                                        lhs_smem=plgpu.SMEM((2, tile_m, 32), jnp.bfloat16, transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(64)))),
                     **(dict(interpret=IP.InterpretGPUParams()) if interpret else {}))
    return f(block_group, n_blocks, codes, svals, xT)

if __name__ == "__main__":
    E, O, K, NB, bm = 8, 256, 512, 6, 128
    sds = jax.ShapeDtypeStruct
    args = (sds((K, NB * bm), jnp.bfloat16), sds((NB,), jnp.int32), sds((1,), jnp.int32), sds((E, O, K), jnp.int8),
            sds((E, K // 32, O), jnp.bfloat16))
    low = jax.jit(grouped_t).trace(*args).lower(lowering_platforms=("cuda",))
    print("lowered", len(low.as_text()))
    import numpy as np, time
    E, O, K, NB, bm = 3, 128, 128, 3, 128
    k = jax.random.split(jax.random.key(0), 5)
    codes = jax.random.randint(k[0], (E, O, K), -12, 13, dtype=jnp.int8)
    sbytes = jax.random.randint(k[1], (E, O, K // 32), 120, 130).astype(jnp.uint8)
    x = jax.random.normal(k[2], (NB * bm, K)).astype(jnp.bfloat16)
    bg = jnp.array([2, 0, 1], jnp.int32); nb = jnp.array([2], jnp.int32)
    sys.path.insert(0, '.')
    from dsv41_jax.kernels import qmatmul as Q
    svals = jnp.swapaxes(Q.scale_values(sbytes, 0.5), 1, 2).astype(jnp.bfloat16)
    ref = Q.grouped_qmatmul_reference(x, bg, nb, codes, sbytes, bm=bm, out_dtype=jnp.float32)
    t = time.time()
    out = grouped_t(x.T, bg, nb, codes, svals, num_sms=2, tile_k=64, steps=2, interpret=True)
    out = np.asarray(out.T.astype(jnp.float32)); ref = np.asarray(ref)
    print("interp s", time.time() - t, "live err", np.abs(out[:2*bm] - ref[:2*bm]).max(), "scale", np.abs(ref).max())
