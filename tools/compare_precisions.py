"""Paired check of two parity JSON records (f32 run, TF32 run) on the same cases: the TF32 error of each
case must sit above its f32 error (else the 'TF32' run did not use the tensor cores), and each record
must say the precision it claims. Prints one line per case; exit 1 on any violation.

usage: python tools/compare_precisions.py parity-f32.json parity-tf32.json
"""

import json
import sys


def worst(record: dict) -> float:
    errs = record["errors"].get("fused~oracle", {})
    return max(errs.values()) if errs else float("nan")


def main(f32_path: str, tf32_path: str) -> int:
    f32 = {r["case"]: r for r in json.load(open(f32_path))}
    tf32 = {r["case"]: r for r in json.load(open(tf32_path))}
    bad = 0
    print(f"{'case':<24} {'f32 worst':>10} {'tf32 worst':>10}  ratio")
    for name, r32 in f32.items():
        rt = tf32.get(name)
        if rt is None:
            continue
        a, b = worst(r32), worst(rt)
        ok = r32["precision"] == "f32" and rt["precision"] == "tf32" and b > a
        bad += not ok
        print(f"{name:<24} {a:10.2e} {b:10.2e}  {b / a if a else float('inf'):7.1f}  {'ok' if ok else 'VIOLATION'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
