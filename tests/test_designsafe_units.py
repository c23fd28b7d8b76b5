"""DesignSafe task, in process: layout checks, sample, transforms, model head, freezing, report math."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from trainbridge.cli.data import main as data_main
from trainbridge.data.designsafe_sample import CLASSES, IMAGES_PER_CLASS, is_synthetic_sample, make_sample
from trainbridge.data.imagefolder import build_transforms, check_layout, image_files
from trainbridge.errors import UserError
from trainbridge.models.resnet import freeze_backbone, load_backbone_state, resnet34_classifier
from trainbridge.training.config import parse_config
from trainbridge.training.evaluation import confusion_matrix, format_report, precision_recall, save_report, summarise


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("designsafe") / "sample"
    make_sample(str(root), seed=0)
    return root


@pytest.fixture
def copy_of(sample, tmp_path):
    """A writable copy of the sample, to break."""
    root = tmp_path / "data"
    shutil.copytree(sample, root)
    return root


def error_of(root: Path, *extra: str) -> str:
    """The UserError message that ``trainbridge train --task designsafe`` gives for ``root``."""
    cfg = parse_config(["--task", "designsafe", "--data-root", str(root), "--no-pretrained", *extra])
    with pytest.raises(UserError) as caught:
        cfg.validate()
    message = str(caught.value)
    assert "\n" not in message  # one line
    return message


# ----- sample generator -------------------------------------------------------
def test_sample_layout_sizes_and_readme(sample):
    for split, count in IMAGES_PER_CLASS.items():
        assert sorted(os.listdir(sample / split)) == list(CLASSES)
        for name in CLASSES:
            files = image_files(str(sample / split / name))
            assert len(files) == count
            for path in files[:5]:
                with Image.open(path) as image:
                    assert all(64 <= side <= 96 for side in image.size) and image.mode == "RGB"
    assert (sample / "README.md").read_text().startswith("SYNTHETIC") and is_synthetic_sample(str(sample))
    assert check_layout(str(sample)).keys() == {"train", "val", "test"}


def test_sample_with_more_training_images(tmp_path):
    bigger = tmp_path / "bigger"
    make_sample(str(bigger), seed=0, train_per_class=IMAGES_PER_CLASS["Train"] + 3)
    for split, count in IMAGES_PER_CLASS.items():
        expected = count + 3 if split == "Train" else count
        assert [len(image_files(str(bigger / split / name))) for name in CLASSES] == [expected] * len(CLASSES)


def test_sample_is_deterministic_and_classes_differ(sample, tmp_path):
    again = tmp_path / "again"
    make_sample(str(again), seed=0)
    first = sample / "Train" / "C0" / "c0_000.png"
    assert (again / "Train" / "C0" / "c0_000.png").read_bytes() == first.read_bytes()
    # Damage means clutter: mean absolute difference between neighbouring pixels grows with the class.
    def roughness(name):
        values = []
        for path in image_files(str(sample / "Train" / name)):
            pixels = torch.from_numpy(__import__("numpy").asarray(Image.open(path), dtype="float32"))
            values.append((pixels[:, 1:] - pixels[:, :-1]).abs().mean().item())
        return sum(values) / len(values)
    assert roughness("C0") < roughness("C2") < roughness("C4")


def test_make_sample_refuses_to_overwrite_other_data(tmp_path, capsys):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "photo.jpg").write_bytes(b"x")
    assert data_main(["make-sample", "designsafe", "--out", str(tmp_path / "real")]) == 2
    assert "not a trainbridge sample" in capsys.readouterr().err
    assert data_main(["make-sample", "designsafe", "--out", str(tmp_path / "new")]) == 0
    assert data_main(["make-sample", "designsafe", "--out", str(tmp_path / "new")]) == 0  # a sample is replaced


# ----- bad input: one line each -------------------------------------------------
def test_data_root_is_required():
    cfg = parse_config(["--task", "designsafe", "--no-pretrained"])
    with pytest.raises(UserError, match="--task designsafe needs --data-root DIR.*make-sample designsafe"):
        cfg.validate()


@pytest.mark.parametrize("folder", ["Train", "Validation"])
def test_missing_split(copy_of, folder):
    shutil.rmtree(copy_of / folder)
    message = error_of(copy_of)
    assert f"has no {folder}/ folder" in message and "expected ROOT/Train/<class>/*" in message


def test_classes_differ(copy_of):
    (copy_of / "Validation" / "C4").rename(copy_of / "Validation" / "C5")
    message = error_of(copy_of)
    assert "class folders differ between Train/ and Validation/" in message
    assert "only in Train: ['C4']" in message and "only in Validation: ['C5']" in message


def test_empty_class(copy_of):
    for path in (copy_of / "Train" / "C2").iterdir():
        path.unlink()
    (copy_of / "Train" / "C2" / "notes.txt").write_text("not an image")
    assert f"class folder {copy_of / 'Train' / 'C2'} has no images" in error_of(copy_of)


@pytest.mark.parametrize("content", [b"", b"this is not a png", "truncated"])
def test_unreadable_image_is_named(copy_of, content):
    bad = copy_of / "Validation" / "C0" / "c0_003.png"
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2] if content == "truncated" else content)
    message = error_of(copy_of)
    assert message.startswith(f"unreadable image file {bad} (") and message.endswith("replace or delete it")


def test_image_size_below_32(sample):
    assert "--image-size must be at least 32 (got 31)" in error_of(sample, "--image-size", "31")


def test_option_conflicts(sample, tmp_path):
    assert "contradict" in error_of(sample, "--pretrained-weights", "x.pth")
    cfg = parse_config(["--task", "mnist", "--freeze-backbone"])
    with pytest.raises(UserError, match="--freeze-backbone: not used by --task mnist"):
        cfg.validate()
    cfg = parse_config(["--task", "designsafe", "--data-root", str(sample), "--model", "mlp"])
    with pytest.raises(UserError, match="not --model mlp"):
        cfg.validate()


def test_missing_weights_file_says_what_to_do(tmp_path):
    with pytest.raises(UserError, match="does not exist.*--no-pretrained"):
        load_backbone_state(str(tmp_path / "missing.pth"))
    (tmp_path / "junk.pth").write_bytes(b"junk")
    with pytest.raises(UserError, match="cannot load --pretrained-weights"):
        load_backbone_state(str(tmp_path / "junk.pth"))


def test_offline_without_cache_is_one_line(tmp_path, monkeypatch):
    """No cached ImageNet weights and no network: one line suggesting --no-pretrained or a path."""
    from trainbridge.models import resnet

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    monkeypatch.setattr(resnet, "imagenet_weights_url", lambda: "http://127.0.0.1:9/resnet34-b627a593.pth")
    with pytest.raises(UserError) as caught:
        resnet.ensure_imagenet_weights()
    message = str(caught.value)
    assert "\n" not in message and "--no-pretrained" in message and "--pretrained-weights PATH" in message


# ----- transforms ---------------------------------------------------------------
def test_transforms(sample):
    path = image_files(str(sample / "Train" / "C4"))[0]
    image = Image.open(path).convert("RGB")
    for train in (True, False):
        plain = build_transforms(64, train=train, imagenet_normalise=False)(image)
        assert plain.shape == (3, 64, 64) and plain.dtype == torch.float32 and 0 <= plain.min() and plain.max() <= 1
    names = [type(t).__name__ for t in build_transforms(224, train=True, imagenet_normalise=True).transforms]
    assert names == ["AutoAugment", "Resize", "ToTensor", "Normalize"]
    names = [type(t).__name__ for t in build_transforms(224, train=False, imagenet_normalise=True).transforms]
    assert names == ["Resize", "ToTensor", "Normalize"]
    normalised = build_transforms(64, train=False, imagenet_normalise=True)(image)
    assert normalised.min() < 0  # ImageNet mean subtracted


# ----- model --------------------------------------------------------------------
def test_head_shape_and_weights_file(tmp_path):
    torch.manual_seed(0)
    model = resnet34_classifier(num_classes=5)
    assert [type(m).__name__ for m in model.fc] == ["Linear", "ReLU", "Linear"]
    assert (model.fc[0].in_features, model.fc[0].out_features, model.fc[2].out_features) == (512, 512, 5)
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 5)
    # A weights file (here: another model's state) loads the backbone and leaves the new head alone.
    donor = resnet34_classifier(num_classes=3).state_dict()
    torch.save(donor, tmp_path / "w.pth")
    loaded = resnet34_classifier(num_classes=5, weights_path=str(tmp_path / "w.pth"))
    assert torch.equal(loaded.conv1.weight, donor["conv1.weight"])
    assert torch.equal(loaded.layer4[2].bn2.running_var, donor["layer4.2.bn2.running_var"])
    torch.save({"conv1.weight": donor["conv1.weight"]}, tmp_path / "partial.pth")
    with pytest.raises(UserError, match="is not a resnet34 state_dict"):
        resnet34_classifier(3, weights_path=str(tmp_path / "partial.pth"))


def test_freeze_backbone_freezes_and_trains_head():
    torch.manual_seed(0)
    model = freeze_backbone(resnet34_classifier(num_classes=3))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"fc.0.weight", "fc.0.bias", "fc.2.weight", "fc.2.bias"}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()  # the loop calls this every epoch: the backbone must stay in eval mode
    assert not model.layer1[0].bn1.training and model.fc.training
    for _ in range(2):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 64, 64)), torch.tensor([0, 1, 2, 0])).backward()
        optimizer.step()
    after = model.state_dict()
    for key, value in before.items():  # backbone: parameters and BatchNorm statistics bitwise equal
        assert torch.equal(value, after[key]) is (not key.startswith("fc.")), key
    assert all(p.grad is None for name, p in model.named_parameters() if not name.startswith("fc."))


# ----- classification report ----------------------------------------------------
def test_confusion_matrix_precision_recall(tmp_path):
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    predictions = torch.tensor([0, 0, 1, 1, 1, 2, 2, 0, 1])
    matrix = confusion_matrix(labels, predictions, 4)
    assert matrix.tolist() == [[2, 1, 0, 0], [0, 2, 0, 0], [1, 1, 2, 0], [0, 0, 0, 0]]
    scores = precision_recall(matrix)
    assert scores["precision"][:3] == pytest.approx([2 / 3, 2 / 4, 2 / 2])
    assert scores["precision"][3] is None  # class 3 never predicted
    assert scores["recall"][:3] == pytest.approx([2 / 3, 2 / 2, 2 / 4]) and scores["recall"][3] is None
    # Summing per-rank matrices gives the global one (what the allreduce does).
    halves = confusion_matrix(labels[::2], predictions[::2], 4) + confusion_matrix(labels[1::2], predictions[1::2], 4)
    assert torch.equal(halves, matrix)

    report = summarise(matrix, ["a", "b", "c", "d"], "val", loss_sum=4.5)
    assert report["accuracy"] == pytest.approx(6 / 9) and report["loss"] == pytest.approx(0.5)
    assert report["per_class"]["c"] == {"precision": 1.0, "recall": 0.5, "support": 4}
    table = format_report(report)
    assert "accuracy" in table and "66.7%" in table and "rows: true, columns: predicted" in table
    json_path, png_path = save_report(report, str(tmp_path))
    assert json.loads(Path(json_path).read_text())["confusion_matrix"] == matrix.tolist()
    assert Path(png_path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
