"""The power-of-two experiment (attnrnn.experiments.power_of_two): its data, its decoding, its
memory count, and a tiny grid through the command line to the JSON and the plot (CPU, seconds)."""
import json
import random

import pytest
import torch


def _load(name):
    """attnrnn.experiments.<name>; fails (never skips) when the compiled package is missing."""
    import importlib
    try:
        return importlib.import_module(f"attnrnn.experiments.{name}")
    except ImportError as e:
        pytest.fail(f"attnrnn (compiled extension) cannot be imported: {e!r}")


def _module_fixture(fixture_name, module):
    return pytest.fixture(scope="module", name=fixture_name)(lambda: _load(module))


exp = _module_fixture("exp", "power_of_two")
data = _module_fixture("data", "power_of_two_data")
model_mod = _module_fixture("model_mod", "power_of_two_model")
report = _module_fixture("report", "power_of_two_report")


def doubled_digits(x):
    """2^x as decimal digits, least significant first, by x schoolbook doublings (no big ints)."""
    digits = [1]
    for _ in range(x):
        carry = 0
        for i, d in enumerate(digits):
            carry, digits[i] = divmod(2 * d + carry, 10)
        if carry:
            digits.append(carry)
    return "".join(map(str, digits))


@pytest.mark.parametrize("x", [1, 13, 50, 1000], ids=lambda x: f"x{x}")
def test_answer_is_two_to_the_x(data, x):
    fmt = data.PowerFormat(1000, cot=False)
    answer = fmt.answer(x)
    assert len(answer) == len(str(2 ** 1000))
    assert answer.rstrip("0") == doubled_digits(x).rstrip("0")
    assert int(answer[::-1]) == pow(2, x)


@pytest.mark.parametrize("x", [1, 9, 50], ids=lambda x: f"x{x}")
def test_chain_parses_back_to_the_countdown_and_the_powers(data, x):
    fmt = data.PowerFormat(64, cot=True)
    assert data.parse_chain(fmt.sequence(x)) == [(x - k, pow(2, k)) for k in range(x + 1)]


def test_chain_puts_each_digit_a_fixed_distance_after_its_predecessor(data):
    fmt = data.PowerFormat(100, cot=True)
    rng = random.Random()
    x = rng.randint(30, 100)
    seq = fmt.sequence(x)
    frame = fmt.x_width + fmt.power_width + 2
    power_at = lambda k: fmt.x_width + 1 + k * frame  # noqa: E731  (where 2^k starts)
    for _ in range(50):
        k, i = rng.randint(1, x), rng.randrange(fmt.power_width)
        assert seq[power_at(k) + i] == data.digits_lsb_first(2 ** k, fmt.power_width)[i]
        assert seq[power_at(k - 1) + i] == data.digits_lsb_first(2 ** (k - 1), fmt.power_width)[i]
        label = seq[power_at(k) - 1 - fmt.x_width:power_at(k) - 1]
        assert int(label) == x - k and int(seq[power_at(k - 1) - 1 - fmt.x_width:power_at(k - 1) - 1]) == x - k + 1
    assert seq[power_at(x) - 1] == "=" and seq.count("=") == 1


@pytest.mark.parametrize("x", [1, 7, 30], ids=lambda x: f"x{x}")
def test_answer_field_is_the_same_with_and_without_chain(data, x):
    plain, cot = data.PowerFormat(30, cot=False), data.PowerFormat(30, cot=True)
    width = plain.power_width
    assert data.parse_answer(plain.target(x), width) == data.parse_answer(cot.target(x), width) == plain.answer(x)
    assert plain.target(x).endswith(plain.answer(x) + ".") and cot.target(x).endswith(plain.answer(x) + ".")


def test_tokenizer_round_trips(data):
    rng = random.Random()
    texts = ["".join(rng.choice(data.ALPHABET) for _ in range(rng.randint(1, 80))) for _ in range(20)]
    texts.append(data.PowerFormat(40, cot=True).sequence(rng.randint(1, 40)))
    for text in texts:
        ids = data.encode(text)
        assert all(0 <= i < data.VOCAB_SIZE for i in ids) and data.decode(ids) == text


def test_tokenizer_rejects_unknown_characters(data):
    with pytest.raises(ValueError, match="only the characters"):
        data.encode("12a")
    with pytest.raises(ValueError, match="ids must lie"):
        data.decode([data.VOCAB_SIZE])


@pytest.mark.parametrize("seed", range(5), ids=lambda s: f"split{s}")
def test_held_out_exponents_are_inside_the_range_and_disjoint(data, seed):
    rng = random.Random(seed)
    x_min = rng.randint(1, 20)
    x_max = x_min + rng.randint(22, 80)
    fraction = rng.uniform(0.05, 0.5)
    train, held_out = data.split_exponents(x_min, x_max, fraction, seed=rng.randrange(1000))
    block = round(1 / fraction)
    assert len(held_out) == (x_max - x_min - 1) // block
    assert all(x_min < x < x_max for x in held_out)
    assert not set(train) & set(held_out)
    assert sorted(train + held_out) == list(range(x_min, x_max + 1))
    assert x_min in train and x_max in train


