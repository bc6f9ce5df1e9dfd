from mk_plugin.__main__ import main


def test_check_cli_tiny_passes(capsys):
    assert main(["check", "--batch", "3"]) == 0
    out = capsys.readouterr().out
    assert "ALL PASS" in out and "decode_step" in out and "FAIL" not in out
