"""timm_dora.data (datasets, transforms, disjointness, shards, preload) and timm_dora.train.pool (the
resumable sampler, augmentation)."""
from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
import timm
import torch
from PIL import Image

from timm_dora.data import (
    ImageFolderDataset, InputNormalize, LabelsCSVDataset, check_disjoint, check_labels, eval_transform, fixed_shards, hold,
    open_split, preload, uint8_transform,
)
from timm_dora.train.pool import RolloutSampler, augment_level, cutmix_patches, train_transform

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
MINI = SHARED / "data" / "imagenet-mini"
needs_mini = pytest.mark.skipif(not (MINI / "labels.csv").is_file(), reason="shared imagenet-mini not available")

SYNSETS = ["n01440764", "n01443537", "n01484850"]
GLOBAL = {"n01440764": 0, "n01443537": 1, "n01484850": 2}


def _image(path: Path, seed: int, size=(40, 30)) -> Path:
    g = torch.Generator().manual_seed(seed)
    arr = (torch.rand(size[1], size[0], 3, generator=g) * 255).to(torch.uint8).numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)
    return path


def _write_csv(path: Path, rows, header=("path", "label", "synset", "set", "split")):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


@pytest.fixture
def fake_csv(tmp_path):
    """10 images (PNG + JPEG) in a flat folder; splits a (5), b (3), c (2); labels 5, 7, 9 cycling."""
    rows = []
    splits = ["a"] * 5 + ["b"] * 3 + ["c"] * 2
    for i, sp in enumerate(splits):
        name = f"imgs/im{i}.{'png' if i % 2 else 'jpg'}"
        _image(tmp_path / name, seed=i, size=(40 + i, 30 + 2 * i))
        rows.append([name, [5, 7, 9][i % 3], f"n{i:08d}", "fake", sp])
    return _write_csv(tmp_path / "labels.csv", rows)


@pytest.fixture
def fake_tree(tmp_path):
    """root/<synset>/k.png with 2 images per class, plus a split subfolder layout."""
    root = tmp_path / "tree"
    for c, syn in enumerate(SYNSETS):
        for k in range(2):
            _image(root / "val" / syn / f"{k}.png", seed=100 + 10 * c + k)
    return root


@pytest.fixture(scope="module")
def small_model():
    return timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=64, num_classes=10).eval()


# ---------------------------------------------------------------------------- LabelsCSVDataset
def test_csv_split_selection_and_labels(fake_csv):
    ds = LabelsCSVDataset(fake_csv, "b")
    assert len(ds) == 3
    assert ds.labels == [9, 5, 7]  # rows 5, 6, 7 of the CSV; label = [5, 7, 9][row % 3]
    assert all(Path(p).is_absolute() and Path(p).exists() for p in ds.paths)
    assert [Path(p).name for p in ds.paths] == ["im5.png", "im6.jpg", "im7.png"]
    assert ds.synsets == ["n00000005", "n00000006", "n00000007"]
    img, label, index = ds[1]
    assert isinstance(img, Image.Image) and img.mode == "RGB" and img.size == (46, 42)
    assert (label, index) == (5, 1)
    assert len(LabelsCSVDataset(fake_csv, "a")) == 5 and len(LabelsCSVDataset(fake_csv, "c")) == 2


def test_csv_root_override(fake_csv, tmp_path):
    moved = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "imgs", moved / "imgs")
    ds = LabelsCSVDataset(fake_csv, "c", root=moved)
    assert all(p.startswith(str(moved.resolve())) for p in ds.paths)


