"""DeepSeek-V4.1 vision tower (ViT) and ``encode_images``: processed images -> span embeddings.

ViT (checkpoint names under ``vision.``): a linear patch embedding with bias, pre-norm blocks
(fp32 RMSNorm eps 1e-6, fused qkv with bias split q|k|v, 2-D half-split RoPE, full
bidirectional attention within one image, SwiGLU with the gate as the first half of ``w1``)
and a final RMSNorm.

Batching: images are padded to a bucketed patch count and stacked; the padded keys are masked
out of the attention (padded queries compute garbage that nothing reads), so the padding does
not change any real output. Images with the same bucket run in one jitted call.

Dtype flow (docs/vision.md): every Linear accumulates in fp32 and rounds once to the compute
dtype (bias included); norms, RoPE, softmax, SiLU and GELU compute in fp32 and round once;
the attention upcasts q, k, v to fp32 (torch's math SDPA) and rounds its output once.

Performance mode (``Numerics.vision_attention == "bf16"``, docs/vision.md): bf16 q, k, v go into
``jax.nn.dot_product_attention`` (fp32 logits, softmax and accumulation; cuDNN flash attention on
NVIDIA GPUs, XLA elsewhere) with the padded keys excluded by ``key_value_seq_lengths``, and each
GEMM writes bf16 directly (fp32 accumulation, then the bias added in fp32 and rounded again).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
import weakref
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.config import VisionConfig
from dsv41_jax.model.aligner import Aligner, merge_index
from dsv41_jax.model.layers import F32, HIGHEST, Linear, RMSNorm
from dsv41_jax.model.span import gather_spans, image_vector_table, span_gather_index
from dsv41_jax.numerics import Numerics
from dsv41_jax.processor import ProcessedImage
from dsv41_jax.weights import ValueReader


_GEMM_BF16_OUT: bool | None = None  # performance-mode GEMMs write bf16 themselves; None: on GPU only


def _gemm_bf16_out() -> bool:
    if _GEMM_BF16_OUT is not None:
        return _GEMM_BF16_OUT
    return jax.default_backend() in ("gpu", "cuda")


def _linear(lin: Linear, x, cd, fast: bool = False):
    """One GEMM in the compute dtype with fp32 accumulation, bias added in fp32, rounded once.

    ``fast`` (performance mode, bf16 compute): the GEMM's fp32 accumulator is rounded to bf16
    before the bias, which is then added in fp32 and rounded again. On GPU the GEMM writes bf16
    itself (no fp32 [N, out] intermediate in memory); elsewhere it writes fp32 and is rounded by
    the next op (the same values: XLA:CPU's bf16-output dot is a slow loop)."""
    if not fast or cd != jnp.bfloat16 or (lin.quantized and lin.numerics.fake_quant):
        return lin(x, out_dtype=F32, compute_dtype=cd).astype(cd)
    w = lin.values() if getattr(lin, "fp8", False) else lin.weight[...]
    out = cd if _gemm_bf16_out() else F32
    y = jnp.einsum("...i,oi->...o", x.astype(cd), w.astype(cd), preferred_element_type=out).astype(cd)
    if lin.bias is not None:
        y = (y.astype(F32) + lin.bias[...].astype(F32)).astype(cd)
    return y


def rope_tables(rows, cols, rope_dim: int, theta: float):
    """cos/sin [..., 1, rope_dim] (fp32) for patches at (rows, cols): the first half of the
    angles is ``row * w_t``, the second ``col * w_t``, ``w_t = theta^(-2t/rope_dim)``."""
    inv = 1.0 / (np.float32(theta) ** (np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim)))
    inv = jnp.asarray(inv.astype(np.float32))
    ang = jnp.concatenate([rows.astype(F32)[..., None] * inv, cols.astype(F32)[..., None] * inv], axis=-1)
    return jnp.cos(ang)[..., None, :], jnp.sin(ang)[..., None, :]


