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


def test_demo_runs_this_packages_loop_with_lookup_branches_losslessly():
    """`run_demo(generate_kwargs=...)`: speculative decoding through `target.generate(custom_generate=
    dspark_hf.speculative_generate, drafter=..., lookup=..., tree_budget=0, tree_max_nodes=W)` (the demo's default
    with a lookup table), identical to target greedy; tau counts the target's forwards, so a lookup that has seen
    the target's own continuations lifts it above 1 even with an untrained drafter."""
    import torch

    from dspark_hf.models.lookup import NgramLookup
    from dspark_hf.testbed.demo import build_toy_pair, run_demo

    target, drafter = build_toy_pair()
    seqs = []
    for i in range(3):  # the demo's toy prompts and the target's own greedy continuations of them
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(1, target.config.vocab_size, (1, 12 + 8 * i), generator=g)
        with torch.no_grad():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        seqs.append((out[0].tolist(), [0] * ids.shape[1] + [1] * 16))
    table = NgramLookup.build(seqs, max_order=3, heldout_share=0.0)
    kwargs = {"lookup": table, "tree_budget": 0, "tree_max_nodes": 4, "policy": "fixed"}
    rows = run_demo(target, drafter, max_new_tokens=16, generate_kwargs=kwargs)
    assert len(rows) == 3 and all(r.identical and r.new_tokens == 16 for r in rows)
    assert all(r.tau >= 2.0 for r in rows)  # 16 tokens in at most 8 forwards (prefill included)
    # what `prepare_demo(branches=W)` passes: the lookup's own rounds up to 16 drafts, lengths from a cost curve
    free = run_demo(target, drafter, max_new_tokens=16,
                    generate_kwargs={**kwargs, "lookup_max_tokens": 16, "sps": lambda b: 1.0 / (1.0 + 0.01 * b)})
    assert all(r.identical and r.new_tokens == 16 for r in free) and all(r.tau >= 2.0 for r in free)
    plain = run_demo(target, drafter, max_new_tokens=16)  # transformers' assisted loop, untrained drafter
    assert all(r.identical for r in plain) and max(r.tau for r in plain) < min(r.tau for r in rows)


def test_demo_rejects_a_negative_branch_width_and_branches_without_lookup_drafts(capsys):
    with pytest.raises(SystemExit):
        demo_main(["--toy", "--branches", "-1"])
    assert "--branches takes a node count >= 0" in capsys.readouterr().err
    from dspark_hf.testbed.demo import prepare_demo

    with pytest.raises(ValueError, match="branches must be an integer >= 0"):
        prepare_demo(toy=True, branches=-2)
    with pytest.raises(ValueError, match="need a registered target's release drafter with lookup=True"):
        prepare_demo(toy=True, branches=4)  # the toy pair has no lookup table: never silently without branches
    with pytest.raises(SystemExit):
        demo_main(["--toy", "--branches", "4"])
    assert "(not --toy, --drafter or --no-lookup)" in capsys.readouterr().err


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
    # greedy: lossless for every policy; only the plain-decoding baseline ("none") has nothing to compare with
    assert all(r["identical_to_target"] is (None if r["policy"] == "none" else True) for r in rows)
    assert all(r["aggregate_tokens_per_s"] > 0 for r in rows)
    assert (tmp_path / "throughput.png").exists() and (tmp_path / "verify_length.png").exists()
    for c in (1, 3):  # per concurrency, profiled in its rounds' layout: c rows of 1 .. block + 1 tokens
        table = json.loads((tmp_path / f"sps-rows{c}.json").read_text())
        assert table["meta"]["rows"] == c and table["batch_tokens"] == [c * w for w in range(1, 5)]


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
    out = capsys.readouterr().out
    assert "release DSpark drafter" in out and "n-gram lookup drafts" in out and "prepacked" in out


def test_bench_with_lookup_drafts_prepacked_linears_and_gqa_attention_stays_lossless(tmp_path):
    import json

    import numpy as np

    from dspark_hf.models.lookup import NgramLookup

    rng = np.random.default_rng(0)
    seqs = [(s, [1] * len(s)) for s in rng.integers(0, 512, size=(20, 40)).tolist()]  # the toy-tiny vocabulary
    NgramLookup.build(seqs, max_order=3, heldout_share=0.0).save(tmp_path / "lookup.safetensors")
    cli_main(["bench", "--target", "toy-tiny", "--drafter", "untrained", "--concurrency", "2", "--policies", "fixed",
              "scheduled", "--max-new-tokens", "6", "--repeats", "1", "--block-size", "3", "--lookup",
              str(tmp_path / "lookup.safetensors"), "--prepack", "--gqa-attention", "--draft-head-dtype", "int8", "--out",
              str(tmp_path / "out")])
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert "lookup=" in data["label"] and "prepacked" in data["label"] and "GQA attention" in data["label"]
    assert all(r["identical_to_target"] is (None if r["policy"] == "none" else True) for r in data["rows"])


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


# ---------------------------------------------------------------- the thin CLI: version, help, parsing, logging

def test_version_prints_the_package_version(capsys):
    import dspark_hf

    for flag in ("--version", "-V"):
        assert cli_main([flag]) == 0
        assert capsys.readouterr().out == f"dspark-hf {dspark_hf.__version__}\n"


def test_help_lists_every_command_and_no_results_command(capsys):
    from dspark_hf.cli import COMMANDS

    assert cli_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in COMMANDS) and "--version" in out
    assert "results" not in COMMANDS and "  results " not in out  # report assembly is scripts/collect_results.py
    assert cli_main(["results"]) == 2
    assert "unknown command 'results'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["demo", "prompts", "data", "train", "training-report", "calibrate", "eval",
                                  "compare", "bench", "bench-head", "release", "fetch-target"])
