"""The console entry points run end to end on their built-in toy models."""

from dspark_hf.cli import main as cli_main
from dspark_hf.demo import main as demo_main


def test_demo_runs_and_is_lossless(capsys):
    rows = demo_main(["--max-new-tokens", "16"])
    assert len(rows) == 3
    assert all(r.identical and r.new_tokens == 16 and r.tau >= 1.0 for r in rows)
    out = capsys.readouterr().out
    assert "UNTRAINED" in out and "identical to target greedy: yes" in out


def test_cli_lists_commands_and_rejects_unknown(capsys):
    assert cli_main([]) == 0
    assert "demo" in capsys.readouterr().out
    assert cli_main(["nope"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_bench_head_writes_json_and_markdown(tmp_path):
    import json

    cli_main(["bench-head", "--sizes", "tiny", "--heads", "markov", "--block-sizes", "4", "--candidates", "0", "8",
              "--repeats", "2", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "head_cost.json").read_text())
    assert data["provenance"]["torch"] and len(data["rows"]) == 2
    assert all(r["parallel_ms"] > 0 and r["sequential_greedy_ms"] > 0 for r in data["rows"])
    assert "| tiny | markov | 4 |" in (tmp_path / "head_cost.md").read_text()
