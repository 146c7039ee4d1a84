"""What is derived from measured rows: ratios to the baselines, the targets, the tables.

Everything here is a pure function of the rows that `python -m bench` writes (so `--merge` can
recompute it from several runs' JSON), and every verdict is computed from the measured medians.
"""

FLA_TRAIN = ("fla_chunk", "fla_fused_chunk")
MIB = 1 << 20

# The targets (H200, bf16, medians, baselines measured in the same run).
FWD_PLAIN_VS_FLA_BEST = 1.5    # forward, normalize=False, vs the faster of fla chunk / fused_chunk
FWD_NORM_VS_FLA_CHUNK = 4.0    # forward, normalize=True, vs fla chunk normalize=True
FWDBWD_VS_FLA_CHUNK = 3.0      # forward+backward vs fla chunk, each normalize mode
DECODE_PCT_OF_FLOOR = 80.0     # decode step at B*H = 8192, D = 128
DECODE_BH_FOR_FLOOR = 8192
DECODE_VS_FLA_SHAPE = "B64-H32-D128"  # decode step vs fla fused_recurrent
DECODE_VS_FLA = 2.0
MEMORY_SHAPE = "B1-T65536-H16-D128"   # peak of forward+backward <= (inputs + outputs + gradients) * 1.10
MEMORY_DTYPE = "bfloat16"
MEMORY_SLACK = 1.10


def parse_tag(tag):
    """"B8-T2048-H16-D64" -> {"B": 8, "T": 2048, "H": 16, "D": 64}."""
    return {part[0]: int(part[1:]) for part in tag.split("-")}


def io_bytes_fwdbwd(tag, elem_bytes):
    """Inputs + outputs + gradients of one forward+backward: q, k, v and the incoming gradient do
    (inputs), o (output), dq, dk, dv (gradients): 8 tensors of B*T*H*D elements."""
    s = parse_tag(tag)
    return 8 * s["B"] * s["T"] * s["H"] * s["D"] * elem_bytes


def _ms(rows):
    """(suite, shape, normalize, mode, impl) -> median ms, for rows that have one."""
    return {(r["suite"], r["shape"], r["normalize"], r["mode"], r["impl"]): r["ms"]
            for r in rows if r.get("ms") is not None}


def add_ratios(rows):
    """attnrnn_speedup on every row (that row's time / attnrnn's on the same suite, shape, normalize
    and mode); on attnrnn rows also the faster fla variant and the speed-up over it and over fla chunk."""
    ms = _ms(rows)
    for r in rows:
        key = (r["suite"], r["shape"], r["normalize"], r["mode"])
        mine = ms.get(key + ("attnrnn",))
        r["attnrnn_speedup"] = None if mine is None or r.get("ms") is None else r["ms"] / mine
        if r["impl"] != "attnrnn":
            continue
        fla_impls = FLA_TRAIN if r["suite"] == "train" else ("fla_fused_recurrent",)
        fla = {impl: ms[key + (impl,)] for impl in fla_impls if key + (impl,) in ms}
        best = min(fla, key=fla.get) if fla else None
        r["fla_best_impl"] = best
        r["fla_best_ms"] = fla[best] if best else None
        r["speedup_vs_fla_best"] = None if best is None or mine is None else fla[best] / mine
        chunk = fla.get("fla_chunk")
        r["speedup_vs_fla_chunk"] = None if chunk is None or mine is None else chunk / mine
    return rows


def _verdict(measured, required, at_least=True):
    if measured is None:
        return None
    return bool(measured >= required) if at_least else bool(measured <= required)