def test_every_subcommand_help_exits_0(name, capsys):
    from dspark_hf.cli import COMMANDS

    assert name in COMMANDS
    with pytest.raises(SystemExit) as exit_info:
        cli_main([name, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and f"dspark-hf {name}" in out


def test_no_library_module_imports_the_cli():
    """`dspark_hf.cli` imports the subcommand modules; none of them (nor any other library module) imports it back."""
    import subprocess
    import sys

    import ast

    def imports_cli(path: Path) -> bool:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(a.name == "dspark_hf.cli" for a in node.names):
                return True
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if module.split(".")[-1] == "cli" or (node.level and not module and
                                                       any(a.name == "cli" for a in node.names)):
                    return True
        return False

    src = Path(__file__).resolve().parents[1] / "src" / "dspark_hf"
    assert [p.relative_to(src).as_posix() for p in src.rglob("*.py") if p.name != "cli.py" and imports_cli(p)] == []
    code = ("import sys\n"
            "import dspark_hf.evaluation.training_report, dspark_hf.evaluation.throughput, "
            "dspark_hf.evaluation.head_cost, dspark_hf.evaluation.compare, dspark_hf.testbed.demo, "
            "dspark_hf.training.calibration, dspark_hf.training.prompts\n"
            "print('dspark_hf.cli' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_labeled_folders_lives_in_the_library(capsys):
    import argparse

    from dspark_hf import cli
    from dspark_hf.evaluation.labels import labeled_folders, parse_labeled_folders

    assert cli.labeled_folders is labeled_folders  # the CLI uses the library's parser
    assert parse_labeled_folders(["a=x", "b=y=z", "a=w"]) == {"a": "w", "b": "y=z"}
    for bad in ("nolabel", "=folder", "label="):
        with pytest.raises(ValueError, match=f"--run takes LABEL=FOLDER, got '{bad}'"):
            parse_labeled_folders([bad], "--run")
    parser = argparse.ArgumentParser(prog="x")
    with pytest.raises(SystemExit) as exit_info:
        labeled_folders(parser, "--drafter", ["oops"])
    assert exit_info.value.code == 2 and "--drafter takes LABEL=FOLDER" in capsys.readouterr().err


def test_bad_arguments_are_usage_errors_before_anything_loads(capsys, tmp_path):
    from dspark_hf.evaluation.compare import parse_stock_pair

    assert parse_stock_pair("big:small") == ("big", "small")
    with pytest.raises(ValueError, match="--stock takes TARGET:ASSISTANT"):
        parse_stock_pair("big")
    missing = str(tmp_path / "does-not-exist")
    cases = [
        (["compare", "--target", missing, "--drafter", "a=" + missing, "--stock", "nocolon"], "--stock takes"),
        (["compare", "--target", missing, "--drafter", "nolabel"], "--drafter takes LABEL=FOLDER"),
        (["compare", "--target", missing, "--lookup-branches", "8"], "--lookup-branches takes a node count"),
        (["training-report", "--run", "nolabel"], "--run takes LABEL=FOLDER"),
        (["calibrate", "--drafter", missing, "--target", missing, "--prompts", missing, "--fit-fraction", "0"],
         "--fit-fraction must be in (0, 1]"),
        (["bench", "--do-sample"], "supports greedy decoding only"),
        (["demo", "--target", missing], "no release drafter"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            cli_main(argv)
        assert exit_info.value.code == 2, argv
        assert message in capsys.readouterr().err, argv


def test_progress_goes_to_stderr_through_the_dspark_hf_loggers(tmp_path, capsys):
    import logging

    from dspark_hf.logging_utils import configure_logging
    from transformers.utils.logging import get_logger

    root = logging.getLogger("dspark_hf")
    level, handlers = root.level, list(root.handlers)
    try:
        configure_logging()
        configure_logging()  # idempotent: one handler
        assert len(root.handlers) - len(handlers) <= 1
        get_logger("dspark_hf.testbed.targets").info("toy ready in /tmp/x")
        get_logger("dspark_hf.testbed.targets").warning("no pinned sha256")
        err = capsys.readouterr().err
        assert "[dspark_hf.testbed.targets] toy ready in /tmp/x" in err
        assert "[dspark_hf.testbed.targets] WARNING: no pinned sha256" in err
        configure_logging("warning")
        get_logger("dspark_hf.testbed.targets").info("hidden")
        assert "hidden" not in capsys.readouterr().err
        configure_logging("info")
        # a command: its result on stdout, its progress lines on stderr
        cli_main(["bench-head", "--sizes", "tiny", "--heads", "markov", "--block-sizes", "2", "--candidates", "0",
                  "--repeats", "1", "--out", str(tmp_path)])
        captured = capsys.readouterr()
        assert captured.out.strip() == f"wrote {tmp_path / 'head_cost.json'} and {tmp_path / 'head_cost.md'}"
        assert "[dspark_hf.evaluation.head_cost]" in captured.err and "parallel" in captured.err
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers


def test_public_modules_declare_all():
    """Every library module (except those owned elsewhere) lists its public names in `__all__`, and they exist."""
    import importlib
    import pkgutil

    import dspark_hf

    skip = {"dspark_hf.decoding.batched", "dspark_hf.training.trainer", "dspark_hf.training.losses"}
    missing, broken = [], []
    for info in pkgutil.walk_packages(dspark_hf.__path__, "dspark_hf."):
        name = info.name
        if name in skip or name.startswith("dspark_hf.models") or info.ispkg:
            continue
        module = importlib.import_module(name)
        names = getattr(module, "__all__", None)
        if names is None:
            missing.append(name)
            continue
        broken += [f"{name}.{n}" for n in names if not hasattr(module, n)]
    assert missing == [] and broken == []
