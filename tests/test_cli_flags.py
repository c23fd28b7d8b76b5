"""Library errors name API arguments; trainbridge train reports them as its flags (trainbridge/cli/flags.py)."""
from trainbridge.cli.flags import cli_error, in_cli_words
from trainbridge.errors import UserError


def test_arguments_that_are_options_become_flags():
    message = ('compression="bf16" is not available with backend="horovod"; use compression="fp16", '
               "or backend='torch' for bf16")
    assert in_cli_words(message) == ("--compression bf16 is not available with --backend horovod; use --compression "
                                     "fp16, or --backend torch for bf16")
    assert in_cli_words("use dist_backend=\"gloo\"; timeout=300 s; deterministic=True") == \
        "use --dist-backend gloo; --timeout 300 s; --deterministic"
    assert in_cli_words('use shm_allreduce="auto" or shm_allreduce="off"') == "use --shm-allreduce auto or off"


def test_a_failed_write_is_fixed_by_another_output_dir():
    # The library offers another folder; trainbridge train's checkpoints live in --output-dir.
    assert in_cli_words("cannot write the checkpoint runs/last.pt: File too large; free space there or save to "
                        "another folder") == ("cannot write the checkpoint runs/last.pt: File too large; free space "
                                              "there or pass another --output-dir")


def test_other_arguments_and_text_are_left_alone():
    message = 'job.save({"model": model}, path): op="sum" and x=1 stay; a == b; https://x.org/?a=b'
    assert in_cli_words(message) == message


def test_a_user_error_keeps_its_quiet_flag_and_anything_else_passes_through():
    translated = cli_error(UserError('shm_allreduce="on" is not possible', quiet=True))
    assert isinstance(translated, UserError) and translated.quiet
    assert str(translated) == "--shm-allreduce on is not possible"
    bug = ValueError('backend="torch"')
    assert cli_error(bug) is bug