def test_batch_targets_cover_only_what_the_model_writes(data):
    fmt = data.PowerFormat(20, cot=True)
    xs = [3, 17, 1]
    inputs, targets = data.batch(fmt, xs)
    prompt = len(fmt.prompt(1))
    for row, x in enumerate(xs):
        seq = data.encode(fmt.sequence(x))
        n = len(seq) - 1
        assert inputs[row, :n].tolist() == seq[:-1]
        assert (targets[row, :prompt - 1] == data.IGNORE).all() and (targets[row, n:] == data.IGNORE).all()
        assert targets[row, prompt - 1:n].tolist() == seq[prompt:]
        assert (inputs[row, n:] == data.PAD).all()


def test_score_counts_significant_digits_and_requires_the_whole_field(data, model_mod):
    fmt = data.PowerFormat(20, cot=False)
    x = random.Random().randint(10, 16)      # 2^x has fewer digits than the field (7): padding exists
    right = fmt.target(x)
    significant = len(str(2 ** x))
    wrong_digit = right[:3] + str((int(right[3]) + 1) % 10) + right[4:]   # digit 2 of the answer
    wrong_padding = right[:-2] + "1."                                      # the last (padding) digit
    assert model_mod.score(fmt, x, right) == {"x": x, "exact": True, "digit_accuracy": 1.0}
    assert model_mod.score(fmt, x, wrong_digit)["digit_accuracy"] == pytest.approx((significant - 1) / significant)
    assert model_mod.score(fmt, x, wrong_padding) == {"x": x, "exact": False, "digit_accuracy": 1.0}
    assert model_mod.score(fmt, x, "7777") == {"x": x, "exact": False, "digit_accuracy": 0.0}


def test_first_error_tells_a_wrong_doubling_from_a_wrong_count(data, model_mod):
    fmt = data.PowerFormat(40, cot=True)
    rng = random.Random()
    x = rng.randint(2, 40)
    target, roles = fmt.target(x), fmt.roles(x)
    assert len(roles) == len(target) and set(roles) == {"p", "l", "s"}

    def changed(role):
        at = rng.choice([i for i, r in enumerate(roles) if r == role])
        return target[:at] + ("x" if role == "s" else str((int(target[at]) + 1) % 10)) + target[at + 1:]

    assert model_mod.first_error(fmt, x, target) is None
    assert model_mod.first_error(fmt, x, changed("p")) == "power"
    assert model_mod.first_error(fmt, x, changed("l")) == "label"
    assert model_mod.first_error(fmt, x, changed("s")) == "separator"
    assert model_mod.first_error(fmt, x, target[:rng.randrange(len(target))]) == "end"


@pytest.mark.parametrize("architecture", ["softmax", "linear", "hybrid"])
def test_cached_greedy_decoding_matches_full_forwards(exp, data, model_mod, architecture):
    config = exp.ExperimentConfig(x_max=6, head_dim=8)
    fmt = data.PowerFormat(6, cot=True)
    torch.manual_seed(random.randrange(2 ** 31))
    model = exp.build_model(config, architecture, 16, 2, max_len=len(fmt.sequence(6)) + 1)
    with torch.no_grad():
        model.position_gain.fill_(1.0)  # positions as strong as the tokens: a wrong offset would show
    xs = [2, 6]
    got = model_mod.generate_targets(model, fmt, xs, "cpu")
    for x, text in zip(xs, got):
        ids = torch.tensor([data.encode(fmt.prompt(x))])
        for _ in range(len(text)):
            with torch.no_grad():
                ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
        full = data.decode(ids[0, len(fmt.prompt(x)):].tolist())
        assert text == (full[:full.index(".") + 1] if "." in full else full)


def test_state_numbers_count_linear_states_and_softmax_streams(exp, model_mod):
    config = exp.ExperimentConfig(head_dim=8)
    hidden, layers = 32, 4
    heads = hidden // 8
    linear_layer = heads * 8 * 8 + heads * 8          # S [H, K, V] and z [H, K]
    expected = {"linear": layers * linear_layer, "softmax": 0}
    for architecture, want in (("linear", expected),
                               ("softmax", {"linear": 0, "softmax": layers * 2 * hidden}),
                               ("hybrid", {"linear": 2 * linear_layer, "softmax": 2 * 2 * hidden})):
        model = exp.build_model(config, architecture, hidden, layers, max_len=8)
        got = model_mod.state_numbers(model.lm)
        assert got == {**want, "total": want["linear"] + want["softmax"]}


