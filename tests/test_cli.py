"""The console entry points run end to end on their built-in toy models."""

from pathlib import Path

import pytest

from dspark_hf.cli import main as cli_main
from dspark_hf.testbed.demo import main as demo_main


def test_demo_runs_and_is_lossless(capsys):
    rows = demo_main(["--toy", "--max-new-tokens", "16"])
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


def test_bench_runs_every_policy_side_by_side(tmp_path):
    import json

    cli_main(["bench", "--target", "toy-tiny", "--concurrency", "1", "3", "--max-new-tokens", "6", "--repeats", "1", "--block-size", "3",
              "--out", str(tmp_path)])
    data = json.loads((tmp_path / "bench.json").read_text())
    rows = data["rows"]
    assert {(r["concurrency"], r["policy"]) for r in rows} == {
        (c, p) for c in (1, 3) for p in ("none", "fixed", "threshold", "scheduled", "async")}
    assert all(r["identical_to_target"] in (True, None) for r in rows)  # greedy: lossless for every policy
    assert all(r["aggregate_tokens_per_s"] > 0 for r in rows)
    assert (tmp_path / "throughput.png").exists() and (tmp_path / "verify_length.png").exists()
    assert (tmp_path / "sps.json").exists()


def test_results_collects_tables_and_says_what_is_missing(tmp_path):
    (tmp_path / "results" / "bench_toy").mkdir(parents=True)
    (tmp_path / "results" / "bench_toy" / "bench.md").write_text("# title\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    import runpy, sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "collect_results.py"
    argv, sys.argv = sys.argv, [str(script), "--results-dir", str(tmp_path / "results"), "--out", str(tmp_path / "RESULTS.md")]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    text = (tmp_path / "RESULTS.md").read_text()
    assert "| 1 | 2 |" in text and "Not measured yet." in text and "dspark-hf bench --target toy" in text


@pytest.mark.slow
def test_demo_default_runs_smollm2_with_the_release_drafter(capsys):
    """The README's first command: the real target (fetched / cached offline) and the shipped drafter, lossless."""
    rows = demo_main(["--max-new-tokens", "32"])
    assert len(rows) == 3 and all(r.identical for r in rows)
    assert sum(r.tau for r in rows) / len(rows) > 1.2  # a trained drafter: drafts are accepted
    assert "release DSpark drafter" in capsys.readouterr().out


def test_bench_baseline_emits_eos_like_the_speculative_runs():
    """The bench's plain-decoding baseline generates exactly max_new_tokens with no EOS handling, as the speculative
    runs (eos_token_id=[]) do. A target whose greedy choice is its EOS token partway through must give the same
    tokens both ways (with `min_new_tokens` the baseline would suppress EOS and the outputs would differ)."""
    import torch

    import dspark_hf
    from conftest import make_drafter, make_target
    from dspark_hf.evaluation.throughput import _run_policy

    target = make_target("llama")
    ids = torch.tensor([[5, 17, 33, 2], [40, 41, 42, 43]])
    mask = torch.ones_like(ids)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    target.generation_config.eos_token_id = int(plain[0, ids.shape[1] + 4])  # a token row 0 emits greedily
    drafter = make_drafter(target)
    _, base = _run_policy(target, drafter, ids, mask, "none", 12, None, 0.5, False, 0)
    _, spec = _run_policy(target, drafter, ids, mask, "fixed", 12, None, 0.5, False, 0)
    assert base.shape[1] == ids.shape[1] + 12 and torch.equal(base, plain)
    assert torch.equal(spec.sequences, base)
