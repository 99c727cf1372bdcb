"""Gluon helpers shared by k3c's Gluon kernels (`moe_mxfp4_gluon`, `dsa_attention_wgmma`) and pasted with them
into the emitted modules.

Gluon (`triton.experimental.gluon`) is experimental and renames its builtins between releases; the device tool's
Triton is 3.6 and pyproject pins 3.9 (TOOLCHAIN.md). What differs is resolved here at compile time, by a
constexpr branch: only the taken side is traced, so the other release's name is never looked up.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.constexpr_function
def gl_async_load_named():
    """Whether this Triton names Gluon's cp.async `async_load` (3.9, whose `async_copy_global_to_shared` raises)
    rather than `async_copy_global_to_shared` (3.6): the same (smem, pointer, mask) builtin."""
    return hasattr(gl.nvidia.ampere.async_copy, "async_load")


@gluon.jit
def gl_async_copy(smem, pointer, mask):
    """cp.async of `pointer` (a tensor of global addresses in smem's shape) into the shared-memory descriptor
    `smem`, lanes where `mask` is false zero-filled (sm_80+: `cp.async`, 16 bytes a copy where the layout gives a
    thread 16 contiguous bytes). Completes asynchronously: `commit_group` / `wait_group` order it."""
    if gl_async_load_named():
        gl.nvidia.ampere.async_copy.async_load(smem, pointer, mask=mask)
    else:
        gl.nvidia.ampere.async_copy.async_copy_global_to_shared(smem, pointer, mask=mask)


@gluon.constexpr_function
def gl_barrier_named():
    """Whether this Triton names Gluon's CTA barrier `barrier` (3.9) rather than `thread_barrier` (3.6)."""
    return hasattr(gl, "barrier")


@gluon.jit
def gl_thread_barrier():
    """Synchronise the CTA's threads (`bar.sync 0`): every shared-memory access issued before it by any thread
    is complete after it."""
    if gl_barrier_named():
        gl.barrier()
    else:
        gl.thread_barrier()


@gluon.constexpr_function
def gl_tma_load_named():
    """Whether this Triton names Gluon's TMA load `tma.async_load` (3.9, whose `async_copy_global_to_shared`
    raises) rather than `tma.async_copy_global_to_shared` (3.6): the same (descriptor, coordinates, mbarrier,
    smem, pred) builtin."""
    return hasattr(gl.nvidia.hopper.tma, "async_load")


@gluon.jit
def gl_tma_load(desc, coord, bar, smem, pred):
    """TMA copy of the box of tensor descriptor `desc` at element coordinates `coord` into the shared-memory
    descriptor `smem` (sm_90+: `cp.async.bulk.tensor`, issued by one thread), its bytes completing on mbarrier
    `bar` (the caller sets the expected byte count: `mbarrier.expect`); nothing is issued where `pred` is false.
    Out-of-bounds box elements are zero-filled."""
    if gl_tma_load_named():
        gl.nvidia.hopper.tma.async_load(desc, coord, bar, smem, pred)
    else:
        gl.nvidia.hopper.tma.async_copy_global_to_shared(desc, coord, bar, smem, pred)


@gluon.constexpr_function
def gl_reinterpret_named():
    """Whether this Triton names the shared-memory descriptor's reinterpretation `reinterpret` (3.9) rather than
    `_reinterpret` (3.6): the same (dtype, shape, layout) builtin."""
    return hasattr(gl.shared_memory_descriptor, "reinterpret")


@gluon.jit
def gl_reinterpret(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """The shared-memory descriptor `smem` viewed as `dtype` [shape] in `layout` (the same bytes; e.g. a [R, C]
    stage as the [C/c, R, c] box of a 3-D TMA copy whose 128-byte swizzle places it alike)."""
    if gl_reinterpret_named():
        return smem.reinterpret(dtype, shape, layout)
    else:
        return smem._reinterpret(dtype, shape, layout)