def targets(rows, dtype):
    """The targets as a list of checks: measured value, required value, passed (None when
    a number it needs was not measured, e.g. no fla in this run)."""
    ms = _ms(rows)
    out = []
    train_shapes = list(dict.fromkeys(r["shape"] for r in rows if r["suite"] == "train"))
    decode_shapes = list(dict.fromkeys(r["shape"] for r in rows if r["suite"] == "decode"))

    def speedup(base, ours):
        return None if base is None or ours is None else base / ours

    for shape in train_shapes:
        ours = ms.get(("train", shape, False, "fwd", "attnrnn"))
        fla = {i: ms[("train", shape, False, "fwd", i)] for i in FLA_TRAIN if ("train", shape, False, "fwd", i) in ms}
        best = min(fla, key=fla.get) if fla else None
        m = speedup(fla.get(best), ours)
        out.append(dict(target="fwd normalize=False: speed-up over the faster fla (chunk, fused_chunk)",
                        suite="train", shape=shape, normalize=False, mode="fwd", baseline=best,
                        required=FWD_PLAIN_VS_FLA_BEST, measured=m, unit="x",
                        passed=_verdict(m, FWD_PLAIN_VS_FLA_BEST)))
    for shape in train_shapes:
        m = speedup(ms.get(("train", shape, True, "fwd", "fla_chunk")), ms.get(("train", shape, True, "fwd", "attnrnn")))
        out.append(dict(target="fwd normalize=True: speed-up over fla chunk normalize=True",
                        suite="train", shape=shape, normalize=True, mode="fwd", baseline="fla_chunk",
                        required=FWD_NORM_VS_FLA_CHUNK, measured=m, unit="x",
                        passed=_verdict(m, FWD_NORM_VS_FLA_CHUNK)))
    for shape in train_shapes:
        for normalize in (False, True):
            m = speedup(ms.get(("train", shape, normalize, "fwd+bwd", "fla_chunk")),
                        ms.get(("train", shape, normalize, "fwd+bwd", "attnrnn")))
            out.append(dict(target=f"fwd+bwd normalize={normalize}: speed-up over fla chunk (same mode)",
                            suite="train", shape=shape, normalize=normalize, mode="fwd+bwd", baseline="fla_chunk",
                            required=FWDBWD_VS_FLA_CHUNK, measured=m, unit="x",
                            passed=_verdict(m, FWDBWD_VS_FLA_CHUNK)))
    for shape in decode_shapes:
        s = parse_tag(shape)
        if s["B"] * s["H"] == DECODE_BH_FOR_FLOOR and s["D"] == 128:
            row = next((r for r in rows if r["suite"] == "decode" and r["shape"] == shape and r["impl"] == "attnrnn"), {})
            m = row.get("pct_of_floor")
            out.append(dict(target="decode step: % of the memory floor (fp32 state read + written once)",
                            suite="decode", shape=shape, normalize=False, mode="step", baseline="floor",
                            required=DECODE_PCT_OF_FLOOR, measured=m, unit="%",
                            passed=_verdict(m, DECODE_PCT_OF_FLOOR)))
    if DECODE_VS_FLA_SHAPE in decode_shapes:
        m = speedup(ms.get(("decode", DECODE_VS_FLA_SHAPE, False, "step", "fla_fused_recurrent")),
                    ms.get(("decode", DECODE_VS_FLA_SHAPE, False, "step", "attnrnn")))
        out.append(dict(target="decode step: speed-up over fla fused_recurrent",
                        suite="decode", shape=DECODE_VS_FLA_SHAPE, normalize=False, mode="step",
                        baseline="fla_fused_recurrent", required=DECODE_VS_FLA, measured=m, unit="x",
                        passed=_verdict(m, DECODE_VS_FLA)))
    out += memory_rule(rows, dtype)
    return out


