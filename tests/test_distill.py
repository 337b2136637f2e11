"""``timm-dora distill`` (:mod:`timm_dora.train.distill`): a narrower student of a trained actor,
on a tiny random ViT on the CPU."""
import json

import pytest
import timm
import torch

from test_train import data  # noqa: F401  (the `data` fixture: generated images and labels.csv)
from timm_dora import Actor
from timm_dora.cli import main as cli
from timm_dora.engine import native_gflops, run, wrap
from timm_dora.policy import ActorPolicy, NoPrune
from timm_dora.train.distill import compare, distill, teacher_steps
from timm_dora.train.rollout import evaluate_controller


def _setup():
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, num_classes=4).eval()
    wrap(model, policy=NoPrune(), cuda_graphs=False)
    teacher = Actor.for_model(model).eval()
    with torch.no_grad():
        teacher.gate_mlp[2].bias.fill_(2.0)  # gates mostly open: many controller steps
        for p in teacher.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    return model, teacher, torch.randn(24, 3, 64, 64)


def test_compare_of_an_actor_with_itself_is_exact():
    model, teacher, x = _setup()
    y = torch.arange(24) % 4
    res = compare(model, teacher, teacher, x, y, batch=10)
    assert res["same_budget_pct"] == 100.0 == res["shared_removals_pct"] and res["images"] == 24 and res["teacher_steps"] > 0
    assert res["teacher_gflops"] == res["student_gflops"] and res["teacher_agreement_pct"] == res["student_agreement_pct"]
    assert res["teacher_drop_pp"] == res["student_drop_pp"]
    # the per-image spread: the quantiles of one unbatched run's per-image GFLOPs
    _, stats = run(model, x, ActorPolicy(teacher))
    p10, p90 = stats.gflops.float().quantile(torch.tensor([0.1, 0.9])).tolist()
    assert res["teacher_gflops_p10"] == pytest.approx(p10) == res["student_gflops_p10"]
    assert res["teacher_gflops_p90"] == pytest.approx(p90) == res["student_gflops_p90"] and p90 > p10
    assert res["native_top1"] - res["teacher_top1"] == pytest.approx(res["teacher_drop_pp"], abs=1e-9)


def test_a_teacher_that_never_prunes_is_a_clear_error():
    model, teacher, x = _setup()
    with torch.no_grad():
        teacher.gate_mlp[2].bias.fill_(-100.0)
    with pytest.raises(ValueError, match="the teacher prunes none of the images"):
        distill(model, teacher, x[:4], 32, epochs=1)


def test_the_student_keeps_the_teachers_gate_and_learns_its_budgets_and_tokens():
    """The student (width 32) has the teacher's gate, so it opens at the same steps; distillation
    raises the likelihood of the teacher's budgets and orders on the learned images, and the
    student then removes more of the teacher's tokens than an untrained student of the same gate."""
    model, teacher, x = _setup()
    untrained = distill(model, teacher, x, 32, epochs=0)
    student = distill(model, teacher, x, 32, epochs=40, lr=3e-3, batch=16)
    assert (student.width, student.encoder.num_heads, student.selector_hidden) == (32, 1, 16)
    assert torch.equal(student.gate_embed, teacher.gate_embed)
    d = teacher_steps(model, teacher, x, 12)
    assert d["lengths"].numel() > 20  # many gate-on steps

    def likelihood(actor):
        with torch.no_grad():
            lb, _, ls, _ = evaluate_controller(actor, d["keys"], d["lengths"], d["h"], d["block"], d["budget_index"],
                                               d["order"], d["valid"])
        return float(lb.mean()), float(ls.mean())

    before, after = likelihood(untrained), likelihood(student)
    assert after[0] > before[0] + 0.5 and after[1] > before[1]
    res_before, res_after = compare(model, teacher, untrained, x), compare(model, teacher, student, x)
    assert res_after["shared_removals_pct"] > res_before["shared_removals_pct"]
    assert res_after["same_budget_pct"] >= res_before["same_budget_pct"]
    # the gate is the teacher's: the steps at which each removes anything are the same on every image
    for actor in (untrained, student):
        with torch.no_grad():
            k_t = run(model, x[:8], ActorPolicy(teacher))[1].removed > 0
            k_s = run(model, x[:8], ActorPolicy(actor))[1].removed > 0
        assert torch.equal(k_t[:, 0], k_s[:, 0])  # the first block's gate sees the same keys and history


def test_cli_writes_a_loadable_student_and_refuses_a_split_it_learns_from(data, tmp_path, capsys):  # noqa: F811
    model, teacher, _ = _setup()
    teacher.save_pretrained(tmp_path / "teacher", backbone=model, extra={"target_drop": 0.01, "updates": 7})
    args = ["distill", "--model", "vit_tiny_patch16_224", "--data", str(data), "--teacher", str(tmp_path / "teacher"),
            "--width", "32", "--epochs", "2", "--device", "cpu", "--out", str(tmp_path / "student")]
    with pytest.MonkeyPatch.context() as mp:  # the tiny model of the fixture's images
        import timm_dora.train.distill as distill_module

        mp.setattr(distill_module, "create_backbone",
                   lambda name, weights: timm.create_model(name, pretrained=False, img_size=64, num_classes=4))
        assert cli(args) == 0
        student = Actor.from_pretrained(tmp_path / "student")
        assert student.width == 32 and student.num_patches == teacher.num_patches
        record = json.loads((tmp_path / "student" / "distill.json").read_text())
        assert record["width"] == 32 and record["dev"]["images"] == 4 and 0 <= record["dev"]["shared_removals_pct"] <= 100
        assert "student_drop_pp" in record["dev"] and "student_drop_pp" not in record["learned_images"]
        training = json.loads((tmp_path / "student" / "config.json").read_text())["training"]
        assert training["dev_gflops"] == record["dev"]["student_gflops"] and training["distillation"] == record
        spread = record["dev"]["student_gflops_p90"] - record["dev"]["student_gflops_p10"]
        assert training["dev_spread_pct"] == pytest.approx(100.0 * spread / native_gflops(model))
        assert training["teacher"] == {"target_drop": 0.01, "updates": 7}  # the teacher's provenance travels
        assert cli(args[:-1] + [str(tmp_path / "bad"), "--eval-split", "qc"]) == 1
    assert capsys.readouterr().err.endswith(
        "error: --eval-split qc is one of --splits: the comparison must be held out\n")
