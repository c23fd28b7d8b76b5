"""``trainbridge train --help`` states each option's default where a user must know it."""
from trainbridge.training.config import build_parser


def test_help_gives_the_default_and_meaning_of_epochs_and_output_dir():
    options = {a.option_strings[0]: a for a in build_parser()._actions if a.option_strings}
    assert options["--epochs"].help.startswith("passes over the training set (default: 3)")
    assert "(default: runs/latest)" in options["--output-dir"].help
    assert "resumes from its last.pt" in options["--output-dir"].help
