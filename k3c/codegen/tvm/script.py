"""TVMScript text for one kernel group: the PrimFunc signature, flat buffers, parallel loops and dtype conversions.

Every TVM kernel of an artifact is one TIR PrimFunc with the same calling convention:

    NAME(in_0, ..., in_m, out_0, ..., out_n, s_B: int64, s_T: int64, s_L: int64)

tensors first (the group's inputs then outputs, contiguous, any of them possibly the same tensor as another: the
in-place states), then the call's sizes. Each tensor is matched at its IR shape and read through a flat 1-D view
of its element count (an expression of the sizes); generators compute flat offsets themselves, so a rank-0 or
rank-5 value needs no special case. Symbolic dims print as expressions of `s_B`, `s_T`, `s_L` (the IR's `B`, `T`,
`L`; `T` itself names the TVMScript module).

Loops over independent work (rows, heads, tokens) are written once with `Func.parallel` and lowered per device:
`T.parallel` on CPU (LLVM's OpenMP-like thread pool), one CUDA thread per iteration on the GPU (the naive CUDA
schedule). The CUDA schedules of the kinds that dominate a step use the block primitives instead (`cuda_blocks`:
one thread block per row / head, its threads over the row; `cuda_warps`: one warp per output, its lanes over the
dot; `strided`, `allreduce`, `shared`, `sync`): TVM lowers `allreduce` (its `tvm_thread_allreduce` intrinsic) to
warp shuffles plus one shared-memory stage across warps. Inner loops are
serial with constant extents where the IR has them, so that LLVM vectorizes them (TVM 0.27's own `T.vectorized`
fails to legalize bf16 stores and miscompiles strided writes). Arithmetic is fp32; bf16/f16 values are converted at the
loads and stores.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager

from k3c.errors import UnsupportedError
from k3c.ir.graph import Value
from k3c.ir.types import dim_str, numel

TIR_DTYPE = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "i64": "int64", "i32": "int32",
             "u8": "uint8", "bool": "bool"}
#: Bytes per element: on the CPU a tensor is only assumed aligned to its element (weights are read in place from
#: the artifact's safetensors, which align each tensor to its element size), so LLVM emits unaligned vector loads.
_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "i64": 8, "i32": 4, "u8": 1, "bool": 1}
SIZE_ARGS = ("s_B", "s_T", "s_L")
DEVICES = ("cpu", "cuda")
#: CUDA threads per block for `Func.parallel` loops.
CUDA_THREADS = 128
#: At most this many threads per block of the block-per-row schedules (`Func.cuda_blocks`).
CUDA_ROW_THREADS = 256
WARP = 32
#: Warps per block of the warp-per-output schedules (`Func.cuda_warps`).
CUDA_WARPS = 4
_REDUCERS = {"sum": ("a + b", 0.0), "max": ("T.max(a, b)", float("-inf"))}
#: Partial sums of `Func.dot` (8 fp32 = one AVX2 register).
LANES = 8
_SYMBOL = re.compile(r"[A-Za-z_]\w*")
_CEIL = re.compile(r"ceiling\(([^()]*)/(\d+)\)")


def single_node(group):
    """The one node of `group`. Raises `UnsupportedError` unless the group is that node and reads and writes
    exactly its inputs and outputs, in order (what the model-op generators assume)."""
    if len(group.nodes) != 1:
        raise UnsupportedError(f"{group.name}: a {group.kind} group must be one node, not {len(group.nodes)}")
    (node,) = group.nodes
    if list(group.inputs) != list(node.inputs) or list(group.outputs) != list(node.outputs):
        raise UnsupportedError(f"{group.name}: {node.op} must read and write exactly its node's values")
    return node


def dim_expr(d) -> str:
    """TVMScript text of IR dim `d` (an int or a sympy expression over B, T, L) over the size arguments,
    parenthesized unless it is one name or number.

    `ceiling(e/k)` (a token shard's rows, `k3c/ir/ops/collective.py`) becomes the integer `(e + k - 1) // k`.
    Raises `UnsupportedError` for a dim over another symbol or function (floor, Max, ...)."""
    text = _CEIL.sub(lambda m: f"(({m.group(1)}) + {int(m.group(2)) - 1}) // {m.group(2)}", dim_str(d))

    def sub(m):
        name = m.group(0)
        if name in ("B", "T", "L"):
            return f"s_{name}"
        raise UnsupportedError(f"TVM kernels take dims over B, T, L only, not {text!r}")

    out = _SYMBOL.sub(sub, text)
    return out if re.fullmatch(r"\w+", out) else f"({out})"


def row_threads(extent) -> int:
    """Threads per block for a row of `extent` elements (an int, or script text when symbolic): a multiple of the
    warp size, at most `CUDA_ROW_THREADS`, no more than the row needs."""
    if not isinstance(extent, int):
        return CUDA_ROW_THREADS
    return min(CUDA_ROW_THREADS, max(WARP, -(-extent // WARP) * WARP))


def const_int(d) -> int | None:
    """`d` as a Python int when it is a constant dim, else None."""
    return d if isinstance(d, int) else (int(d) if getattr(d, "is_Integer", False) else None)


def f32(x: float) -> str:
    """An fp32 literal (non-finite values included)."""
    if math.isnan(x):
        return 'T.float32(float("nan"))'
    if math.isinf(x):
        return f'T.float32(float("{"inf" if x > 0 else "-inf"}"))'
    return f"T.float32({float(x)!r})"


def load(buf: str, idx: str, dtype: str) -> str:
    """fp32 value of element `idx` of `buf` (IR dtype `dtype`, a float)."""
    return f"{buf}[{idx}]" if dtype == "f32" else f'T.Cast("float32", {buf}[{idx}])'


def store_value(expr: str, dtype: str) -> str:
    """`expr` (fp32) converted for a store into a buffer of float IR dtype `dtype` (round to nearest even)."""
    return expr if dtype == "f32" else f'T.Cast("{TIR_DTYPE[dtype]}", {expr})'


def round_bf16(expr: str) -> str:
    """fp32 `expr` rounded to the nearest bf16 (ties to even), kept in fp32. TVM folds a Cast round trip
    `float32(bfloat16(x))` to x, so the rounding of a fused `cast` is written on the bits."""
    bits = f'T.reinterpret("uint32", {expr})'
    return (f'T.reinterpret("float32", ({bits} + T.uint32(32767) + (({bits} >> T.uint32(16)) & T.uint32(1)))'
            f' & T.uint32(4294901760))')


class Func:
    """Builder of one PrimFunc's TVMScript text (see the module docstring).

    `names`: the buffer name of each input then output (defaults `in0..`, `out0..`). `noalias=False` for kernels
    whose outputs may be the same tensors as inputs (state updates in place).
    """

    def __init__(self, name: str, inputs: list[Value], outputs: list[Value], device: str, summary: str,
                 names: list[str] | None = None, noalias: bool = True):
        if device not in DEVICES:
            raise UnsupportedError(f"TVM kernels target {', '.join(DEVICES)}, not {device!r}")
        self.name, self.device = name, device
        values = list(inputs) + list(outputs)
        names = names or [f"in{i}" for i in range(len(inputs))] + [f"out{i}" for i in range(len(outputs))]
        if len(names) != len(values):
            raise UnsupportedError(f"{name}: {len(names)} buffer names for {len(values)} values")
        self.buf = dict(zip(values, names))
        args = ", ".join([f"{n}_h: T.handle" for n in names] + [f"{s}: T.int64" for s in SIZE_ARGS])
        self.lines = [f"# {summary}", "@T.prim_func", f"def {name}({args}):",
                      f'    T.func_attr({{"tirx.noalias": {noalias}}})']
        for v, n in zip(values, names):
            shape = "".join(f"{dim_expr(d)}, " for d in v.type.shape)
            align = f", align={_ITEMSIZE[v.type.dtype]}" if device == "cpu" else ""
            self.lines.append(f'    {n}_nd = T.match_buffer({n}_h, ({shape}), "{TIR_DTYPE[v.type.dtype]}"{align})'
                              f'  # {"in " if v in inputs else "out"} {v.type}')
        for v, n in zip(values, names):
            self.lines.append(f'    {n} = T.decl_buffer(({dim_expr(numel(v.type))},), "{TIR_DTYPE[v.type.dtype]}", '
                              f'data={n}_nd.data)')
        self.depth = 1
        self._tmp = 0
        self._block_lanes = "tx"  # the thread variables of the current `cuda_blocks` block

    # ---- statements --------------------------------------------------------------------------------------------
    def emit(self, *lines: str) -> None:
        self.lines += ["    " * self.depth + ln for ln in lines]

    @contextmanager
    def block(self, header: str):
        """A nested statement: `header` (ending in ':') then the lines emitted inside the `with`."""
        self.emit(header)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    @contextmanager
    def parallel(self, var: str, extent: str):
        """`for var in range(extent)` whose iterations are independent: CPU threads, or CUDA threads (one per
        iteration, `CUDA_THREADS` per block, the tail guarded)."""
        if self.device == "cpu":
            with self.block(f"for {var} in T.parallel({extent}):"):
                yield
            return
        n = CUDA_THREADS
        with self.block(f'for {var}_o in T.thread_binding(({extent} + {n - 1}) // {n}, thread="blockIdx.x"):'), \
                self.block(f'for {var}_i in T.thread_binding({n}, thread="threadIdx.x"):'), \
                self.block(f"if {var}_o * {n} + {var}_i < {extent}:"):
            self.emit(f"{var} = {var}_o * {n} + {var}_i")
            yield

    @contextmanager
    def cuda_blocks(self, var: str, extent: str, threads: int, warps: bool = False):
        """CUDA: `for var in range(extent)` over thread blocks of `threads` threads (the thread index is `tx`).
        Every thread of a block runs the body: it may `sync` and `allreduce` (over the whole block). `warps`: the
        threads are also named as warp `w` and `lane` (threads a multiple of the warp size), so that the body may
        reduce within each warp too (`allreduce(..., lane="lane")`)."""
        self._cuda_only("cuda_blocks")
        with self.block(f'for {var} in T.thread_binding({extent}, thread="blockIdx.x"):'):
            if not warps:
                with self.block(f'for tx in T.thread_binding({threads}, thread="threadIdx.x"):'):
                    self._block_lanes = "tx"
                    yield
                return
            with self.block(f'for w in T.thread_binding({threads // WARP}, thread="threadIdx.y"):'), \
                    self.block(f'for lane in T.thread_binding({WARP}, thread="threadIdx.x"):'):
                self.emit(f"tx = w * {WARP} + lane")
                self._block_lanes = "lane, w"
                yield

    @contextmanager
    def cuda_warps(self, var: str, extent: str):
        """CUDA: `for var in range(extent)`, one warp per iteration (`CUDA_WARPS` per block; the lane is `lane`).
        The tail warps of the last block compute iteration `extent - 1` again: the body guards its stores with
        `{var}_ok` (the warps' reductions stay outside any branch)."""
        self._cuda_only("cuda_warps")
        n = CUDA_WARPS
        with self.block(f'for {var}_o in T.thread_binding(({extent} + {n - 1}) // {n}, thread="blockIdx.x"):'), \
                self.block(f'for {var}_w in T.thread_binding({n}, thread="threadIdx.y"):'), \
                self.block(f'for lane in T.thread_binding({WARP}, thread="threadIdx.x"):'):
            self.emit(f'{var}_ok = {var}_o * {n} + T.Cast("int64", {var}_w) < {extent}',
                      f'{var} = T.min({var}_o * {n} + T.Cast("int64", {var}_w), {extent} - 1)')
            yield

    @contextmanager
    def strided(self, var: str, extent: int | str, threads: int, lane: str = "tx"):
        """CUDA: the share of thread `lane` of `for var in range(extent)`: var = lane, lane + threads, ... (the
        threads of a warp touch consecutive elements: coalesced loads)."""
        steps = f"{extent // threads}" if isinstance(extent, int) and extent % threads == 0 else \
            f"({extent} + {threads - 1}) // {threads}"
        with self.block(f"for {var}_s in T.serial({steps}):"):
            self.emit(f"{var} = {var}_s * {threads} + {lane}")
            if isinstance(extent, int) and extent % threads == 0:
                yield
            else:
                with self.block(f"if {var} < {extent}:"):
                    yield

    def allreduce(self, value: str, op: str = "sum", lane: str | None = None) -> str:
        """CUDA: emit the reduction (`op`: "sum" | "max", fp32) of `value` over the threads `lane` (default: all
        threads of the `cuda_blocks` block; "lane": those of the warp, in `cuda_warps` or a `warps` block); every
        thread gets the result. Returns its name. All threads reduced over must reach it (no divergent branch)."""
        self._cuda_only("allreduce")
        lane = lane or self._block_lanes
        expr, ident = _REDUCERS[op]
        red = self.local(1)
        with self.block(f'with T.attr(T.comm_reducer(lambda a, b: {expr}, [{f32(ident)}]), "reduce_scope", '
                        f'T.reinterpret("handle", T.uint64(0))):'):
            self.emit(f"T.tvm_thread_allreduce(T.uint32(1), {value}, T.bool(True), {red}[0], {lane})")
        return f"{red}[0]"

    def shared(self, shape: int, dtype: str = "float32", name: str | None = None) -> str:
        """CUDA: a buffer of `shape` elements shared by the threads of a block; returns its name."""
        self._cuda_only("shared")
        name = name or self._fresh()
        self.emit(f'{name} = T.alloc_buffer(({shape},), "{dtype}", scope="shared")')
        return name

    def sync(self) -> None:
        """CUDA: a barrier of the block's threads (shared-memory writes before it are seen after it)."""
        self.emit('T.tvm_storage_sync("shared")')

    def _cuda_only(self, what: str) -> None:
        if self.device != "cuda":
            raise UnsupportedError(f"{self.name}: {what} is a CUDA schedule primitive (device {self.device})")

    def _fresh(self) -> str:
        self._tmp += 1
        return f"t{self._tmp}"

    def local(self, shape: int | str, dtype: str = "float32", name: str | None = None) -> str:
        """A per-iteration scratch buffer of `shape` elements (registers / stack); returns its name."""
        name = name or self._fresh()
        self.emit(f'{name} = T.alloc_buffer(({shape},), "{dtype}", scope="local")')
        return name

    def dot(self, out: str, extent: int | str, term) -> None:
        """Emit `out = Σ_{d < extent} term(d)` (fp32; `term` maps the index name to an expression). With a constant
        extent that is a multiple of `LANES`, the sum runs in `LANES` independent partial sums, which LLVM turns
        into vector FMAs (one serial accumulator would need reassociation, which TVM does not allow it)."""
        self._tmp += 1
        acc, n = f"dot{self._tmp}", LANES
        if isinstance(extent, int) and extent % n == 0 and extent >= n:
            self.local(n, name=acc)
            with self.block(f"for l in T.serial({n}):"):
                self.emit(f"{acc}[l] = T.float32(0.0)")
            with self.block(f"for d0 in T.serial({extent // n}):"), self.block(f"for l in T.serial({n}):"):
                self.emit(f"{acc}[l] = {acc}[l] + {term(f'(d0 * {n} + l)')}")
            self.emit(f"{out} = {' + '.join(f'{acc}[{i}]' for i in range(n))}")
            return
        self.local(1, name=acc)
        self.emit(f"{acc}[0] = T.float32(0.0)")
        with self.block(f"for d in T.serial({extent}):"):
            self.emit(f"{acc}[0] = {acc}[0] + {term('d')}")
        self.emit(f"{out} = {acc}[0]")

    def insert_sorted(self, val: str, pos: str, cnt: str, k: int, x: str, item: str) -> None:
        """Emit the insertion of (`x`, `item`) into the list `val` / `pos` of the `k` largest seen so far (sorted
        by decreasing value; `cnt[0]` entries, `cnt[1]` scratch): after every entry >= x, so that earlier items
        win ties (a stable descending sort); dropped when k entries are all >= x. O(k) with constant-extent
        loops (TIR `while` loops are avoided: TVM 0.27 miscompiles a load in their condition)."""
        self.emit(f"{cnt}[1] = T.int64(0)")
        with self.block(f"for j in T.serial({k}):"), \
                self.block(f"if T.Cast(\"int64\", j) < {cnt}[0] and {val}[j] >= {x}:"):
            self.emit(f"{cnt}[1] = {cnt}[1] + T.int64(1)")
        with self.block(f"if {cnt}[1] < T.int64({k}):"):
            with self.block(f"for jj in T.serial({k - 1}):"):
                self.emit(f"j = T.int64({k - 1}) - T.Cast(\"int64\", jj)")
                with self.block(f"if j > {cnt}[1] and j <= {cnt}[0]:"):
                    self.emit(f"{val}[j] = {val}[j - 1]", f"{pos}[j] = {pos}[j - 1]")
            self.emit(f"{val}[{cnt}[1]] = {x}", f"{pos}[{cnt}[1]] = {item}",
                      f"{cnt}[0] = T.min({cnt}[0] + T.int64(1), T.int64({k}))")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"
