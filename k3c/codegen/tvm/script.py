"""TVMScript text for one kernel group: the PrimFunc signature, flat buffers, parallel loops and dtype conversions.

Every TVM kernel of an artifact is one TIR PrimFunc with the same calling convention:

    NAME(in_0, ..., in_m, out_0, ..., out_n, s_B: int64, s_T: int64, s_L: int64)

tensors first (the group's inputs then outputs, contiguous, any of them possibly the same tensor as another: the
in-place states), then the call's sizes. Each tensor is matched at its IR shape and read through a flat 1-D view
of its element count (an expression of the sizes); generators compute flat offsets themselves, so a rank-0 or rank-5 value needs no
special case. Symbolic dims print as expressions of `s_B`, `s_T`, `s_L` (the IR's `B`, `T`, `L`; `T` itself names
the TVMScript module).

Loops over independent work (rows, heads, tokens) are written once with `Func.parallel` and lowered per device:
`T.parallel` on CPU (LLVM's OpenMP-like thread pool), one CUDA thread per iteration on the GPU. Inner loops are
serial with constant extents where the IR has them, so that LLVM vectorizes them (TVM's own `T.vectorized` breaks
on bf16 stores and strided writes in 0.27, see the tests). Arithmetic is fp32; bf16/f16 values are converted at the
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
SIZE_ARGS = ("s_B", "s_T", "s_L")
DEVICES = ("cpu", "cuda")
#: CUDA threads per block for `Func.parallel` loops.
CUDA_THREADS = 128
#: Partial sums of `Func.dot` (8 fp32 = one AVX2 register).
LANES = 8
_SYMBOL = re.compile(r"[A-Za-z_]\w*")


def dim_expr(d) -> str:
    """TVMScript text of IR dim `d` (an int or a sympy expression over B, T, L) over the size arguments,
    parenthesized unless it is one name or number.

    Raises `UnsupportedError` for a dim over another symbol or function (floor, Max, ...)."""
    text = dim_str(d)

    def sub(m):
        name = m.group(0)
        if name in ("B", "T", "L"):
            return f"s_{name}"
        raise UnsupportedError(f"TVM kernels take dims over B, T, L only, not {text!r}")

    out = _SYMBOL.sub(sub, text)
    return out if re.fullmatch(r"\w+", out) else f"({out})"


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
            self.lines.append(f'    {n}_nd = T.match_buffer({n}_h, ({shape}), "{TIR_DTYPE[v.type.dtype]}")'
                              f'  # {"in " if v in inputs else "out"} {v.type}')
        for v, n in zip(values, names):
            self.lines.append(f'    {n} = T.decl_buffer(({dim_expr(numel(v.type))},), "{TIR_DTYPE[v.type.dtype]}", '
                              f'data={n}_nd.data)')
        self.depth = 1
        self._tmp = 0

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

    def local(self, shape: int | str, dtype: str = "float32", name: str | None = None) -> str:
        """A per-iteration scratch buffer of `shape` elements (registers / stack); returns its name."""
        if name is None:
            self._tmp += 1
            name = f"t{self._tmp}"
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
