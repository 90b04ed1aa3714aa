"""The command line: demo, verify (exit codes), show (PNG), one-line errors, and pattern specs."""

import contextlib
import importlib
import importlib.util
import io
import json
import subprocess
import sys

import pytest
import torch

from flexsparse.cli import main
from flexsparse.masks import ESA, Geometry, SinkWindow
from flexsparse.specs import parse_pattern, parse_stack


def test_demo_runs_and_checks_against_the_reference(capsys):
    assert main(["demo", "--seq", "256"]) == 0
    out = capsys.readouterr().out
    assert "all SSA" in out and "routed per input" in out
    errors = [float(line.split()[-3]) for line in out.splitlines() if line.startswith(("all ", "hybrid", "routed"))]
    assert len(errors) == 4 and max(errors) < 1e-5
    assert "uncompiled flex_attention" in out  # the CPU default is flex_eager


def test_demo_says_uncompiled_only_when_it_was(capsys):
    from flexsparse.tools.demo import CPU_SIZE

    assert main(["demo", "--seq", "128", "--device", "cpu", "--backend", "dense"]) == 0
    out = capsys.readouterr().out
    assert "backend=dense" in out and "S=128" in out and "uncompiled" not in out
    assert CPU_SIZE.seq == 1024  # --seq does not change the next run's default


def test_verify_exit_codes(capsys):
    assert main(["verify", "--layers", "esa:num_layers=4,attn_length=8,num_heads=4", "--repeat", "4",
                 "--seq-len", "300"]) == 0
    assert "hole-free" in capsys.readouterr().out
    assert main(["verify", "--layers", "sink_window:sink=0,window=8", "--repeat", "2", "--seq-len", "100"]) == 1
    assert "HOLE at query 15, key 0" in capsys.readouterr().out


def test_verify_max_length_and_first_hole_only(capsys):
    windows = ["verify", "--layers", "sink_window:sink=0,window=8", "--repeat", "2"]
    assert main(windows + ["--max-length"]) == 0
    assert "max hole-free length: hole-free up to 15 tokens; from 16 tokens on, query 15 cannot reach key 0" \
        in capsys.readouterr().out
    assert main(windows + ["--max-length", "--seq-len", "12"]) == 0  # 12 <= 15: hole-free
    assert main(windows + ["--seq-len", "100000", "--first-hole-only"]) == 1
    out = capsys.readouterr().out
    assert "HOLE at query 15, key 0" in out and "stopped early" in out and "the first 8,192 queries" in out
    assert main(["verify", "--layers", "causal", "--max-length", "--limit", "64"]) == 0
    assert "every length" in capsys.readouterr().out


no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")


@pytest.mark.parametrize("argv,message", [
    (["verify", "--layers", "sink_windw:window=4", "--seq-len", "10"], "unknown pattern 'sink_windw'"),
    (["verify", "--layers", "sink_window:window=x", "--seq-len", "10"], "'window' must be a number"),
    (["verify", "--layers", "sink_window:window=0", "--seq-len", "10"], "window must be >= 1"),
    (["verify", "--layers", "causal", "--seq-len", "0"], "seq_len must be >= 1"),
    (["verify", "--layers", "causal"], "give --seq-len"),
    (["verify", "--seq-len", "10"], "give --layers"),
    (["verify", "--layers", "causal", "--repeat", "0", "--seq-len", "10"], "repeat must be >= 1"),
    (["verify", "--layers", "esa:num_layers=2,attn_length=4,num_heads=2", "--repeat", "3", "--seq-len", "10"],
     "num_layers must cover the stack"),
    (["verify", "--layers", "triangle_mix:sink=0,window=4,last_q=2", "--max-length"], "TriangleMix"),
    (["verify", "--layers", "causal", "--max-length", "--limit", "0"], "limit must be >= 1"),
    (["verify", "--config", "no/such/file.json"], "No such file"),
    pytest.param(["verify", "--layers", "causal", "--seq-len", "10", "--device", "cuda"], "needs a CUDA device",
                 marks=no_cuda),
    (["verify", "--layers", "causal", "--seq-len", "10", "--device", "gpu"], "--device 'gpu' is not a device"),
    (["verify", "--layers", "causal", "--seq-len", "10", "--device", "meta"], "run on cpu or cuda"),
    (["demo", "--device", "gpu"], "--device 'gpu' is not a device; use cpu, cuda or cuda:N"),
    (["demo", "--hf", "--device", "cuda0"], "--device 'cuda0' is not a device"),
    pytest.param(["demo", "--device", "cuda:0"], "needs a CUDA device", marks=no_cuda),
    (["show", "causal", "--layers", "3"], "'causal' is the same in every layer"),
    (["show", "sink_window:sink=4,window=8", "--layers", "2"], "is the same in every layer"),
    (["show", "esa:num_layers=4,attn_length=8,num_heads=2,layer_idx=1", "--layers", "2"],
     "is the same in every layer"),
    (["show", "nope:x=1"], "unknown pattern 'nope'"),
    (["show", "causal", "--seq-len", "0"], "--seq-len must be >= 1"),
    (["show", "causal", "--seq-len", "100000"], "dense references are for small sizes"),
    (["bench", "--seq", "0"], "--seq must be >= 1"),
    pytest.param(["bench", "--seq", "128"], "flexsparse bench needs a CUDA device", marks=no_cuda),
    (["demo", "--seq", "-4"], "--seq must be >= 1"),
    (["demo", "--hf", "--seq", "64"], "--seq does not apply to --hf"),
    (["show", "xa:threshold=1.5"], "threshold must be in (0, 1]"),
    (["show", "xa", "--rule", "greedy"], "rule must be one of"),
    (["show", "xa", "--seq-len", "100"], "must be a multiple of the stride (16)"),
    (["show", "xa", "--layers", "2"], "--layers applies to ESA specs"),
    (["show", "xa", "--heads", "0"], "--heads must be >= 1"),
    (["bench", "--smoke"], "--smoke applies to --hf"),
    pytest.param(["bench", "--hf"], "use --smoke for toy sizes on the CPU", marks=no_cuda),
])
def test_input_errors_exit_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"flexsparse {argv[0]}: error: ") and message in lines[0]
    assert "Traceback" not in captured.err + captured.out


