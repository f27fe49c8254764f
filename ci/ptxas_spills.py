"""The register kernels' spills against their recorded baseline, from ptxas -v logs of the sm_90a release compile.

usage: python ci/ptxas_spills.py [--write] LOG...

Reads the resource reports ci/cuda-compile.sh keeps (-Xptxas -v) and, per kernel of the training ops' register
family (fa_train_fwd_reg, fa_train_bwd_reg, fa_train_di_reg: one per configuration and template flags), compares
its spill stores (bytes) with ci/ptxas-spills.json. Exits 1 when a TF32 kernel (template argument X3 = false)
spills more than its baseline, or is new and spills more than NEW_BUDGET bytes. --write records the logs' values
as the new baseline (after a change whose cost was measured on the device: notes/kernels.md says which).

Why a gate: the forward and dQ blocks share one register allocation with every path compiled into them (K/V
dequantization, masks), so a change to one path can make the f32 path spill; that cost 11-45% of its time and
showed in no test (notes/kernels.md v12). The compensated (x3) kernels spill by design: listed, not gated.
"""
import json
import pathlib
import re
import sys

BASELINE = pathlib.Path(__file__).with_name("ptxas-spills.json")
NEW_BUDGET = 16  # bytes a TF32 kernel without a baseline may spill

# ptxas -v: "Function properties for NAME" then "N bytes stack frame, S bytes spill stores, ..." then "Used R registers"
PROPS = re.compile(r"Function properties for (\S+)\n[^\n]*?(\d+) bytes spill stores[^\n]*\n[^\n]*?Used (\d+) registers")
# _Z16fa_train_fwd_regI8fa_tilesILi256ELi256E...EELb0E...: the configuration, then the bool template arguments
# (X3 first; the backward's WANT_DK, WANT_DV after it; the forward's and backward's Q8 last)
KERNEL = re.compile(r"fa_train_(fwd|bwd|di)_regI8fa_tilesI((?:Li\d+E)+)E((?:Lb[01]E)+)")


def kernels(text):
    """Yield (key, x3, spill_bytes, registers) per register-family kernel of a ptxas -v log; key names the
    kind, the configuration (fa_tiles' arguments) and the bool flags, e.g. 'fwd 128x128x4x1x32x32x1x3 b0'."""
    for m in PROPS.finditer(text):
        k = KERNEL.search(m.group(1))
        if k:
            config = "x".join(re.findall(r"Li(\d+)E", k.group(2)))
            flags = "".join(re.findall(r"Lb([01])E", k.group(3)))
            yield f"{k.group(1)} {config} b{flags}", flags[0] == "1", int(m.group(2)), int(m.group(3))


def main(argv):
    write = "--write" in argv
    paths = [a for a in argv if a != "--write"]
    found = {}
    for path in paths:
        text = pathlib.Path(path).read_text(encoding="utf-8", errors="replace")
        for key, x3, spill, regs in kernels(text):
            found[key] = (x3, spill, regs)
    if not found:
        print("ptxas: no register-family kernel in the logs (was -Xptxas -v passed?)")
        return 1
    if write:
        BASELINE.write_text(json.dumps({k: v[1] for k, v in sorted(found.items())}, indent=1) + "\n")
        print(f"ptxas: baseline of {len(found)} kernels written to {BASELINE}")
        return 0
    base = json.loads(BASELINE.read_text())
    over = []
    for key, (x3, spill, regs) in sorted(found.items()):
        allowed = base.get(key, NEW_BUDGET)
        if spill:
            print(f"ptxas: {key} {'x3' if x3 else 'tf32'}: {spill} spill bytes (baseline {base.get(key, 'none')}), {regs} registers")
        if not x3 and spill > allowed:
            over.append(f"{key}: {spill} spill bytes > {allowed} ({regs} registers)")
    for line in over:
        print(f"ptxas: FAIL: a TF32 kernel spills more than its baseline (ci/ptxas-spills.json): {line}")
    print(f"ptxas: {len(found)} register-family kernels, {len(over)} TF32 over their spill baseline")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
