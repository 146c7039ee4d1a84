"""The demo (python -m attnrnn.demo): its training step, its task, and a --quick run end to end (CPU)."""
import math

import pytest
import torch


@pytest.fixture
def demo(ar):
    import attnrnn.demo
    return attnrnn.demo


def test_recall_task_answers_are_the_paired_values(demo):
    task = demo.RecallTask(num_pairs=5, num_queries=4)
    seq, table = task.sample(3, torch.Generator().manual_seed(0))
    assert seq.shape == (3, 2 * 5 + 1 + 2 * 4) and (seq[:, 10] == task.SEP).all()
    queries, answers = seq[:, 11::2], seq[:, 12::2]
    assert torch.equal(table.gather(1, queries), answers)
    inp, tgt, ans = task.batch(3, torch.Generator().manual_seed(0))
    assert (tgt[:, :10] == -100).all() and torch.equal(tgt[ans].view(3, 4), answers)


def test_demo_training_steps_run_on_cpu(demo):
    torch.manual_seed(0)
    model = demo.make_model("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    task, gen = demo.RecallTask(), torch.Generator().manual_seed(0)
    before = [p.detach().clone() for p in model.parameters()]
    losses = [demo.train_step(model, opt, task, gen, batch=8)[0] for _ in range(3)]
    assert all(math.isfinite(x) for x in losses)
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_demo_quick_runs_end_to_end(demo, tmp_path, capsys):
    rows = demo.main(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    for section in ("1) three forms", "2) training", "3) generation", "4) decoding cost", "time per decoded token"):
        assert section in out
    assert [r["context"] for r in rows] == [64, 256]
    assert rows[0]["linear_bytes"] == rows[1]["linear_bytes"]            # O(1) state
    assert rows[1]["softmax_bytes"] == 4 * rows[0]["softmax_bytes"]      # O(N) KV cache
    assert (tmp_path / "decode_cost.png").stat().st_size > 0
    assert str(tmp_path / "decode_cost.png") in out
