"""The published benchmark results: every file in bench/results is described in its README, a
head-dim grid measured over several calls (bench.head_dims --append) keeps one file per GPU, and the
tables of them in both READMEs (H200, head dims, recurrent form) and in docs/softmax.md (training and
decode against SDPA) quote those files."""
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def _result(name):
    """A file of bench/results, parsed."""
    return json.loads((RESULTS / name).read_text())


@pytest.mark.parametrize("name", sorted(p.name for p in RESULTS.iterdir() if p.name != "README.md"))
def test_every_results_file_is_described_in_the_results_readme(name):
    assert f"`{name}`" in (RESULTS / "README.md").read_text()


@pytest.fixture
def head_dims(ar):
    sys.path.insert(0, str(ROOT))
    try:
        import bench.head_dims as module
    finally:
        sys.path.remove(str(ROOT))
    return module


def _row(run, K, V, normalize, mode, ms):
    return dict(dtype=run, K=K, V=V, normalize=normalize, mode=mode, attnrnn_ms=ms)


def _file(gpu="GPU-A"):
    rows = [_row(dtype, K, V, n, m, 1.0) for dtype, K, V in [("bf16", 64, 64), ("bf16", 32, 32), ("fp32-high", 64, 64)]
            for n in (False, True) for m in ("fwd", "fwd+bwd")]
    return {"env": {"gpu": gpu, "command": "first", "copy_TBps": 3.0, "partial": True}, "rows": rows}


def test_append_replaces_the_measured_runs_and_keeps_the_others(head_dims):
    new = [_row("bf16", 64, 64, n, m, 2.0) for n in (False, True) for m in ("fwd", "fwd+bwd")]
    env, rows = head_dims.appended(_file(), {"gpu": "GPU-A", "command": "second", "copy_TBps": 2.9}, new)
    runs = [head_dims.row_run_name(r) for r in rows]
    assert sorted(set(runs)) == ["bf16-K32-V32", "bf16-K64-V64", "fp32-high-K64-V64"] and len(rows) == 12
    assert all(r["attnrnn_ms"] == (2.0 if head_dims.row_run_name(r) == "bf16-K64-V64" else 1.0) for r in rows)
    assert env["command"] == ["first", "second"] and env["copy_TBps"] == [3.0, 2.9]
    assert "partial" not in env  # the writer decides from the rows


def test_append_refuses_a_file_from_another_gpu(head_dims):
    with pytest.raises(SystemExit, match="GPU-A"):
        head_dims.appended(_file("GPU-A"), {"gpu": "GPU-B", "command": "x", "copy_TBps": 1.0}, [])


def test_published_head_dims_rows_belong_to_the_grid(head_dims):
    names = set(head_dims.grid_runs()[1])
    published = _result("head_dims_h100.json")
    runs = {head_dims.row_run_name(r) for r in published["rows"]}
    assert runs <= names
    assert published["env"].get("partial", False) == bool(names - runs)


def _md_table(header, doc=ROOT / "README.md"):
    """The rows (lists of cells) of the table in the Markdown file `doc` whose header row starts with
    `header`."""
    lines = doc.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:  # past the header and its rule
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _dims(cell):
    """(K, V) of a README row: "32, H32" or "K 64, V 256, H8"."""
    parts = [p.strip() for p in cell.split(",")]
    if parts[0].startswith("K "):
        return int(parts[0][2:]), int(parts[1][2:])
    return int(parts[0]), int(parts[0])


def _ms(x):
    """A time as the tables print it."""
    return f"{x:.3f}"


@pytest.mark.parametrize(
    "dtype, header",
    [("bf16", "| K = V, H | normalize |"), ("fp32-highest", "| K = V, H | precision |"),
     ("fp32-high", "| K = V, H | precision |")],
    ids=["bf16", "fp32-highest", "fp32-high"])
def test_readme_head_dim_tables_quote_the_published_times(dtype, header):
    """The README's forward+backward tables against fla show head_dims_h100.json's rows, every one:
    bf16 with attnrnn x, % of the memory floor and the mma.sync sweeps' time; fp32 with attnrnn x and
    attnrnn's time over fla's."""
    quoted = {}
    for cells in _md_table(header):
        if dtype.startswith("fp32"):  # a precision column: "highest (3xTF32)", "high (TF32)"
            if cells[1].split()[0] != dtype.split("-")[1]:
                continue
            cells = cells[:1] + cells[2:]
        K, V = _dims(cells[0])
        quoted[(K, V, cells[1] == "yes")] = tuple(c.rstrip("*") for c in cells[2:])
    rows = _result("head_dims_h100.json")["rows"]
    published = {}
    for r in rows:
        if r["dtype"] != dtype or r["mode"] != "fwd+bwd":
            continue
        cells = [_ms(r["attnrnn_ms"]), _ms(r["fla_chunk_ms"]), f"{r['speedup']:.2f}"]
        if dtype == "bf16":
            mma_sync = r.get("attnrnn_mma_sync_ms")
            cells += [f"{r['pct_of_floor']:.0f}", "" if mma_sync is None else _ms(mma_sync)]
        else:
            cells.append(f"{r['attnrnn_ms'] / r['fla_chunk_ms']:.2f}")
        published[(r["K"], r["V"], r["normalize"])] = tuple(cells)
    assert quoted == published