def test_same_seed_reproduces_a_cell_and_another_seed_does_not(exp):
    config = exp.ExperimentConfig(architectures=("linear",), sizes=((16, 1),), x_max=6, steps=4, seconds=None,
                                  batch_size=4, seeds=(0,), head_dim=8)
    seed = random.randrange(1000)
    a, b = (exp.run_cell(config, "linear", (16, 1), True, seed) for _ in range(2))
    c = exp.run_cell(config, "linear", (16, 1), True, seed + 1)
    assert a["training"]["final_loss"] == b["training"]["final_loss"] and a["per_x"] == b["per_x"]
    assert c["training"]["final_loss"] != a["training"]["final_loss"]


@pytest.mark.parametrize("argv, name", [
    (["--sizes", "64"], "--sizes"),
    (["--sizes", "0x2"], "hidden_size"),
    (["--x-max", "1"], "x_max"),
    (["--steps", "0"], "steps"),
    (["--arch", "rnn"], "--arch"),
    (["--arch", "hybrid", "--sizes", "32x1"], "hybrid"),
    (["--held-out-fraction", "1.5"], "held_out_fraction"),
    (["--seconds", "-1"], "seconds"),
], ids=["size-format", "size-zero", "x-max", "steps", "arch", "hybrid-one-layer", "held-out", "seconds"])
def test_cli_rejects_bad_values_naming_the_argument(exp, capsys, argv, name):
    with pytest.raises(SystemExit):
        exp.parse_args(argv + ["--device", "cpu"])
    assert name in capsys.readouterr().err


def test_quick_flags_are_overridden_by_explicit_ones(exp):
    config, _ = exp.parse_args(["--quick", "--steps", "7", "--cot", "on"])
    assert config.steps == 7 and config.cot == (True,)
    assert config.sizes == exp.QUICK["sizes"] and config.device == "cpu"
    hidden_layers = [h * n for h, n in config.sizes]
    assert max(hidden_layers) >= 8 * min(hidden_layers)


@pytest.fixture(scope="module")
def tiny_run(exp, tmp_path_factory):
    out = tmp_path_factory.mktemp("power_of_two")
    result = exp.main(["--quick", "--sizes", "8x1", "16x2", "--x-max", "7", "--steps", "3", "--head-dim", "8",
                       "--batch-size", "4", "--seeds", "0", "1", "--out", str(out)])
    return result, out


def test_tiny_grid_has_a_cell_per_combination(tiny_run):
    result, _ = tiny_run
    got = sorted((c["architecture"], c["hidden_size"], c["num_layers"], c["cot"], c["seed"]) for c in result["cells"])
    want = sorted((a, h, n, cot, s) for a in ("softmax", "linear") for h, n in ((8, 1), (16, 2))
                  for cot in (False, True) for s in (0, 1))
    assert got == want


def test_json_follows_the_schema(exp, tiny_run):
    _, out = tiny_run
    result = json.loads((out / "power_of_two.json").read_text())
    assert result["schema"] == exp.SCHEMA
    assert {"config", "environment", "format", "split", "cells", "wall_seconds"} <= result.keys()
    assert isinstance(result["format"]["power_width"], int) and isinstance(result["wall_seconds"], float)
    xs = list(range(result["config"]["x_min"], result["config"]["x_max"] + 1))
    for cell in result["cells"]:
        assert isinstance(cell["parameters"], int) and cell["parameters"] > 0
        assert cell["state_numbers"]["total"] == cell["state_numbers"]["linear"] + cell["state_numbers"]["softmax"] > 0
        assert cell["training"]["steps"] == 3 and cell["training"]["stopped_by"] in ("steps", "seconds")
        assert [r["x"] for r in cell["per_x"]] == xs
        for r in cell["per_x"]:
            assert r["split"] == ("held_out" if r["x"] in result["split"]["held_out"] else "train")
            assert isinstance(r["exact"], bool) and 0.0 <= r["digit_accuracy"] <= 1.0
            assert r["answer_digits"] == len(str(2 ** r["x"])) and isinstance(r["generated_tokens"], int)
            assert ("chain_exact" in r) == cell["cot"]
        for split in ("train", "held_out"):
            s = cell["summary"][split]
            assert 0.0 <= s["exact"] <= 1.0 and 0.0 <= s["digit_accuracy"] <= 1.0
            assert s["max_x_99"] is None or s["max_x_99"] in xs


def test_plot_is_written(tiny_run):
    _, out = tiny_run
    png = (out / "power_of_two.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_max_x_at_99_percent_is_the_longest_exact_prefix(report):
    max_x_at = report.max_x_at
    rng = random.Random()
    xs = sorted(rng.sample(range(1, 200), 40))
    first_wrong = rng.randrange(1, 40)
    records = [{"x": x, "exact": i < first_wrong or rng.random() < 0.5} for i, x in enumerate(xs)]
    records[first_wrong]["exact"] = False
    assert max_x_at(records) == xs[first_wrong - 1]
    assert max_x_at([{"x": 0, "exact": False}] + records) is None   # below every x of records
