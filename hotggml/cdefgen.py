"""cffi declarations generated from the patched tree's public headers, so every public function, struct and
enum of the built ggml is callable from Python (hotggml.ffi loads them with the library).

The headers are preprocessed with the build's C compiler (``cc -E``) against stub libc headers (cffi knows
size_t, the intN_t family, bool and FILE itself), with the macros cffi's parser cannot read defined away:
GGML_API and friends (visibility attributes), GGML_DEPRECATED(func, hint) -> func, GGML_RESTRICT and every
__attribute__. Run by CMakeLists.txt at configure time (``python -m hotggml.cdefgen INCLUDE_DIR OUT
--cc CC``), for ``hotggml build`` and for the wheel alike; needs nothing beyond the standard library.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# the public headers of the patched tree a graph test may need, in include order (backend-specific ones
# like ggml-cuda.h add nothing a CPU or CUDA graph needs from Python: devices come from the registry)
HEADERS = ("ggml.h", "ggml-alloc.h", "ggml-backend.h", "ggml-cpu.h", "ggml-opt.h", "ggml-rpc.h", "gguf.h")

# libc headers the public headers include: empty stubs (cffi declares the types they would bring)
STUB_HEADERS = ("stddef.h", "stdint.h", "stdbool.h", "stdio.h", "stdlib.h", "string.h", "stdarg.h", "assert.h",
                "limits.h", "math.h", "inttypes.h")

DEFINES = {
    "GGML_API": "", "GGML_BACKEND_API": "", "GGML_RESTRICT": "", "GGML_NORETURN": "",
    "GGML_DEPRECATED(func, hint)": "func", "GGML_ATTRIBUTE_FORMAT(...)": "",
    "__attribute__(x)": "", "__restrict": "", "__restrict__": "", "__inline": "", "__extension__": "",
    "GGML_CALL": "",
}

FILE_NAME = "hotggml-cdef.h"


def preprocess(include_dir: Path, cc: str = "cc") -> str:
    """The public headers of include_dir, preprocessed into one declaration text (no directives)."""
    include_dir = Path(include_dir)
    missing = [h for h in HEADERS if not (include_dir / h).is_file()]
    if missing:
        raise FileNotFoundError(f"{include_dir} lacks {', '.join(missing)}: not a ggml include folder")
    with tempfile.TemporaryDirectory(prefix="hotggml-cdef-") as tmp:
        stubs = Path(tmp) / "stubs"
        stubs.mkdir()
        for name in STUB_HEADERS:
            (stubs / name).write_text("")
        umbrella = Path(tmp) / "all.h"
        umbrella.write_text("".join(f'#include "{h}"\n' for h in HEADERS))
        cmd = [cc, "-E", "-P", "-nostdinc", "-x", "c", "-std=c11", f"-I{stubs}", f"-I{include_dir}",
               *(f"-D{name}={value}" for name, value in DEFINES.items()), str(umbrella)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{run.stderr[-4000:]}")
    return clean(run.stdout)


# sizes of the types ggml's headers take sizeof of in array bounds (C11 on the LP64 targets ggml builds for)
_SIZEOF = {"int8_t": 1, "uint8_t": 1, "int16_t": 2, "uint16_t": 2, "int32_t": 4, "uint32_t": 4, "int64_t": 8,
           "uint64_t": 8, "float": 4, "double": 8, "size_t": 8, "char": 1, "int": 4}


def clean(text: str) -> str:
    """What cffi's parser cannot read, removed or folded: static inline bodies, static_assert, and constant
    expressions in array bounds (`64 / sizeof(int32_t)` -> 16)."""
    text = re.sub(r"_Static_assert\s*\([^;]*\)\s*;", "", text)
    text = _drop_static_functions(text)
    text = re.sub(r"\[([^\[\]]*sizeof[^\[\]]*)\]", lambda m: f"[{_fold(m.group(1))}]", text)
    text = _drop_repeated_typedefs(text)
    text = re.sub(r"\n\s*\n+", "\n", text)
    return text.strip() + "\n"


def _fold(expr: str) -> int:
    """An array bound made of integers, sizeof(known type) and + - * / ( ), evaluated (integer division)."""
    expr = re.sub(r"sizeof\s*\(\s*([A-Za-z_][A-Za-z0-9_ ]*?)\s*\)", lambda m: str(_SIZEOF[m.group(1)]), expr)
    if not re.fullmatch(r"[\d\s+\-*/()]+", expr):
        raise RuntimeError(f"cannot fold the array bound {expr!r}")
    return int(eval(expr.replace("/", "//"), {"__builtins__": {}}))  # digits and operators only (checked above)


def _drop_repeated_typedefs(text: str) -> str:
    """C11 lets headers repeat an identical typedef (ggml-alloc.h and ggml-backend.h both declare the buffer
    types); cffi does not: keep the first of each one-line typedef."""
    seen, out = set(), []
    for line in text.split("\n"):
        key = " ".join(line.split())
        if key.startswith("typedef ") and key.endswith(";") and "{" not in key and "(" not in key:
            if key in seen:
                continue
            seen.add(key)
        out.append(line)
    return "\n".join(out)


def _drop_static_functions(text: str) -> str:
    """Remove `static [inline] ... { body }` definitions (cffi declares, it does not compile)."""
    out, i = [], 0
    for m in re.finditer(r"\bstatic\b[^;{]*\{", text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        depth, j = 1, m.end()
        while depth and j < len(text):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    return "".join(out)


def write(include_dir: Path, out: Path, cc: str = "cc") -> Path:
    """Generate the declarations of include_dir into out (atomically: a reader never sees half a file)."""
    text = preprocess(include_dir, cc)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tmp.write_text(f"/* generated by hotggml.cdefgen from {include_dir}: do not edit */\n" + text)
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hotggml.cdefgen", description=__doc__.split("\n\n")[0])
    parser.add_argument("include_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--cc", default=os.environ.get("CC", "cc"))
    args = parser.parse_args(argv)
    try:
        write(args.include_dir, args.out, args.cc)
    except (OSError, RuntimeError) as exc:
        print(f"hotggml.cdefgen: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
