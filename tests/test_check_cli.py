from mk_plugin.__main__ import main


def test_check_cli_tiny_passes(capsys):
    assert main(["check", "--batch", "3"]) == 0
    out = capsys.readouterr().out
    assert "ALL PASS" in out and "decode_step" in out and "FAIL" not in out
    assert "megakernel (vm) logits vs pure fp32 ref (drift)" in out  # the product is checked too


def test_check_cli_megakernel_with_fallback(capsys):
    assert main(["check", "--batch", "2", "--mode", "megakernel", "--fallback", "attention,down"]) == 0
    out = capsys.readouterr().out
    assert "megakernel (vm, fallback attention,down) KV appends" in out and "decode_step logits" not in out


def test_check_cli_rejects_unknown_fallback_op():
    import pytest
    with pytest.raises(SystemExit, match="unknown op.*bogus"):
        main(["check", "--fallback", "bogus"])