def test_bad_config_files_exit_2(tmp_path, capsys):
    for name, text, message in [("broken.json", "{not json", "not valid JSON"),
                                ("list.json", "[1, 2]", 'an object with a "layers" list'),
                                ("typo.json", json.dumps({"seq_len": 8, "layers": [["causal", "nope"]]}),
                                 "unknown pattern 'nope'"),
                                ("repeat.json", json.dumps({"seq_len": 8, "layers": ["causal"], "repeat": 1.5}),
                                 "repeat must be an int")]:
        path = tmp_path / name
        path.write_text(text)
        assert main(["verify", "--config", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0]


def test_missing_matplotlib_is_one_line(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["show", "causal", "--seq-len", "16", "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs matplotlib" in err[0]


def test_argparse_usage_errors_exit_2():
    with pytest.raises(SystemExit) as exit_info:
        main(["verify", "--seq-len", "ten"])
    assert exit_info.value.code == 2


def test_the_installed_command_exits_with_the_same_codes():
    """Through a real process: 2 with one line and no traceback for a typo, 1 for a hole."""
    run = lambda *args: subprocess.run([sys.executable, "-m", "flexsparse.cli", "verify", *args],
                                       capture_output=True, text=True, timeout=120)
    typo = run("--layers", "sink_window:sink=0,windw=4", "--seq-len", "10")
    assert typo.returncode == 2 and "Traceback" not in typo.stderr
    assert typo.stderr.strip().count("\n") == 0 and "bad arguments in spec" in typo.stderr
    hole = run("--layers", "sink_window:sink=0,window=8", "--repeat", "2", "--seq-len", "100")
    assert hole.returncode == 1 and "HOLE at query 15, key 0" in hole.stdout
    device = run("--layers", "causal", "--seq-len", "10", "--device", "gpu")  # not 1, the code of a hole
    assert device.returncode == 2 and device.stderr.strip().count("\n") == 0 and "Traceback" not in device.stderr


def test_verify_reads_a_json_config(tmp_path, capsys):
    config = tmp_path / "stack.json"
    config.write_text(json.dumps({"seq_len": 64, "layers": [["causal", "sink_window:sink=0,window=4"]]}))
    assert main(["verify", "--config", str(config)]) == 0


def test_show_writes_a_png(tmp_path):
    out = tmp_path / "esa.png"
    assert main(["show", "esa:num_layers=3,attn_length=8,num_heads=2", "--layers", "3", "--seq-len", "64",
                 "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["show", "causal", "--layers", "1", "--seq-len", "16", "--out", str(tmp_path / "one.png")]) == 0


def test_show_layers_draws_what_varies_by_layer(tmp_path, monkeypatch):
    """ESA rows differ by layer (their layer_idx is the row); a layer-independent pattern is drawn once."""
    from flexsparse.tools import pictures

    drawn = {}

    def draw(rows, seq_len, path):
        drawn["rows"] = rows
        return path

    monkeypatch.setattr(pictures, "draw_masks", draw)
    assert main(["show", "esa:num_layers=3,attn_length=4,num_heads=2", "--layers", "3", "--seq-len", "32"]) == 0
    masks = [pattern.dense(Geometry(2, 32)) for _, pattern in drawn["rows"]]
    assert [label for label, _ in drawn["rows"]] == ["layer 0", "layer 1", "layer 2"]
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    drawn.clear()
    assert main(["show", "causal", "--seq-len", "32"]) == 0
    assert len(drawn["rows"]) == 1


def test_show_xa_draws_the_blocks_of_synthetic_inputs(tmp_path, capsys):
    out = tmp_path / "xa.png"
    assert main(["show", "xa:threshold=0.8,stride=8,block_size=32", "--seq-len", "256", "--heads", "3",
                 "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {out}" in capsys.readouterr().out


def test_demo_hf_checks_the_converted_model():
    pytest.importorskip("transformers")
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        assert main(["demo", "--hf"]) == 0
    text = report.getvalue()
    assert "max |logit error| 0.00e+00, generated tokens equal 64/64" in text
    assert "sparse KV cache vs full recompute (use_cache=False): tokens equal 64/64" in text


def test_bench_hf_smoke_writes_its_json(tmp_path):
    pytest.importorskip("transformers")
    assert main(["bench", "--hf", "--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "hf-bench.json").read_text())
    assert len(result["decode"]) == 5 and len(result["generate"]) == 4  # 2 batches x 2 depths + a left-padded batch
    assert [row["left_padded"] for row in result["decode"]] == [False] * 4 + [True]
    assert all(row["first_step_error"] < 1e-4 and row["kv_saved"] > 1 for row in result["decode"])
    assert all(row["one_launch_speedup_vs_sdpa"] > 0 for row in result["decode"])  # the interpreter runs it
    assert all(row["decode_step_ms"] > 0 and row["prefill_s"] > 0 for row in result["generate"])


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
    with pytest.raises(ValueError, match="'sink' must be a number, got '4x'"):
        parse_pattern("sink_window:sink=4x")
    with pytest.raises(ValueError, match="layer spec must be a string or a non-empty list"):
        parse_stack([[]])
    with pytest.raises(ValueError, match="repeat must be >= 1"):
        parse_stack(["causal"], repeat=0)