def apply_rope(x, cos, sin):
    """Half-split rotation of x [..., H, hd] in fp32, cast back to x.dtype."""
    x1, x2 = jnp.split(x.astype(F32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention(q, k, v, key_mask, q_block: int = 0):
    """Bidirectional softmax attention over the valid keys of each image, in fp32.

    q, k, v: [B, N, H, hd] (any dtype); key_mask: [B, N] bool. As torch's math SDPA, q and k
    are each scaled by sqrt(hd^-0.5) before the product. Queries are processed in blocks of
    ``q_block`` rows when that divides N (rows are independent, so this only bounds memory).
    """
    b, n, h, d = q.shape
    s = np.float32(math.sqrt(1.0 / math.sqrt(d)))
    kf = k.astype(F32) * s
    vf = v.astype(F32)
    keep = key_mask[:, None, None, :]

    def rows(qb):
        logits = jnp.einsum("bqhd,bkhd->bhqk", qb, kf, precision=HIGHEST)
        p = jax.nn.softmax(jnp.where(keep, logits, -jnp.inf), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, vf, precision=HIGHEST)

    qf = q.astype(F32) * s
    if q_block and n > q_block and n % q_block == 0:
        qs = jnp.moveaxis(qf.reshape(b, n // q_block, q_block, h, d), 1, 0)
        return jnp.moveaxis(jax.lax.map(rows, qs), 0, 1).reshape(b, n, h, d)
    return rows(qf)


ATTENTION_IMPLS = ("fp32", "cudnn", "mgpu", "xla")
# the bf16 attention on a GPU: "cudnn" (jax.nn.dot_product_attention's cuDNN flash attention) or
# "mgpu" (``kernels.vit_attn``, this project's Mosaic GPU kernel; Hopper only, and sequence lengths
# that its tiles divide, else cuDNN; no faster than cuDNN in the tower, run 39). ``DSV41_VIT_ATTN``
# overrides.
DEFAULT_GPU_ATTENTION = "cudnn"
_CUDNN_FAILED: list[str] = []  # set once a cuDNN attention failed to trace or compile here


def attention_impl(vision_attention: str, backend: str | None = None) -> str:
    """The ViT attention implementation for a ``Numerics.vision_attention`` value: "fp32" (parity
    path), or for "bf16" on a GPU backend ``DSV41_VIT_ATTN`` (default ``DEFAULT_GPU_ATTENTION``):
    "cudnn" (unless it already failed here, then "xla"), "mgpu" (on a Hopper GPU, else "cudnn") or
    "xla"; off the GPU "xla"."""
    if vision_attention == "fp32":
        return "fp32"
    if vision_attention != "bf16":
        raise ValueError(f"vision_attention {vision_attention!r} must be 'fp32' or 'bf16'")
    backend = jax.default_backend() if backend is None else backend
    if backend not in ("gpu", "cuda"):
        return "xla"
    choice = os.environ.get("DSV41_VIT_ATTN", DEFAULT_GPU_ATTENTION)
    if choice not in ("cudnn", "mgpu", "xla"):
        raise ValueError(f"DSV41_VIT_ATTN={choice!r}: use 'cudnn', 'mgpu' or 'xla'")
    if choice == "mgpu":
        from dsv41_jax.kernels import vit_attn

        if vit_attn.resolve_impl("auto") == "mosaic":
            return "mgpu"
        choice = "cudnn"
    return "cudnn" if choice == "cudnn" and not _CUDNN_FAILED else "xla"


def _cudnn_failed(err: BaseException) -> None:
    if not _CUDNN_FAILED:
        warnings.warn(f"ViT bf16 attention: cuDNN unavailable ({type(err).__name__}: {str(err)[:200]}); "
                      "using the XLA dot_product_attention instead", RuntimeWarning, stacklevel=3)
    _CUDNN_FAILED.append(f"{type(err).__name__}: {err}")


def attention_bf16(q, k, v, n_valid, impl: str = "xla", q_block: int = 0):
    """Performance-mode attention: bf16 q, k, v [B, N, H, hd] -> bf16 [B, N, H, hd].

    ``jax.nn.dot_product_attention`` with scale hd^-0.5 (the same product as the parity path's
    two sqrt(hd^-0.5) factors; exact for a power-of-two hd), fp32 logits, softmax and
    accumulation, P rounded to bf16 before P·V (as flash attention kernels do). Keys at index
    >= n_valid[b] are excluded (``key_value_seq_lengths``; every query row stays computed, so the
    padded rows stay finite). "cudnn": one fused flash-attention call (a cuDNN that refuses the
    shapes falls back to "xla" with a warning); "mgpu": ``kernels.vit_attn`` (the same rounding
    points; shapes its tiles do not divide go to cuDNN); "xla": the same math in XLA, over query blocks of
    ``q_block`` rows when that divides N (bounds the fp32 [B, H, q, N] logits).
    """
    b, n, h, d = q.shape
    q, k, v = (t.astype(jnp.bfloat16) for t in (q, k, v))
    if impl == "mgpu":
        from dsv41_jax.kernels import vit_attn

        cfg = vit_attn.config()
        if vit_attn.supported(q.shape, cfg["block_q"], cfg["block_kv"]) is None:
            return vit_attn.attention(q, k, v, n_valid, impl="mosaic", **cfg)
        impl = "cudnn" if not _CUDNN_FAILED else "xla"  # (a shape the kernel does not take)
    kw = dict(scale=1.0 / math.sqrt(d), key_value_seq_lengths=n_valid.astype(jnp.int32))
    if impl == "cudnn":
        try:
            return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **kw)
        except (NotImplementedError, RuntimeError, ValueError, TypeError) as e:  # trace-time capability checks
            _cudnn_failed(e)

    def rows(qb):
        return jax.nn.dot_product_attention(qb, k, v, implementation="xla", **kw)

    if q_block and n > q_block and n % q_block == 0:
        qs = jnp.moveaxis(q.reshape(b, n // q_block, q_block, h, d), 1, 0)
        return jnp.moveaxis(jax.lax.map(rows, qs), 0, 1).reshape(b, n, h, d)
    return rows(q)


class PatchEmbed(nnx.Module):
    def __init__(self, cfg: VisionConfig, numerics: Numerics):
        self.proj = Linear(3 * cfg.patch_size ** 2, cfg.hidden_size, numerics=numerics, bias=True)


class Attention(nnx.Module):
    def __init__(self, cfg: VisionConfig, numerics: Numerics):
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.wqkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size, numerics=numerics, bias=True)
        self.wo = Linear(cfg.hidden_size, cfg.hidden_size, numerics=numerics, bias=True)

    def __call__(self, x, cos, sin, key_mask, cd, q_block: int = 0, impl: str = "fp32", n_valid=None):
        b, n, _ = x.shape
        fast = impl != "fp32"
        qkv = _linear(self.wqkv, x, cd, fast).reshape(b, n, 3, self.n_heads, self.head_dim)  # q | k | v chunks
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if fast:
            o = attention_bf16(q, k, v, n_valid, impl, q_block).astype(cd)
        else:
            o = attention(q, k, v, key_mask, q_block).astype(cd)
        return _linear(self.wo, o.reshape(b, n, -1), cd, fast)


class MLP(nnx.Module):
    def __init__(self, cfg: VisionConfig, numerics: Numerics):
        self.w1 = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, numerics=numerics)
        self.w2 = Linear(cfg.intermediate_size, cfg.hidden_size, numerics=numerics)

    def __call__(self, x, cd, fast: bool = False):
        gate, up = jnp.split(_linear(self.w1, x, cd, fast), 2, axis=-1)
        act = jax.nn.silu(gate.astype(F32)).astype(cd)
        return _linear(self.w2, (act.astype(F32) * up.astype(F32)).astype(cd), cd, fast)


class Block(nnx.Module):
    def __init__(self, cfg: VisionConfig, numerics: Numerics):
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, numerics)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, numerics)

    def __call__(self, x, cos, sin, key_mask, cd, q_block: int = 0, impl: str = "fp32", n_valid=None):
        a = self.attn(self.norm1(x), cos, sin, key_mask, cd, q_block, impl, n_valid)
        x = (x.astype(F32) + a.astype(F32)).astype(cd)
        return (x.astype(F32) + self.mlp(self.norm2(x), cd, impl != "fp32").astype(F32)).astype(cd)


class ViT(nnx.Module):
    """patches [B, N, 3, p, p] (or [B, N, 3*p*p]) at grid positions (rows, cols) -> [B, N, C]."""

    def __init__(self, cfg: VisionConfig, *, numerics: Numerics):
        self.cfg = cfg
        self.numerics = numerics
        self.patch_embed = PatchEmbed(cfg, numerics)
        self.blocks = nnx.List([Block(cfg, numerics) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, patches, rows, cols, n_valid, q_block: int = 0, impl: str | None = None):
        """rows/cols: [B, N] int32 patch grid position; n_valid: [B] real patches per image
        (keys at index >= n_valid are masked). ``impl``: "fp32" (parity path), "cudnn", "mgpu" or
        "xla" (performance mode, see ``attention_bf16``); default from ``numerics.vision_attention``."""
        return self.run(patches, rows, cols, n_valid, 0, len(self.blocks), q_block, impl)

    def run(self, x, rows, cols, n_valid, start: int, stop: int, q_block: int = 0, impl: str | None = None):
        """Blocks ``start`` to ``stop`` - 1: ``x`` the patches where ``start`` is 0 (embedded first),
        else the previous block's output [B, N, C]; the final norm where ``stop`` is the last.
        ``__call__`` runs them all; ``encode_images`` runs the tower in parts (``tower_parts``)."""
        cd = self.numerics.dtype
        impl = attention_impl(self.numerics.vision_attention) if impl is None else impl
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"ViT: attention impl {impl!r} not in {ATTENTION_IMPLS}")
        b, n = x.shape[:2]
        if start == 0:
            x = _linear(self.patch_embed.proj, x.reshape(b, n, -1).astype(cd), cd, impl != "fp32")
        cos, sin = rope_tables(rows, cols, self.cfg.head_dim // 2, self.cfg.rope_theta)
        key_mask = jnp.arange(n)[None, :] < n_valid[:, None]
        for block in self.blocks[start:stop]:
            x = block(x, cos, sin, key_mask, cd, q_block, impl, n_valid)
        return self.norm(x) if stop == len(self.blocks) else x


def build_vision(cfg: VisionConfig, out_dim: int, numerics: Numerics) -> tuple[ViT, Aligner]:
    """A zero-initialised (ViT, Aligner) pair; fill it with ``load_vision_weights`` or assign_params."""
    return ViT(cfg, numerics=numerics), Aligner(cfg, out_dim, numerics=numerics)


def build_vision_modules(config, numerics: Numerics) -> tuple[ViT, Aligner]:
    """(ViT, Aligner) for a ModelConfig (aligner output = the text hidden size)."""
    return build_vision(config.vision, config.text.hidden_size, numerics)


def load_vision_weights(vision: ViT, aligner: Aligner, ckpt) -> None:
    """Fill both modules from a Checkpoint (original names ``vision.*`` and ``aligner.*``)."""
    from dsv41_jax.weights import assign_params

    def get(name):
        a = ckpt.get(name)
        return a.astype(np.float32) if a.dtype != np.float32 else a

    assign_params(vision, get, ckpt.names, prefix="vision.")
    assign_params(aligner, get, ckpt.names, prefix="aligner.")


# ------------------------------------------------------------------------------ batching


def default_bucket(n: int) -> int:
    """Padded patch count for an image of ``n`` patches: at least 64, then steps of 1/16 of the
    next power of two (at most ~6% padding); above 2048 a multiple of 256 so the attention can
    run in query blocks."""
    if n <= 64:
        return 64
    step = max(64, (1 << (n - 1).bit_length()) // 16)
    if n > 2048:
        step = max(step, 256)
    return -(-n // step) * step


def tight_bucket(n: int) -> int:
    """The performance mode's default: steps of 1/32 of the power of two at or below ``n`` (at most
    ~3% padding, e.g. 8649 -> 8704 where ``default_bucket`` gives 9216), at least 64, multiples of
    128 above 2048. 32 shapes per octave (``default_bucket``: 16): padded rows cost GEMM and
    attention FLOPs, and the fused attention needs no query blocking."""
    if n <= 64:
        return 64
    step = max(64, (1 << (n.bit_length() - 1)) // 32)
    if n > 2048:
        step = max(step, 128)
    return -(-n // step) * step


def exact_bucket(n: int) -> int:
    return n


def _query_block(n: int) -> int:
    if n <= 2048:
        return 0
    for qb in (1024, 512, 256):
        if n % qb == 0:
            return qb
    return 0


@dataclasses.dataclass(frozen=True, eq=False)
class VisionGroup:
    """Images padded to one patch bucket and stacked (host arrays, ready for the jitted tower)."""

    image_ids: tuple[int, ...]  # positions in the encode_images list; padding slots are not listed
    patches: np.ndarray  # [B, Nb, 3*p*p] bf16, or uint8 pixels (``pack_images(pixels=True)``)
    rows: np.ndarray  # [B, Nb] int32
    cols: np.ndarray  # [B, Nb] int32
    n_valid: np.ndarray  # [B] int32
    merge: np.ndarray  # [B, Rb, r*r] int32 (Nb = the zero row)
    n_patches: tuple[int, ...]
    n_rows: tuple[int, ...]


def pack_images(images: Sequence[ProcessedImage], cfg: VisionConfig, *,
                bucket: Callable[[int], int] = default_bucket, batch_multiple: int = 1,
                pixels: bool = False) -> list[VisionGroup]:
    """Group images by padded patch count and stack each group. The image count of a group is
    padded (1, 2, 4, then multiples of 4, and to a multiple of ``batch_multiple``) with one-patch
    dummy images, so few distinct shapes get compiled. ``pixels``: a group whose images all carry
    their uint8 ``pixels`` holds those (half the bytes to pack and send; the tower
    normalizes them on the device), the others their bf16 patches."""
    r = cfg.downsample_ratio
    by_bucket: dict[int, list[int]] = {}
    for i, im in enumerate(images):
        nb = int(bucket(im.n_patches))
        if nb < im.n_patches:
            raise ValueError(f"bucket({im.n_patches}) = {nb} is smaller than the patch count of {im.name}")
        by_bucket.setdefault(nb, []).append(i)
    groups = []
    for nb, ids in by_bucket.items():
        b = 1 << (len(ids) - 1).bit_length() if len(ids) <= 4 else -(-len(ids) // 4) * 4
        b = -(-b // batch_multiple) * batch_multiple
        rb = max(images[i].n_rows for i in ids)
        rb = -(-rb // 8) * 8
        dim = images[ids[0]].patches[0].size
        raw = pixels and all(images[i].pixels is not None for i in ids)
        for i in ids if raw else ():
            px, pa = images[i].pixels, images[i].patches
            if px.dtype != np.uint8 or px.shape != pa.shape:
                raise ValueError(f"image {images[i].name}: pixels {px.shape} {px.dtype} do not match its patches "
                                 f"{pa.shape} (uint8 of the same shape expected)")
        patches = np.zeros((b, nb, dim), np.uint8 if raw else images[ids[0]].patches.dtype)
        rows = np.zeros((b, nb), np.int32)
        cols = np.zeros((b, nb), np.int32)
        n_valid = np.ones((b,), np.int32)
        merge = np.full((b, rb, r * r), nb, np.int32)
        for slot, i in enumerate(ids):
            im = images[i]
            n = im.n_patches
            patches[slot, :n] = (im.pixels if raw else im.patches).reshape(n, -1)
            grid = np.arange(n)
            rows[slot, :n], cols[slot, :n] = grid // im.vit_grid[1], grid % im.vit_grid[1]
            n_valid[slot] = n
            merge[slot, :im.n_rows] = merge_index(im.vit_grid, r, nb)
        groups.append(VisionGroup(tuple(ids), patches, rows, cols, n_valid, merge,
                                  tuple(images[i].n_patches for i in ids), tuple(images[i].n_rows for i in ids)))
    return groups


def device_patches(patches, n_valid):
    """bf16 patches [B, Nb, 3*p*p] as given, or from uint8 pixels: ``processor.PIXEL_TABLE`` looked
    up on the device (``normalize``'s values exactly), rows past ``n_valid`` zero as in a bf16 pack."""
    if patches.dtype != jnp.uint8:
        return patches
    from dsv41_jax.processor import PIXEL_TABLE

    x = jnp.take(jnp.asarray(PIXEL_TABLE), patches.astype(jnp.int32), axis=0)
    live = jnp.arange(patches.shape[1])[None, :, None] < n_valid[:, None, None]
    return jnp.where(live, x, jnp.zeros((), x.dtype))


# four executables: run 45 (session 35, H100, bench_slice's `vit` row, six processes alternating)
# timed encode_images on a 961-token image at 45.8-47.4 ms in 4 parts against 50.7-51.7 ms in one
# (the tower's kernels ~42 ms either way: the parts hide the next executable's preparation); run
# 39's probe_vit_gap.py, one process, had seen no difference (44.2 ms both)
DEFAULT_VIT_PARTS = 4


def tower_parts(n_layers: int) -> tuple[tuple[int, int], ...]:
    """The block ranges ``encode_images`` runs as separate executables, ``DSV41_VIT_PARTS`` of them
    (``DEFAULT_VIT_PARTS``; 1: the whole tower in one). Each launch of an XLA executable on the GPU
    first prepares its CUDA graph (command buffer) for the call's buffers, ~6 ms of host time for
    the 32-block tower's ~570 kernels (run 38, H100), and the GPU waits for it. In parts, each
    next part is prepared while the GPU runs the previous one: the first part is short (2 blocks)
    so the GPU starts early, the later ones longer (2, 6, then the rest in equal parts; 4 parts:
    0-2, 2-8, 8-20, 20-32). Run 45: 4 parts take 3-5 ms less per call than one (see
    ``DEFAULT_VIT_PARTS``); the values are bit-equal whatever the parts."""
    raw = os.environ.get("DSV41_VIT_PARTS", str(DEFAULT_VIT_PARTS))
    try:
        k = int(raw)
    except ValueError:
        k = 0
    if k < 1:
        raise ValueError(f"DSV41_VIT_PARTS={raw!r}: a whole number of executables, at least 1 (default "
                         f"{DEFAULT_VIT_PARTS})")
    edges = [0]
    for size in (2, 6):
        if len(edges) < k and edges[-1] + size < n_layers:
            edges.append(edges[-1] + size)
    a, rest = edges[-1], k - (len(edges) - 1)  # the remaining blocks in ``rest`` equal parts
    for i in range(1, rest):
        e = a + (n_layers - a) * i // rest
        if edges[-1] < e < n_layers:
            edges.append(e)
    edges.append(n_layers)
    return tuple(zip(edges[:-1], edges[1:]))


def _tower_pure(graphdef, treedef, leaves, x, rows, cols, n_valid, merge, q_block=0, impl="fp32", part=None):
    """Blocks ``part`` = (start, stop) of the tower (all where None): from the packed patches where
    start is 0, the aligner's rows too where stop is the last block (then a pair)."""
    vision, aligner = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))
    start, stop = (0, len(vision.blocks)) if part is None else part
    if start == 0:
        x = device_patches(x, n_valid)
    x = vision.run(x, rows, cols, n_valid, start, stop, q_block=q_block, impl=impl)
    return (x, aligner(x, merge)) if stop == len(vision.blocks) else x


# (graphdef, treedef) -> the jitted tower of that structure: towers of equal structure share one
# function and so its compiled executables (the key is hashed once per runner, not per call:
# hashing an nnx GraphDef walks it, ~2 ms for the tower)
_TOWER_FNS: dict = {}


class _Tower:
    """The tower + aligner of one (vision, aligner) pair as a plain jitted function of their weights.

    ``nnx.jit`` walks both module graphs on every call (tens of ms of host time for the 32-block
    tower, longer than a GPU runs the whole 8.6k-patch image: docs/performance.md run 14). Here the
    graph is split once; each call reads the current value of every weight Variable (so weights
    replaced in place, e.g. by a loader, are seen) and calls one ``jax.jit`` function. Replacing a
    submodule or Variable object after the first encode is not seen: build a new model instead."""

    def __init__(self, vision, aligner):
        graphdef, state = nnx.split((vision, aligner))
        by_path = {p: v for p, v in nnx.iter_graph((vision, aligner)) if isinstance(v, nnx.Variable)}
        self.variables = [by_path[p] for p, _ in state.flat_state()]
        leaves, treedef = jax.tree_util.tree_flatten(state)
        if len(leaves) != len(self.variables) or any(a is not v.get_value() for a, v in zip(leaves, self.variables)):
            raise RuntimeError("vision tower: the split state does not list its Variables in path order")
        self._aligner = weakref.ref(aligner)
        self._values = ValueReader(self.variables)
        key = (graphdef, treedef)
        if key not in _TOWER_FNS:
            _TOWER_FNS[key] = jax.jit(functools.partial(_tower_pure, graphdef, treedef),
                                      static_argnames=("q_block", "impl", "part"))
        self.fn = _TOWER_FNS[key]
        self.n_layers = len(vision.blocks)

    def __call__(self, patches, rows, cols, n_valid, merge, q_block: int = 0, impl: str = "fp32"):
        values = self._values()
        parts = tower_parts(self.n_layers)
        if len(parts) == 1:
            return self.fn(values, patches, rows, cols, n_valid, merge, q_block=q_block, impl=impl)
        x = patches
        for part in parts:  # (each dispatched as soon as the previous one is: the GPU runs them in order)
            x = self.fn(values, x, rows, cols, n_valid, merge, q_block=q_block, impl=impl, part=part)
        return x


_TOWERS: "weakref.WeakKeyDictionary[ViT, _Tower]" = weakref.WeakKeyDictionary()


def _tower(vision, aligner, *args, q_block: int = 0, impl: str = "fp32"):
    """Run the tower + aligner (one cached ``_Tower`` per vision module and aligner)."""
    runner = _TOWERS.get(vision)
    if runner is None or runner._aligner() is not aligner:
        runner = _TOWERS[vision] = _Tower(vision, aligner)
    return runner(*args, q_block=q_block, impl=impl)


@dataclasses.dataclass(frozen=True)
class VisionOutputs:
    span_embeds: jax.Array  # [sum span_len, D] compute dtype, images in order
    aligner_rows: jax.Array | None = None  # [sum n_rows, D]
    vit_out: jax.Array | None = None  # [sum n_patches, C]


def _rows_index(group_sizes, ids_of_group, pad):
    """Flat row index of each image's first row when every group's padded [B, pad_g] block is
    concatenated in group order."""
    off, base = {}, 0
    for size, ids, p in zip(group_sizes, ids_of_group, pad):
        for slot, i in enumerate(ids):
            off[i] = base + slot * p
        base += size * p
    return off


def encode_images(vision: ViT, aligner: Aligner, image_vectors: Any, images: Sequence[ProcessedImage],
                  numerics: Numerics | None = None, *, bucket: Callable[[int], int] | None = None,
                  mesh: jax.sharding.Mesh | None = None, axis: str | None = None, return_details: bool = False):
    """Run the vision tower + aligner on ``images`` and assemble their spans.

    image_vectors: (image_start, image_newline, image_end), a mapping with those names, or the
    top-level model (anything with those attributes). Returns the span embeddings
    [sum span_len, D] in the compute dtype, images concatenated in order (feed them to
    ``merge_spans``); with ``return_details`` a ``VisionOutputs`` that also holds the aligner
    rows and the ViT output of the real patches.

    Data-parallel mode: with a ``mesh``, each bucket group's image axis is padded to a multiple of
    the mesh axis ``axis`` (default: the first) and sharded over it, so every device runs the same
    number of equally padded images; the weights are replicated (place them on the mesh yourself
    to avoid a per-call copy). The result equals the single-device result, in the same order.

    Attention path: ``numerics.vision_attention`` when ``numerics`` is given, else the tower's
    (set at build/load time): "fp32" (parity, default) or "bf16" (performance mode; see
    ``attention_bf16``). ``bucket`` defaults to ``default_bucket`` for "fp32" and to
    ``tight_bucket`` for "bf16".
    """
    cd = vision.numerics.dtype
    if numerics is not None and numerics.dtype != cd:
        raise ValueError(f"encode_images: numerics {numerics.compute_dtype} but the vision tower was built "
                         f"for {vision.numerics.compute_dtype}")
    mode = (vision.numerics if numerics is None else numerics).vision_attention
    impl = attention_impl(mode)
    if bucket is None:
        bucket = default_bucket if mode == "fp32" else tight_bucket
    if not images:
        empty = jnp.zeros((0, image_vector_table(image_vectors, cd).shape[-1]), cd)
        return VisionOutputs(empty, empty, jnp.zeros((0, vision.cfg.hidden_size), cd)) if return_details else empty
    put, n_dev = jnp.asarray, 1
    if mesh is not None:
        axis = mesh.axis_names[0] if axis is None else axis
        n_dev = mesh.shape[axis]
        auto = jax.sharding.Mesh(mesh.devices, mesh.axis_names)  # Auto axes: let XLA propagate the sharding
        sharding = jax.sharding.NamedSharding(auto, jax.sharding.PartitionSpec(axis))
        put = lambda a: jax.device_put(a, sharding)  # noqa: E731
    groups = pack_images(images, vision.cfg, bucket=bucket, batch_multiple=n_dev, pixels=True)
    vit_blocks, al_blocks = [], []
    for g in groups:
        args = (put(g.patches), put(g.rows), put(g.cols), put(g.n_valid), put(g.merge))
        q_block = _query_block(g.patches.shape[1])
        try:
            x, a = _tower(vision, aligner, *args, q_block=q_block, impl=impl)
        except Exception as e:  # a cuDNN that traces but fails to build/run: XLA attention from now on
            if impl != "cudnn" or "cudnn" not in f"{type(e).__name__} {e}".lower():
                raise
            _cudnn_failed(e)
            impl = "xla"
            x, a = _tower(vision, aligner, *args, q_block=q_block, impl=impl)
        vit_blocks.append(x.reshape(-1, x.shape[-1]))
        al_blocks.append(a.reshape(-1, a.shape[-1]))
    # (after the towers are dispatched: the host work below overlaps the device's)
    vectors = image_vector_table(image_vectors, cd)
    sizes = [g.patches.shape[0] for g in groups]
    ids = [g.image_ids for g in groups]
    row_off = _rows_index(sizes, ids, [g.merge.shape[1] for g in groups])
    rows = jnp.concatenate(al_blocks) if len(al_blocks) > 1 else al_blocks[0]
    index = span_gather_index([im.types for im in images], [row_off[i] for i in range(len(images))], rows.shape[0])
    spans = gather_spans(rows, vectors, jnp.asarray(index))
    if not return_details:
        return spans
    row_index = np.concatenate([row_off[i] + np.arange(im.n_rows) for i, im in enumerate(images)])
    patch_off = _rows_index(sizes, ids, [g.patches.shape[1] for g in groups])
    patch_index = np.concatenate([patch_off[i] + np.arange(im.n_patches) for i, im in enumerate(images)])
    vit = jnp.concatenate(vit_blocks) if len(vit_blocks) > 1 else vit_blocks[0]
    return VisionOutputs(spans, jnp.take(rows, jnp.asarray(row_index), axis=0),
                         jnp.take(vit, jnp.asarray(patch_index), axis=0))