def test_csv_errors(fake_csv, tmp_path):
    with pytest.raises(FileNotFoundError, match="labels CSV not found"):
        LabelsCSVDataset(tmp_path / "nope.csv", "a")
    with pytest.raises(ValueError, match=r"unknown split 'train'; available: 'a', 'b', 'c'"):
        LabelsCSVDataset(fake_csv, "train")
    bad = _write_csv(tmp_path / "bad.csv", [["imgs/im0.jpg", "n0"]], header=("path", "synset"))
    with pytest.raises(ValueError, match="missing column.*label, split"):
        LabelsCSVDataset(bad, "a")
    empty = _write_csv(tmp_path / "empty.csv", [])
    with pytest.raises(ValueError, match="no rows"):
        LabelsCSVDataset(empty, "a")
    badlabel = _write_csv(tmp_path / "badlabel.csv", [["imgs/im0.jpg", "x", "", "", "a"]])
    with pytest.raises(ValueError, match=r"badlabel.csv:2: label 'x'"):
        LabelsCSVDataset(badlabel, "a")
    gone = _write_csv(tmp_path / "gone.csv", [["imgs/missing.jpg", 1, "", "", "a"]])
    with pytest.raises(FileNotFoundError, match="1 image file.*missing.jpg"):
        LabelsCSVDataset(gone, "a")


# ---------------------------------------------------------------------------- ImageFolderDataset
def test_image_folder_sorted_labels(fake_tree):
    ds = ImageFolderDataset(fake_tree / "val")
    assert ds.classes == SYNSETS and ds.labels == [0, 0, 1, 1, 2, 2]
    assert [Path(p).parent.name for p in ds.paths] == [s for s in SYNSETS for _ in range(2)]
    img, label, index = ds[3]
    assert label == 1 and index == 3 and img.mode == "RGB"


def test_image_folder_class_maps(fake_tree, tmp_path):
    # classes.txt ("synset name" lines in label order): only two folders present -> global indices
    shutil.rmtree(fake_tree / "val" / SYNSETS[0])
    txt = tmp_path / "classes.txt"
    txt.write_text("".join(f"{s}\tclass {i}\n" for i, s in enumerate(SYNSETS)))
    assert ImageFolderDataset(fake_tree / "val", class_map=txt).labels == [1, 1, 2, 2]
    assert ImageFolderDataset(fake_tree / "val").labels == [0, 0, 1, 1]  # local, sorted
    # labels.csv-style synset column, and a dict
    lab = _write_csv(tmp_path / "map.csv", [[f"x/{s}.jpg", 10 + i, s, "s", "a"] for i, s in enumerate(SYNSETS)])
    assert ImageFolderDataset(fake_tree / "val", class_map=lab).labels == [11, 11, 12, 12]
    assert ImageFolderDataset(fake_tree / "val", class_map={SYNSETS[1]: 4, SYNSETS[2]: 3}).labels == [4, 4, 3, 3]
    with pytest.raises(ValueError, match=f"not in the class map: {SYNSETS[2]}"):
        ImageFolderDataset(fake_tree / "val", class_map={SYNSETS[1]: 0})


