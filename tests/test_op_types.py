"""Every Graph op method with every dtype input() takes (issue 21): a combination ggml's kernels cannot run is
refused in Python by name (InputTypeError), the others compute. Each op runs in a child interpreter: an abort
or a segfault in ggml fails that op's test instead of the session."""

from __future__ import annotations

import pytest
from _misuse import run_child

from hotggml.graph import OP_TYPES

PRELUDE = """
import itertools
import numpy as np
from hotggml.errors import HotggmlError, InputTypeError
from hotggml.graph import Backend, Graph, OP_TYPES
be = Backend("CPU")
DTYPES = {"f32": np.float32, "f16": np.float16, "i32": np.int32}

def arrays(shapes, names):
    return [(np.arange(int(np.prod(s))) % 5 + 1).reshape(s).astype(DTYPES[n]) for s, n in zip(shapes, names)]

def drive(op, shapes, call):
    ran = refused = 0
    for names in itertools.product(DTYPES, repeat=len(shapes)):
        with Graph(be) as g:
            leaves = [g.input(a) for a in arrays(shapes, names)]
            try:
                out = call(g, *leaves)
            except InputTypeError as e:
                assert op not in OP_TYPES or names not in OP_TYPES[op], f"{op}{names} refused: {e}"
                refused += 1
                continue
            assert op not in OP_TYPES or names in OP_TYPES[op], f"{op}{names} accepted"
            g.build([out])
            g.compute()
            assert np.all(np.isfinite(g.read(out).astype(np.float64))), (op, names)
            ran += 1
    print(op, "ran", ran, "refused", refused)
"""

CALLS = {
    "add": ("[(2, 3), (2, 3)]", "lambda g, a, b: g.add(a, b)"),
    "mul": ("[(2, 3), (2, 3)]", "lambda g, a, b: g.mul(a, b)"),
    "sum": ("[(2, 3)]", "lambda g, a: g.sum(a)"),
    "mul_mat": ("[(3, 4), (2, 4)]", "lambda g, a, b: g.mul_mat(a, b)"),
    "soft_max_ext": ("[(2, 3)]", "lambda g, a: g.soft_max_ext(a, None, 0.5)"),
    "cont": ("[(2, 3)]", "lambda g, a: g.cont(g.permute(a, 1, 0, 2, 3))"),
    "repeat": ("[(1, 3), (2, 3)]", "lambda g, a, b: g.repeat(a, b)"),
    "reshape": ("[(2, 3)]", "lambda g, a: g.cont(g.reshape(a, (3, 2, 1, 1)))"),
}


def test_every_typed_op_is_driven():
    assert set(OP_TYPES) <= set(CALLS)


@pytest.mark.parametrize("op", list(CALLS))
def test_an_op_method_refuses_or_computes_every_dtype(lib, op):
    shapes, call = CALLS[op]
    run = run_child(PRELUDE, f"drive({op!r}, {shapes}, {call})\n")
    assert run.returncode == 0 and run.stdout.strip().endswith("alive"), run.stdout[-2000:] + run.stderr[-2000:]
    ran = int(run.stdout.split(" ran ")[1].split()[0])
    assert ran >= 1  # the op's own types compute: a table refusing everything would pass otherwise
