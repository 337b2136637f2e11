"""``timm-dora partition``: the training rows dealt out anew, the reserved rows untouched."""
import csv
from pathlib import Path

import pytest

from timm_dora.cli import main
from timm_dora.data import LabelsCSVDataset
from timm_dora.partition import partition_rows


def _rows():
    rows = [{"path": f"img{i}.png", "label": str(i), "split": s}
            for i, s in enumerate(["rollout"] * 5 + ["qc"] * 3 + ["dev"] * 2)]
    rows += [{"path": "t0.png", "label": "0", "split": "test"}, {"path": "t1.png", "label": "1", "split": "test"}]
    return rows


def test_partition_deals_every_training_row_once_and_keeps_test():
    rows = _rows()
    new = partition_rows(rows, {"rollout": 4, "qc": 3, "dev": 3}, ["rollout", "qc", "dev"], seed=0)
    assert [r["path"] for r in new] == [r["path"] for r in rows]  # row order kept
    assert [r["split"] for r in new[-2:]] == ["test", "test"]
    counts = {s: sum(r["split"] == s for r in new) for s in ("rollout", "qc", "dev")}
    assert counts == {"rollout": 4, "qc": 3, "dev": 3}
    assert rows[0]["split"] == "rollout" and len(rows) == 12  # the input is not modified
    # deterministic for a seed, and the seed matters
    assert partition_rows(rows, {"rollout": 4, "qc": 3, "dev": 3}, ["rollout", "qc", "dev"], 0) == new
    assert any(partition_rows(rows, {"rollout": 4, "qc": 3, "dev": 3}, ["rollout", "qc", "dev"], s) != new
               for s in (1, 2, 3))
    # the dealing follows random.Random(seed).shuffle of the training rows' indices
    import random

    order = list(range(10))
    random.Random(0).shuffle(order)
    assert [new[i]["split"] for i in order] == ["rollout"] * 4 + ["qc"] * 3 + ["dev"] * 3


def test_partition_errors():
    with pytest.raises(ValueError, match="add up to 9, but the splits rollout, qc, dev hold 10 rows"):
        partition_rows(_rows(), {"rollout": 4, "qc": 3, "dev": 2}, ["rollout", "qc", "dev"], 0)
    with pytest.raises(ValueError, match="test are not re-partitioned"):
        partition_rows(_rows(), {"rollout": 5, "test": 5}, ["rollout", "qc", "dev"], 0)
    with pytest.raises(ValueError, match="no rows in the splits train"):
        partition_rows(_rows(), {"rollout": 1}, ["train"], 0)


def test_cli_partition_writes_a_csv_that_loads_from_elsewhere(tmp_path, capsys):
    from PIL import Image

    data = tmp_path / "data"
    data.mkdir()
    for r in _rows():
        Image.new("RGB", (8, 8)).save(data / r["path"])
    with open(data / "labels.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["path", "label", "synset", "set", "split"])
        w.writeheader()
        w.writerows({**r, "synset": "n0", "set": "x"} for r in _rows())
    out = tmp_path / "runs" / "labels_4_3_3.csv"
    assert main(["partition", "--labels", str(data / "labels.csv"), "--sizes", "rollout=4", "qc=3", "dev=3",
                 "--seed", "1", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"{out}: dev 3, qc 3, rollout 4, test 2"
    test = LabelsCSVDataset(out, "test")
    assert [Path(p).name for p in test.paths] == ["t0.png", "t1.png"] and all(Path(p).is_file() for p in test.paths)
    assert len(LabelsCSVDataset(out, "rollout")) == 4 and len(LabelsCSVDataset(out, "dev")) == 3
    assert main(["partition", "--labels", str(data / "labels.csv"), "--sizes", "rollout=4", "--out", str(out)]) == 1
    assert "every one must be placed" in capsys.readouterr().err


def test_partition_folder_draws_disjoint_splits_and_leaves_the_rest_out(tmp_path, capsys):
    """``--folder``: an ImageNet-style ``train/<synset>/<image>`` tree dealt into splits by the seed;
    labels are the sorted folder index; the CSV loads from elsewhere and its splits are disjoint."""
    import random

    from PIL import Image

    from timm_dora.data import ImageFolderDataset, check_disjoint

    root = tmp_path / "imagenet" / "train"
    for c, syn in enumerate(["n02", "n01", "n03"]):
        for k in range(4):
            (root / syn).mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (8, 8), (40 * c, 40 * k, 0)).save(root / syn / f"{syn}_{k}.JPEG")
    out = tmp_path / "runs" / "splits.csv"
    assert main(["partition", "--folder", str(root), "--sizes", "rollout=6", "qc=2", "dev=3", "--seed", "0",
                 "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"{out}: dev 3, qc 2, rollout 6"
    splits = {s: LabelsCSVDataset(out, s) for s in ("rollout", "qc", "dev")}
    check_disjoint(splits)
    folder = ImageFolderDataset(root)
    order = list(range(12))
    random.Random(0).shuffle(order)
    assert [Path(p).name for p in splits["rollout"].paths] == [Path(folder.paths[i]).name for i in order[:6]]
    for ds in splits.values():
        for p, y in zip(ds.paths, ds.labels):
            assert y == ["n01", "n02", "n03"].index(Path(p).parent.name)
    assert main(["partition", "--folder", str(root), "--sizes", "rollout=13", "--out", str(out)]) == 1
    assert "add up to 13, but" in capsys.readouterr().err