def test_image_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        ImageFolderDataset(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no images"):
        ImageFolderDataset(tmp_path / "empty")
    _image(tmp_path / "loose" / "a.png", 0)
    with pytest.raises(ValueError, match="directly under the root"):
        ImageFolderDataset(tmp_path / "loose")


def test_open_split(fake_csv, fake_tree, tmp_path):
    assert isinstance(open_split(fake_csv, "b"), LabelsCSVDataset)
    assert len(open_split(fake_csv.parent, "a")) == 5  # a folder holding labels.csv
    ds = open_split(fake_tree, "val")  # subfolder named by the split
    assert isinstance(ds, ImageFolderDataset) and len(ds) == 6
    assert len(open_split(fake_tree / "val", "test")) == 6  # no such subfolder: the folder itself
    with pytest.raises(FileNotFoundError):
        open_split(tmp_path / "missing", "a")


# ---------------------------------------------------------------------------- transforms / preload
@needs_mini
def test_eval_transform_matches_timm_on_real_image():
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    tf = eval_transform(model)
    ref = timm.data.create_transform(**timm.data.resolve_data_config({}, model=model))
    path = MINI / "val1300" / sorted(p.name for p in (MINI / "val1300").iterdir())[0]
    img = Image.open(path).convert("RGB")
    x = tf(img)
    assert x.shape == (3, 224, 224)
    assert torch.equal(x, ref(img))
    # training moves uint8 and normalises it on the device: the same floats, bit for bit
    u8 = train_transform(model, augment=False)(img)
    assert u8.dtype == torch.uint8 and torch.equal(u8, uint8_transform(model)(img))
    assert torch.equal(InputNormalize(model)(u8[None])[0], x)


def test_transforms_use_model_input_size(small_model):
    img = Image.new("RGB", (90, 70), (120, 30, 200))
    assert eval_transform(small_model)(img).shape == (3, 64, 64)  # built with img_size=64
    aug = train_transform(small_model, augment=True)
    names = [type(t).__name__ for t in aug.transforms]
    assert names[:2] == ["RandomResizedCropAndInterpolation", "RandomHorizontalFlip"]
    assert not any("Jitter" in n or "Erasing" in n or "Augment" in n for n in names)
    assert aug.transforms[0].scale == (0.5, 1.0)
    assert aug(img).shape == (3, 64, 64)


def test_strong_transform_adds_randaugment_and_a_wider_crop(small_model):
    img = Image.new("RGB", (90, 70), (120, 30, 200))
    assert train_transform(small_model, augment="light").transforms[0].scale == (0.5, 1.0)
    strong = train_transform(small_model, augment="strong")
    names = [type(t).__name__ for t in strong.transforms]
    assert names[:3] == ["RandomResizedCropAndInterpolation", "RandomHorizontalFlip", "RandAugment"]
    assert strong.transforms[0].scale == (0.25, 1.0)
    assert not any("Erasing" in n for n in names)
    assert strong(img).shape == (3, 64, 64)
    assert augment_level(True) == "light" and augment_level(False) == augment_level(None) == "none"
    with pytest.raises(ValueError, match="augment must be one of"):
        train_transform(small_model, augment="heavy")


def test_cutmix_patches_pastes_whole_tiles_of_the_other_image():
    a = torch.zeros(3, 64, 48)
    b = torch.arange(3 * 64 * 48, dtype=torch.float32).view(3, 64, 48) + 1
    g = torch.Generator().manual_seed(3)
    mixed, (top, left, rows, cols) = cutmix_patches(a, b, 16, generator=g)
    # the same three draws by hand: lam, then the top and left tile
    h = torch.Generator().manual_seed(3)
    lam = float(torch.rand((), generator=h))
    assert (rows, cols) == (round(4 * (1 - lam) ** 0.5), round(3 * (1 - lam) ** 0.5))
    assert top == int(torch.randint(4 - rows + 1, (), generator=h))
    assert left == int(torch.randint(3 - cols + 1, (), generator=h))
    inside = torch.zeros(64, 48, dtype=torch.bool)
    inside[top * 16 : (top + rows) * 16, left * 16 : (left + cols) * 16] = True
    assert torch.equal(mixed[:, inside], b[:, inside]) and torch.equal(mixed[:, ~inside], a[:, ~inside])
    assert torch.equal(a, torch.zeros(3, 64, 48))  # the input is not modified
    # over many draws the pasted share averages E[round-trip of 1 - lam] ~ 1/2 and spans 0..1
    shares = []
    for _ in range(400):
        m, (_, _, r, c) = cutmix_patches(a, b, 16, generator=g)
        assert int((m[0] != 0).sum()) == r * c * 256
        shares.append(r * c / 12)
    assert min(shares) == 0.0 and max(shares) == 1.0 and 0.4 < sum(shares) / len(shares) < 0.6
    with pytest.raises(ValueError, match="one shape"):
        cutmix_patches(a, b[:, :32], 16)
    with pytest.raises(ValueError, match="multiple of the patch size"):
        cutmix_patches(a[:, :60], b[:, :60], 16)


def test_preload(fake_csv, small_model):
    ds = LabelsCSVDataset(fake_csv, "a", transform=eval_transform(small_model))
    images, labels = preload(ds, dtype=torch.float16, batch_size=2)
    assert images.shape == (5, 3, 64, 64) and images.dtype == torch.float16
    assert labels.tolist() == ds.labels and labels.dtype == torch.long
    assert torch.equal(images[3], ds[3][0].half())
    with pytest.raises(TypeError, match="tensors"):
        preload(LabelsCSVDataset(fake_csv, "a"))


# ---------------------------------------------------------------------------- check_disjoint
def test_check_disjoint(fake_csv, tmp_path):
    splits = {s: LabelsCSVDataset(fake_csv, s) for s in ("a", "b", "c")}
    check_disjoint(splits)
    # the same file in two splits (one path spelled through '..')
    rows = list(csv.reader(open(fake_csv)))[1:]
    rows.append(["imgs/../imgs/im6.jpg", 9, "", "", "c"])
    dup = _write_csv(tmp_path / "dup.csv", rows)
    with pytest.raises(ValueError, match=r"splits 'b' and 'c' overlap: 1 shared file\(s\), e.g. .*im6.jpg"):
        check_disjoint({s: LabelsCSVDataset(dup, s) for s in ("a", "b", "c")})
    # a byte-identical copy under another name: caught by content, not by path
    shutil.copy(tmp_path / "imgs" / "im2.jpg", tmp_path / "imgs" / "copy_of_2.jpg")
    rows = list(csv.reader(open(fake_csv)))[1:] + [["imgs/copy_of_2.jpg", 9, "", "", "c"]]
    cp = _write_csv(tmp_path / "copy.csv", rows)
    sets = {s: LabelsCSVDataset(cp, s) for s in ("a", "b", "c")}
    with pytest.raises(ValueError, match=r"'a' and 'c' overlap: 1 file\(s\) with identical content.*im2.jpg \(a\) == .*copy_of_2.jpg \(c\)"):
        check_disjoint(sets)
    check_disjoint(sets, content=False)
    check_disjoint({"x": [str(tmp_path / "imgs" / "im0.jpg")], "y": [str(tmp_path / "imgs" / "im1.png")]})


def test_check_disjoint_reads_only_files_whose_size_another_split_has(tmp_path, monkeypatch):
    """Same-file overlap comes from one ``stat`` per file (a link to a file of another split is the
    same file); content is compared only for files whose exact size occurs in another split: here
    one size is shared by a file of each split, so two files are read, not 40."""
    import timm_dora.data as D

    root = tmp_path / "s"
    root.mkdir()
    files = {"a": [], "b": []}
    for k in range(20):
        for split, fill in (("a", b"a"), ("b", b"b")):
            size = 100 + 2 * k + (split == "b")  # every size distinct ...
            if k == 7:
                size = 500  # ... but one, shared by a pair with other bytes
            p = root / f"{split}{k}.bin"
            p.write_bytes(fill * size)
            files[split].append(str(p))
    reads = []
    real = D._content_key
    monkeypatch.setattr(D, "_content_key", lambda p, size: reads.append(p) or real(p, size))
    check_disjoint(files)
    assert sorted(reads) == sorted([files["a"][7], files["b"][7]])
    # a symbolic link in b to a file of a: the same file under another name
    (root / "link.bin").symlink_to(root / "a3.bin")
    with pytest.raises(ValueError, match=r"splits 'a' and 'b' overlap: 1 shared file\(s\), e.g. .*a3.bin"):
        check_disjoint({"a": files["a"], "b": files["b"] + [str(root / "link.bin")]})
    # a copy of the same bytes: read and caught
    (root / "copy.bin").write_bytes((root / "a5.bin").read_bytes())
    with pytest.raises(ValueError, match=r"identical content.*a5.bin \(a\) == .*copy.bin \(b\)"):
        check_disjoint({"a": files["a"], "b": files["b"] + [str(root / "copy.bin")]})
    # a split larger than content_max is compared by file identity alone: no file is read
    reads.clear()
    check_disjoint({"a": files["a"], "b": files["b"] + [str(root / "copy.bin")]}, content_max=20)
    assert reads == []


def test_check_labels_names_the_split_file_and_label(fake_csv):
    splits = {s: LabelsCSVDataset(fake_csv, s) for s in ("a", "b")}
    check_labels(splits, 10)
    with pytest.raises(ValueError, match=r"split 'a': label 9 of .*im2.jpg is outside the model's 8 classes \(0 to 7\)"):
        check_labels(splits, 8)


def test_hold_keeps_uint8_inputs_and_leaves_out_unreadable_files(fake_csv, small_model, capsys):
    """A fixed set decoded once as uint8; its model inputs equal the float eval transform's bit for
    bit; a corrupt file and a truncated JPEG are left out, each named in one warning line."""
    ds = LabelsCSVDataset(fake_csv, "a")
    held = hold(ds, small_model)
    assert held.images.dtype == torch.uint8 and held.images.shape == (5, 3, 64, 64) and held.index == [0, 1, 2, 3, 4]
    ref = preload(LabelsCSVDataset(fake_csv, "a", transform=eval_transform(small_model)))
    assert torch.equal(held.inputs(), ref[0]) and torch.equal(held.labels, ref[1])
    assert torch.equal(held.inputs(torch.tensor([3, 1]), torch.bfloat16), ref[0][[3, 1]].bfloat16())
    Path(ds.paths[1]).write_bytes(b"not an image")
    jpeg = Path(ds.paths[2]).read_bytes()
    Path(ds.paths[2]).write_bytes(jpeg[: len(jpeg) // 2])  # truncated
    capsys.readouterr()
    held = hold(ds, small_model, indices=[4, 1, 2, 0])
    assert held.index == [4, 0] and torch.equal(held.inputs(), ref[0][[4, 0]])
    assert [p for p, _ in held.skipped] == [ds.paths[1], ds.paths[2]]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("timm-dora: warning: skipped unreadable image ") for line in err)
    assert ds.paths[1] in err[0] and ds.paths[2] in err[1]
    none = hold(ds, small_model, indices=[1, 2])  # a share with no readable file: empty, not an error
    assert len(none) == 0 and none.index == [] and none.images.shape == (0, 3, 64, 64)


def test_rollout_images_replace_an_unreadable_file_by_the_next_readable_one(fake_csv, small_model):
    from timm_dora.train.pool import MAX_UNREADABLE_IN_A_ROW, RolloutImages

    ds = LabelsCSVDataset(fake_csv, "a", transform=train_transform(small_model))
    pool = RolloutImages(ds, seed=0)
    fine = pool[(1, 2)][1]
    Path(ds.paths[1]).write_bytes(b"\xff\xd8 broken")
    key, x, skipped = pool[(1, 1)]
    assert key == (1, 1) and torch.equal(x, fine) and [p for p, _ in skipped] == [ds.paths[1]]
    assert pool[(1, 3)][2] == []
    for p in ds.paths:
        Path(p).write_bytes(b"")
    with pytest.raises(RuntimeError, match=r"5 unreadable images in a row from .*im0.jpg"):
        pool[(1, 0)]
    assert MAX_UNREADABLE_IN_A_ROW >= 5


@pytest.mark.parametrize("workers", [0, 2])
def test_rollout_stream_writes_each_batch_into_a_ring_slot(fake_csv, small_model, workers):
    """The streamed batches are the pool's images in the sampler's order (this process's share of
    each global batch), written by the workers into shared ring slots that cycle; a slot holds its
    batch until ``slots - 2`` more are asked for."""
    from timm_dora.train.pool import RolloutImages, RolloutStream

    ds = LabelsCSVDataset(fake_csv, "a", transform=train_transform(small_model))
    pool = RolloutImages(ds, seed=0)
    stream = RolloutStream(pool, RolloutSampler(5, 4, 7), 0, [1, 3], workers, (3, 64, 64), chunk=1)
    order = RolloutSampler(5, 4, 7)
    seen = []
    try:
        for u in range(1, 2 * stream.slots + 1):
            idx = next(order)
            keys, x, skipped = next(stream)
            assert keys == [(u, idx[1]), (u, idx[3])] and skipped == []
            assert torch.equal(x, torch.stack([pool[k][1] for k in keys]))
            assert x.data_ptr() == stream.ring[(u - 1) % stream.slots].data_ptr()
            seen.append(x.clone())
    finally:
        stream.close()
    assert stream.slots >= 3 and len(seen) == 2 * stream.slots


@needs_mini
def test_real_splits_disjoint_and_sized():
    sizes = {"rollout": 700, "qc": 150, "dev": 150, "test": 1300}
    splits = {s: LabelsCSVDataset(MINI / "labels.csv", s) for s in sizes}
    assert {s: len(d) for s, d in splits.items()} == sizes
    assert all(0 <= y < 1000 for d in splits.values() for y in d.labels)
    check_disjoint(splits)


# ---------------------------------------------------------------------------- shards and sampler
def test_fixed_shards():
    shards = fixed_shards(150, 8)
    assert [len(s) for s in shards] == [19, 19, 19, 19, 19, 19, 18, 18]
    assert [i for s in shards for i in s] == list(range(150))  # contiguous, full coverage
    assert fixed_shards(150, 8) == shards
    assert fixed_shards(16, 8) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    with pytest.raises(ValueError):
        fixed_shards(5, 8)
    with pytest.raises(ValueError):
        fixed_shards(5, 0)


def test_rollout_sampler_epochs():
    s = RolloutSampler(10, 4, torch.Generator().manual_seed(3))
    batches = [next(s) for _ in range(5)]  # 20 indices = exactly 2 permutations
    assert all(len(b) == 4 for b in batches)
    flat = [i for b in batches for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # a fresh permutation each epoch
    g = torch.Generator().manual_seed(3)
    assert flat[:10] == torch.randperm(10, generator=g).tolist()
    assert [next(RolloutSampler(10, 4, 3)) for _ in range(1)][0] == batches[0]  # int seed
    assert len(next(RolloutSampler(3, 7, 0))) == 7  # batch > n spans several permutations


def test_rollout_sampler_exact_resume():
    s = RolloutSampler(10, 4, torch.Generator().manual_seed(0))
    for _ in range(3):
        next(s)
    state = s.state_dict()
    expected = [next(s), next(s)]  # crosses an epoch boundary (12 -> 20 indices)
    fresh = RolloutSampler(10, 4, torch.Generator().manual_seed(12345))
    fresh.load_state_dict(state)
    assert [next(fresh), next(fresh)] == expected
    assert fresh.epoch == s.epoch == 2
    with pytest.raises(ValueError, match="n=10, batch=4"):
        RolloutSampler(11, 4).load_state_dict(state)
    # the state survives torch.save / torch.load (checkpoint files)
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    again = RolloutSampler(10, 4)
    again.load_state_dict(torch.load(buf))
    assert [next(again), next(again)] == expected


def test_keep_decoded_reads_each_file_once_and_transforms_every_time(fake_csv, monkeypatch):
    calls = []
    real_open = Image.open
    monkeypatch.setattr("timm_dora.data.Image.open", lambda f: calls.append(1) or real_open(f))
    flips = iter([True, False, True])
    ds = LabelsCSVDataset(fake_csv, "a", transform=lambda im: im.transpose(Image.FLIP_LEFT_RIGHT) if next(flips) else im)
    ds.keep_decoded()
    first, second, third = ds[0][0], ds[0][0], ds[0][0]
    assert len(calls) == 1  # decoded once
    plain = real_open(ds.paths[0]).convert("RGB")
    assert list(second.getdata()) == list(plain.getdata())  # the cached image itself is untouched
    assert list(first.getdata()) == list(third.getdata()) != list(plain.getdata())