def test_readme_recurrent_table_quotes_the_published_times():
    """The README's recurrent_linear_attn table shows recurrent_h100.json's times, every row."""
    quoted = {}
    for cells in _md_table("| shape | normalize | forward: attnrnn |"):
        B, T, D = cells[0].split("-")
        quoted[(f"{B}-{T}-H16-{D}", cells[1] == "yes")] = tuple(cells[2:8])
    rows = _result("recurrent_h100.json")["rows"]
    by_impl = {(r["shape"], r["normalize"], r["impl"]): r for r in rows}
    published = {}
    for shape, normalize in {(shape, normalize) for shape, normalize, _ in by_impl}:
        ours, fla = by_impl[(shape, normalize, "attnrnn_recurrent")], by_impl[(shape, normalize, "fla_fused_recurrent")]
        published[(shape, normalize)] = tuple(
            _ms(r[key]) for key in ("fwd_ms", "fwdbwd_ms", "fwdbwd_gpu_ms") for r in (ours, fla))
    assert quoted == published


def _h200_training_rows():
    """h200.json's training shapes: {(shape, normalize, mode, impl): row}."""
    rows = _result("h200.json")["rows"]
    return {(r["shape"], r["normalize"], r["mode"], r["impl"]): r for r in rows if r["suite"] == "train"}


def test_readme_h200_table_quotes_the_published_times():
    """The README's forward+backward table on the H200 shows h200.json's times: attnrnn, fla's faster
    form and plain PyTorch unnormalized, attnrnn and fla normalized (SDPA comes from another process)."""
    quoted = {}
    for cells in _md_table("| B, T, H, D | attnrnn |"):
        B, T, H, D = (c.strip() for c in cells[0].split(","))
        quoted[f"B{B}-T{T}-H{H}-D{D}"] = tuple(cells[1:6])
    train = _h200_training_rows()
    published = {}
    for shape in {key[0] for key in train}:
        plain, norm = train[(shape, False, "fwd+bwd", "attnrnn")], train[(shape, True, "fwd+bwd", "attnrnn")]
        torch_chunk = train[(shape, False, "fwd+bwd", "torch_chunk")]
        published[shape] = tuple(
            _ms(x) for x in (plain["ms"], plain["fla_best_ms"], torch_chunk["ms"], norm["ms"], norm["fla_best_ms"]))
    assert quoted == published


def test_results_readme_h200_table_quotes_the_published_times():
    """bench/results/README.md's H200 table shows h200.json's times: forward and forward+backward of
    attnrnn, fla's faster form and plain PyTorch, in both normalize modes."""
    quoted = {}
    for cells in _md_table("| shape | normalize | forward: attnrnn |", RESULTS / "README.md"):
        quoted[(cells[0], cells[1] == "yes")] = tuple(cells[2:8])
    train = _h200_training_rows()
    published = {}
    for shape, normalize in {(key[0], key[1]) for key in train}:
        cells = []
        for mode in ("fwd", "fwd+bwd"):
            ours = train[(shape, normalize, mode, "attnrnn")]
            cells += [ours["ms"], ours["fla_best_ms"], train[(shape, normalize, mode, "torch_chunk")]["ms"]]
        published[(shape, normalize)] = tuple(_ms(x) for x in cells)
    assert quoted == published


def test_softmax_doc_training_table_quotes_the_published_times():
    """docs/softmax.md's causal training table shows softmax_h100.json's rows: times, ratios and
    TFLOP/s of ours and SDPA's, forward and forward+backward."""
    quoted = {}
    for cells in _md_table("| train, causal: B, T, H, D |", ROOT / "docs" / "softmax.md"):
        quoted[tuple(int(c) for c in cells[0].split(","))] = tuple(cells[1:])
    published = {}
    for r in _result("softmax_h100.json")["train"]:
        published[(r["B"], r["T"], r["H"], r["D"])] = (
            _ms(r["ours_fwd_ms"]), _ms(r["sdpa_fwd_ms"]), f"{r['fwd_ratio']:.2f}",
            f"{r['ours_fwd_bwd_ms']:.2f}", f"{r['sdpa_fwd_bwd_ms']:.2f}", f"{r['fwd_bwd_ratio']:.2f}",
            f"{r['ours_fwd_tflops']:.0f} / {r['ours_fwd_bwd_tflops']:.0f}",
            f"{r['sdpa_fwd_tflops']:.0f} / {r['sdpa_fwd_bwd_tflops']:.0f}")
    assert quoted == published


def test_softmax_doc_decode_table_quotes_the_published_times():
    """docs/softmax.md's decode table shows softmax_h100.json's decode rows in microseconds: ours, ours
    with k_new appended, SDPA, the ratio and both shares of the read floor."""
    quoted = {}
    for cells in _md_table("| decode, H = Hkv = 32, D = 128: B, L |", ROOT / "docs" / "softmax.md"):
        quoted[tuple(int(c) for c in cells[0].split(","))] = tuple(cells[1:])
    result = _result("softmax_h100.json")
    published = {}
    for r in result["decode"] + [result["long_decode"]]:
        published[(r["B"], r["L"])] = (
            f"{r['ours_ms'] * 1e3:.0f}", f"{r['ours_append_ms'] * 1e3:.0f}", f"{r['sdpa_ms'] * 1e3:.0f}",
            f"{r['ratio']:.2f}", f"{r['ours_pct_floor']:.1f} / {r['sdpa_pct_floor']:.1f}")
    assert quoted == published
