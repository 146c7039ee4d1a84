"""Kernels whose SASS alternates global loads and stores one by one (LDG, STG, LDG, STG, ...): where
a load follows each store in program order, the compiler keeps it there (the store may alias it),
and every pair costs a memory latency. The φ' epilogue of the backward's sweeps did this (H200, B1-T65536
with relu: dq 338 -> 1093 us), found by reading the SASS.

    cuobjdump -sass build/.../chunk_bwd_bf16.cubin > bwd.sass     (or a .so / .cubin straight away)
    python3 scripts/sass_ld_st.py bwd.sass [--min 4]
    python3 scripts/sass_ld_st.py X.cubin --cuobjdump /path/to/cuobjdump

cuobjdump comes with the CUDA toolkit, or from the `nvidia-cuda-cuobjdump` wheel (bin/cuobjdump).
Prints, per kernel with any, the lengths of its alternating runs (in load-store pairs); exits 1 if
there is one.
"""
import argparse
import re
import subprocess
import sys


def runs_by_kernel(sass_text, min_pairs):
    ops, kernel = {}, None
    for line in sass_text.splitlines():
        if "Function :" in line:
            kernel = line.split(":", 1)[1].strip()
            ops[kernel] = []
            continue
        m = re.search(r"\b(LDG|STG)\.", line)
        if m and kernel is not None:
            ops[kernel].append("L" if m.group(1) == "LDG" else "S")
    pattern = re.compile(r"(?:LS){%d,}" % min_pairs)
    found = {}
    for kernel, seq in ops.items():
        runs = [len(r) // 2 for r in pattern.findall("".join(seq))]
        if runs:
            found[kernel] = runs
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="cuobjdump -sass output, or a .cubin / .so to disassemble")
    parser.add_argument("--min", type=int, default=4, help="shortest run reported, in load-store pairs")
    parser.add_argument("--cuobjdump", default="cuobjdump")
    args = parser.parse_args()
    if args.path.endswith((".cubin", ".so", ".o")):
        text = subprocess.run([args.cuobjdump, "-sass", args.path], check=True, capture_output=True, text=True).stdout
    else:
        with open(args.path) as f:
            text = f.read()
    found = runs_by_kernel(text, args.min)
    for kernel, runs in found.items():
        print(f"{kernel}: alternating LDG/STG runs of {runs} pairs")
    print(f"{len(found)} kernel(s) with alternating runs of >= {args.min} load-store pairs")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