def memory_rule(rows, dtype):
    """The dedicated rows of the memory target: attnrnn's forward+backward at MEMORY_SHAPE in bf16,
    peak <= (inputs + outputs + gradients) * 1.10, one per normalize mode measured."""
    out = []
    if dtype != MEMORY_DTYPE:
        return out
    for r in rows:
        if (r["suite"], r["shape"], r["mode"], r["impl"]) != ("train", MEMORY_SHAPE, "fwd+bwd", "attnrnn"):
            continue
        m = r.get("peak_ratio")
        out.append(dict(target="peak memory of fwd+bwd / (inputs + outputs + gradients)",
                        suite="memory", shape=MEMORY_SHAPE, normalize=r["normalize"], mode="fwd+bwd",
                        baseline="inputs+outputs+gradients", required=MEMORY_SLACK, measured=m, unit="ratio",
                        passed=_verdict(m, MEMORY_SLACK, at_least=False), dtype=dtype,
                        peak_mib=r.get("peak_mib"), io_mib=r.get("io_mib"),
                        limit_mib=None if r.get("io_mib") is None else r["io_mib"] * MEMORY_SLACK))
    return out


def summary(checks):
    passed = sum(c["passed"] is True for c in checks)
    failed = sum(c["passed"] is False for c in checks)
    missing = sum(c["passed"] is None for c in checks)
    return {"passed": passed, "failed": failed, "not_measured": missing,
            "all_passed": None if missing or not checks else failed == 0}


def _f(x, fmt):
    return "" if x is None else format(x, fmt)


def print_rows(rows, file=None):
    print(f"{'suite':7s} {'shape':20s} {'norm':5s} {'mode':8s} {'impl':20s} {'ms':>10s} {'attnrnn x':>10s}"
          f" {'vs fla*':>8s} {'% floor':>8s} {'peak MiB':>9s} {'peak/io':>8s}", file=file)
    for r in rows:
        ms = "ERROR" if r.get("ms") is None else f"{r['ms']:.3f}"
        print(f"{r['suite']:7s} {r['shape']:20s} {str(r['normalize']):5s} {r['mode']:8s} {r['impl']:20s} "
              f"{ms:>10s} {_f(r.get('attnrnn_speedup'), '.2f'):>10s} {_f(r.get('speedup_vs_fla_best'), '.2f'):>8s} "
              f"{_f(r.get('pct_of_floor'), '.1f'):>8s} {_f(r.get('peak_mib'), '.0f'):>9s} "
              f"{_f(r.get('peak_ratio'), '.3f'):>8s}", file=file)
        if r.get("error"):
            print(f"        error: {r['error']}", file=file)
    print("attnrnn x = this row's time / attnrnn's; vs fla* = the faster fla variant's time / attnrnn's "
          "(attnrnn rows); peak/io = peak CUDA memory of one fwd+bwd / (inputs + outputs + gradients)", file=file)


def print_targets(checks, file=None):
    if not checks:
        return
    print(f"\n{'target':72s} {'shape':20s} {'norm':5s} {'required':>9s} {'measured':>9s}  verdict", file=file)
    for c in checks:
        op = "<=" if c["unit"] == "ratio" else ">="
        unit = {"x": "x", "%": "%", "ratio": ""}[c["unit"]]
        req = f"{op}{c['required']:g}{unit}"
        meas = "-" if c["measured"] is None else f"{c['measured']:.2f}{unit}"
        verdict = {True: "PASS", False: "FAIL", None: "not measured"}[c["passed"]]
        print(f"{c['target']:72s} {c['shape']:20s} {str(c['normalize']):5s} {req:>9s} {meas:>9s}  {verdict}", file=file)
    for c in checks:
        if c["suite"] == "memory":
            verdict = {True: "PASS", False: "FAIL", None: "not measured"}[c["passed"]]
            if c["measured"] is None:
                print(f"MEMORY RULE {c['shape']} {c['dtype']} normalize={c['normalize']}: not measured", file=file)
            else:
                print(f"MEMORY RULE {c['shape']} {c['dtype']} normalize={c['normalize']}: peak {c['peak_mib']:.0f} MiB"
                      f" vs inputs+outputs+gradients {c['io_mib']:.0f} MiB (+10% = {c['limit_mib']:.0f} MiB):"
                      f" {c['measured']:.3f}x -> {verdict}", file=file)
    s = summary(checks)
    print(f"targets: {s['passed']} passed, {s['failed']} failed, {s['not_measured']} not measured", file=file)
