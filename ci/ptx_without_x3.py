"""Removes the compensated-product (X3) register kernels from a PTX file, in place, before ci/cuda-compile.sh's
sm_90a release ptxas: the spill gate reads only the TF32 kernels' reports (ci/ptxas_spills.py), and the X3 kernels
were about 60% of that ptxas time (the d160 instance: 60 s, 22 s without them). They stay compiled to PTX at the
release optimization here, and assembled at -O0 for sm_80 in the mma.sync tree's jobs.

usage: python ci/ptx_without_x3.py FILE.ptx
"""
import re
import sys

from ptxas_spills import KERNEL

# a kernel: from its ".entry NAME(" line to the closing brace at column 0 (what follows it is kept)
ENTRY = re.compile(r"(?m)^(?=(?:\.visible |\.weak )?\.entry )")
NAME = re.compile(r"(?:\.visible |\.weak )?\.entry (\S+?)\(")


def without_x3(ptx: str) -> tuple[str, int]:
    """The PTX text without the X3 register kernels' entries, and how many were removed."""
    head, *entries = ENTRY.split(ptx)
    out, removed = [head], 0
    for entry in entries:
        k = KERNEL.search(NAME.match(entry).group(1))
        if k and re.match(r"Lb1E", k.group(3)):  # the first bool template argument is X3
            out.append(entry[re.search(r"(?m)^\}\n", entry).end():])
            removed += 1
        else:
            out.append(entry)
    return "".join(out), removed


if __name__ == "__main__":
    path = sys.argv[1]
    text, removed = without_x3(open(path, encoding="utf-8").read())
    open(path, "w", encoding="utf-8").write(text)
