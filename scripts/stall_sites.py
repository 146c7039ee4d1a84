"""Where a kernel's warps wait, from ncu's per-instruction warp-stall samples (the CSV of
`ncu -i REPORT --page source --csv --print-source sass`): the instructions with the most samples,
and the samples summed per opcode (BAR.SYNC: the block's barriers, DEPBAR: cp.async waits,
WARPGROUP.DEPBAR: wgmma waits, HGMMA: product issue, ...).

    python3 scripts/stall_sites.py SASS_CSV [TOP]
"""
import collections
import csv
import io
import sys


def read_rows(path):
    """The CSV's rows as dicts, from its header line (the one naming the Source column) on."""
    lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    start = next((i for i, line in enumerate(lines) if '"Source"' in line or line.startswith("Source,")), None)
    if start is None:
        sys.exit(f"{path}: no header line naming a Source column; first lines: {lines[:3]}")
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def column(rows, *words):
    """The first column whose name holds every word."""
    for name in rows[0].keys():
        if name and all(w in name for w in words):
            return name
    sys.exit(f"no column with {words}; columns: {list(rows[0].keys())}")


def number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def opcode(sass):
    """The instruction's opcode without its predicate and modifiers after the first two parts."""
    parts = sass.strip().split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    if not parts:
        return "?"
    name = parts[0].rstrip(";")
    keep = 2 if name.startswith(("WARPGROUP", "BAR")) else 1
    return ".".join(name.split(".")[:keep])


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    rows = read_rows(path)
    src = column(rows, "Source")
    allc = column(rows, "Warp Stall Sampling", "All")
    addr = next((n for n in rows[0] if n and "Address" in n), None)
    executed = next((n for n in rows[0] if n and n.startswith("Instructions Executed")), None)
    total = sum(number(r[allc]) for r in rows) or 1.0
    inst_total = sum(number(r[executed]) for r in rows) if executed else 0
    print(f"{path}: {len(rows)} instructions, {total:.0f} stall samples"
          + (f", {inst_total:.0f} warp instructions executed" if executed else ""))
    by_op = collections.Counter()
    for r in rows:
        by_op[opcode(r[src])] += number(r[allc])
    print("samples by opcode: " + ", ".join(f"{op} {100 * n / total:.1f}%" for op, n in by_op.most_common(12)))
    reasons = [n for n in rows[0] if n and n.startswith("stall_") and "Not Issued" not in n]
    if reasons:
        by_reason = collections.Counter({n[6:]: sum(number(r[n]) for r in rows) for n in reasons})
        print("samples by reason: " + ", ".join(f"{k} {100 * n / total:.1f}%" for k, n in by_reason.most_common(10) if n))
    ranked = sorted(rows, key=lambda r: -number(r[allc]))[:top]
    cumulative = 0.0
    for r in ranked:
        share = 100 * number(r[allc]) / total
        cumulative += share
        where = r[addr] if addr else ""
        why = max(reasons, key=lambda n: number(r[n]))[6:] if reasons else ""
        print(f"  {where:>8} {share:5.1f}% (cum {cumulative:5.1f}%)  {why:>12}  {r[src].strip()[:80]}")


if __name__ == "__main__":
    main()
