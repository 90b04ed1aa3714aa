"""The command line: demo, verify (exit codes), show (PNG), and pattern specs."""

import json

import pytest

from flexsparse.cli import main
from flexsparse.masks import ESA, SinkWindow
from flexsparse.specs import parse_pattern, parse_stack


def test_demo_runs_and_checks_against_the_reference(capsys):
    assert main(["demo", "--seq", "256"]) == 0
    out = capsys.readouterr().out
    assert "all SSA" in out and "routed per input" in out
    errors = [float(line.split()[-3]) for line in out.splitlines() if line.startswith(("all ", "hybrid", "routed"))]
    assert len(errors) == 4 and max(errors) < 1e-5


def test_verify_exit_codes(capsys):
    assert main(["verify", "--layers", "esa:num_layers=4,attn_length=8,num_heads=4", "--repeat", "4",
                 "--seq-len", "300"]) == 0
    assert "hole-free" in capsys.readouterr().out
    assert main(["verify", "--layers", "sink_window:sink=0,window=8", "--repeat", "2", "--seq-len", "100"]) == 1
    assert "HOLE at query 15, key 0" in capsys.readouterr().out


def test_verify_reads_a_json_config(tmp_path, capsys):
    config = tmp_path / "stack.json"
    config.write_text(json.dumps({"seq_len": 64, "layers": [["causal", "sink_window:sink=0,window=4"]]}))
    assert main(["verify", "--config", str(config)]) == 0


def test_show_writes_a_png(tmp_path):
    out = tmp_path / "esa.png"
    assert main(["show", "esa:num_layers=3,attn_length=8,num_heads=2", "--layers", "3", "--seq-len", "64",
                 "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_specs():
    assert repr(parse_pattern("sink_window:sink=4,window=64")) == repr(SinkWindow(4, 64))
    stack = parse_stack(["esa:num_layers=2,attn_length=4,num_heads=2"], repeat=2)
    assert [p.layer_idx for p in stack] == [0, 1] and isinstance(stack[0], ESA)
    assert len(parse_stack(["causal+sink_window:window=3"])[0]) == 2
    with pytest.raises(ValueError, match="unknown pattern 'nope'"):
        parse_pattern("nope")
    with pytest.raises(ValueError, match="key=value"):
        parse_pattern("sink_window:4")
    with pytest.raises(ValueError, match="bad arguments"):
        parse_pattern("sink_window:size=4")
