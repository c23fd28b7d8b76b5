"""trainbridge.cli.doctor: the checks of ``trainbridge doctor --hosts``, and how it reaches the other hosts."""
import argparse
import subprocess

from trainbridge.cli.doctor import host_problems, ssh_command

PLANTED = "-oProxyCommand=touch {marker}"


def test_ssh_reads_a_host_name_as_a_host_never_as_an_option(tmp_path):
    marker = tmp_path / "ran"
    host = PLANTED.format(marker=marker)
    cmd = ssh_command(host, 2222, "10.0.0.1")
    assert cmd[cmd.index("--") + 1] == host and cmd.index("--") < cmd.index(host)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)  # the real ssh: it runs nothing
    assert result.returncode != 0 and not marker.exists(), result
    assert "hostname" in result.stderr.lower(), result.stderr  # "contains invalid characters", or "could not resolve"


def test_a_host_name_that_starts_with_a_dash_is_a_problem_and_reaches_no_ssh(tmp_path):
    marker = tmp_path / "ran"
    args = argparse.Namespace(hosts=f"localhost,{PLANTED.format(marker=marker)}", ssh_port=None, rdzv_endpoint=None,
                              master_addr=None, master_port=None)
    problems, notes = host_problems(args)
    assert problems[0] == (f"'{PLANTED.format(marker=marker)}' is not a host name: it starts with '-', which ssh "
                           f"and the launchers read as an option; list host names separated by commas")
    assert not marker.exists()
    assert notes[-1].startswith("interfaces towards the other hosts: localhost ")
