"""``trainbridge train``'s options, each declared once (trainbridge/tasks/options.py): the parser, the range
checks, what a resume compares and the docs tables are read from the declarations."""
import dataclasses
import re
from pathlib import Path

import pytest

from trainbridge.errors import UserError
from trainbridge.tasks import TASKS, create_task, option, task_class
from trainbridge.tasks.options import flags
from trainbridge.training.config import TRAINING_OPTIONS, TrainConfig, build_parser, changed_options, parse_config

ROOT = Path(__file__).resolve().parents[1]


def test_help_gives_the_default_and_meaning_of_epochs_and_output_dir():
    options = {a.option_strings[0]: a for a in build_parser()._actions if a.option_strings}
    assert options["--epochs"].help.startswith("passes over the training set (default: 3)")
    assert "(default: runs/latest)" in options["--output-dir"].help
    assert "resumes from its last.pt" in options["--output-dir"].help
    assert options["--timeout"].help.endswith("(default 300)")  # 300.0 shown as the number a user types


def test_help_lists_every_declared_option_of_the_engine_and_of_each_built_in_task():
    shown = {flag for action in build_parser()._actions for flag in action.option_strings}
    declared = {*flags(TrainConfig).values(),
                *(flag for spec in TASKS.values() for flag in flags(task_class(spec).Options).values())}
    assert declared | {"-h", "--help"} == shown


def table_rows(path: Path, heading: str):
    """The first cells of the table under ``heading`` in ``path``."""
    section = path.read_text().split(heading, 1)[1].split("\n## ", 1)[0]
    return [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]


def test_the_options_table_lists_exactly_the_declared_options_with_their_choices():
    cells = table_rows(ROOT / "docs" / "reference" / "train-options.md", "## Options")
    listed = {flag for cell in cells for flag in re.findall(r"`(--[a-z-]+)", cell)}
    assert listed == set(flags(TrainConfig).values())
    written = {m.group(1): set(m.group(2).split(",")) for cell in cells
               for m in re.finditer(r"`(--[a-z-]+) \{([a-z0-9,-]+)\}`", cell)}
    declared = {flag: set(field.metadata["option"].choices) for field in dataclasses.fields(TrainConfig)
                if "option" in field.metadata and field.metadata["option"].choices
                for flag in [flags(TrainConfig)[field.name]]}
    assert {flag: choices for flag, choices in written.items() if flag in declared} == \
        {flag: declared[flag] for flag in written if flag in declared}


def test_the_designsafe_guide_lists_the_tasks_own_options():
    cells = table_rows(ROOT / "docs" / "guides" / "designsafe.md", "## Options")
    listed = {flag for cell in cells for flag in re.findall(r"`(--[a-z-]+)", cell)}
    own = set(flags(task_class("designsafe").Options).values())
    assert own <= listed and listed <= own | set(flags(TrainConfig).values())


def test_training_options_come_from_the_declarations():
    assert TRAINING_OPTIONS == ("task", "model", "dataset", "lr", "optimizer", "scheduler", "momentum", "gamma",
                                "plateau_patience", "scale_lr", "sync_batchnorm", "seed", "amp", "compression")


def test_a_tasks_options_arrive_typed_and_another_tasks_are_refused():
    cfg = parse_config(["--task", "designsafe", "--image-size", "64", "--freeze-backbone", "--workers", "2"])
    assert (cfg.task_options.image_size, cfg.task_options.freeze_backbone, cfg.task_options.workers) == (64, True, 2)
    assert not hasattr(cfg, "image_size") and create_task(cfg.task, cfg.task_options).options is cfg.task_options
    cfg = parse_config(["--task", "mnist", "--workers", "2"])
    with pytest.raises(UserError, match=r"^--workers: not used by --task mnist; this option is for --task designsafe$"):
        cfg.validate()


def test_a_resume_compares_options_by_name_and_reads_old_checkpoints():
    now = parse_config(["--task", "designsafe", "--image-size", "64", "--lr", "0.5"])
    now.apply_task_defaults(create_task(now.task, now.task_options))
    saved = now.saved()
    assert saved["task_options"]["image_size"] == 64 and "image_size" not in saved
    assert changed_options(saved, 2, now, 2) == []
    # Before the task declared its options, a checkpoint held them beside the engine's.
    old = {k: v for k, v in saved.items() if k != "task_options"}
    old.update(image_size=224, no_pretrained=False, pretrained_weights=None, freeze_backbone=False, workers=None,
               task_options={})
    assert changed_options(old, 2, now, 2) == ["--image-size 224 -> 64"]
    assert changed_options({**old, "image_size": 64, "lr": 1.0}, 1, now, 2) == [
        "--lr 1.0 -> 0.5", "global batch (--batch-size x --accumulate x ranks) 128 -> 256"]


def test_an_old_add_arguments_task_is_one_line(tmp_path):
    source = ("import dataclasses\nimport trainbridge as tb\n\nclass Old(tb.Task):\n"
              "    @classmethod\n    def add_arguments(cls, parser):\n        pass\n"
              "    def load_data(self, cfg, note): pass\n    train_dataset = None\n"
              "    def eval_dataset(self, split): pass\n    def build_model(self, cfg): pass\n")
    (tmp_path / "old_task.py").write_text(source)
    with pytest.raises(UserError, match=r"Old.add_arguments is replaced by declared options; declare each as a field "
                                        r"of a dataclass Old.Options"):
        task_class(f"{tmp_path}/old_task.py:Old")


def test_a_task_option_may_not_take_an_engine_flag(tmp_path):
    source = ("import dataclasses\nimport trainbridge as tb\nfrom trainbridge.tasks import option\n\n"
              "class Clash(tb.Task):\n    @dataclasses.dataclass\n    class Options:\n"
              "        epochs: int = option(1, help='mine')\n        plain: int = 3\n"
              "    def load_data(self, cfg, note): pass\n    train_dataset = None\n"
              "    def eval_dataset(self, split): pass\n    def build_model(self, cfg): pass\n")
    (tmp_path / "clash_task.py").write_text(source)
    with pytest.raises(UserError, match=r"Clash.Options must be a dataclass whose fields are made with "
                                        r"trainbridge.tasks.option\(...\) \(not plain\)"):
        task_class(f"{tmp_path}/clash_task.py:Clash")
    (tmp_path / "clash2_task.py").write_text(source.replace("        plain: int = 3\n", ""))
    with pytest.raises(UserError, match=r"Clash.Options declares --epochs, an option of trainbridge train"):
        build_parser(f"{tmp_path}/clash2_task.py:Clash")


def test_option_declares_a_field():
    @dataclasses.dataclass
    class Options:
        size: int = option(3, help="the size (default: {default})")

    assert Options().size == 3 and flags(Options) == {"size": "--size"}
