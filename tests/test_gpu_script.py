"""scripts/gpu_qwen_coder_1p5b.py end to end on tiny random models on the CPU: the same code a GPU lease runs."""

import json
from pathlib import Path

import pytest

from conftest import load_script, make_drafter, make_target, make_tokenizer



def _script():
    return load_script("gpu_qwen_coder_1p5b")


@pytest.fixture
def models(tmp_path):
    """A tiny target, a tiny draft model of the same tokenizer, a drafter of the target, and prompt files."""
    target, tok = make_target("llama"), make_tokenizer()
    for name, model in (("target", target), ("assistant", make_target("llama", seed=5))):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    words = lambda i: " ".join(f"w{4 + (i * 7 + j) % 90}" for j in range(6))  # noqa: E731
    prompts = {"format": _script().PROMPTS_FORMAT, "limit": 2, "sets": {
        name: [{"id": f"{name}/{i}", "dataset": name, "messages": [{"role": "user", "content": words(i + k)}],
                "reference": None} for i in range(2)] for k, name in enumerate(("humaneval", "mt_bench"))}}
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    (tmp_path / "train.jsonl").write_text("".join(
        json.dumps({"id": f"t{i}", "messages": [{"role": "user", "content": words(10 + i)}]}) + "\n"
        for i in range(6)))
    return tmp_path


COMMON = ["--prompts", "prompts.json", "--datasets", "humaneval,mt_bench", "--device", "cpu", "--max-new-tokens", "6",
          "--speed-prompts", "1", "--tau-prompts", "2", "--batch-size", "2", "--prompt-lookup", "3"]


def _run(script, root: Path, argv: list[str]) -> int:
    return script.main([a if not a.endswith((".json", ".jsonl")) else str(root / a) for a in argv])


def test_lease_script_compares_every_method_on_the_same_target(models):
    script = _script()
    out = models / "out"
    rc = _run(script, models, ["--target", str(models / "target"), "--assistant", str(models / "assistant"),
                               "--drafter", str(models / "drafter"), "--out", str(out), *COMMON])
    assert rc == 0
    assert {p.name for p in out.iterdir()} <= set(script.OUT_FILES) and len(list(out.iterdir())) <= 8
    comp = json.loads((out / "compare.json").read_text())
    assert comp["methods"] == ["target-only", "prompt-lookup", "assisted", "dspark"]
    rows = {(r["method"], r["dataset"]): r for r in comp["results"]}
    for method in comp["methods"]:
        for dataset in ("humaneval", "mt_bench"):
            speed = rows[method, dataset]["speed"]
            assert speed["identical"] is True and speed["prompts"] == 1  # fp32 on the CPU: exactly lossless
            assert speed["speedup"] == pytest.approx(speed["speculative_tokens_per_s"] / speed["target_tokens_per_s"])
    run = json.loads((out / "gpu_run.json").read_text())
    assert run["status"] == "finished" and [p["phase"] for p in run["phases"]] == ["check", "load", "compare"]
    md = (out / "gpu_run.md").read_text()
    assert "| humaneval | prompt-lookup | 1 |" in md and "| mt_bench | assisted | 1 |" in md and "finished" in md


def test_lease_script_trains_a_drafter_with_the_package_trainer_then_compares(models):
    script = _script()
    out = models / "out"
    rc = _run(script, models, ["--target", str(models / "target"), "--out", str(out), "--work", str(models / "work"),
                               "--train-steps", "2", "--train-prompts", "train.jsonl", "--train-examples", "4",
                               "--answer-tokens", "8", "--data-batch-size", "4", "--block-size", "4",
                               "--markov-rank", "8", "--draft-vocab-size", "0", "--train-batch-size", "2",
                               "--num-anchors", "4", "--max-length", "64", *COMMON])
    assert rc == 0
    run = json.loads((out / "gpu_run.json").read_text())
    assert [p["phase"] for p in run["phases"]] == ["check", "load", "data", "train", "compare"]
    data, train = run["phases"][2], run["phases"][3]
    assert data["generated"] is True and data["examples"] == 4 and data["answer_tokens"] > 0
    assert train["steps"] == 2 and Path(train["drafter"], "config.json").is_file()
    assert [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()][-1] == 2
    comp = json.loads((out / "compare.json").read_text())
    assert comp["methods"] == ["target-only", "prompt-lookup", "dspark"]
    assert all(r["speed"]["identical"] for r in comp["results"])


def test_lease_script_fails_fast_and_clearly_on_missing_inputs(models, monkeypatch, capsys):
    script = _script()
    out = models / "out"
    missing = str(models / "no-such-model")
    assert _run(script, models, ["--target", missing, "--out", str(out), *COMMON]) == 2
    err = capsys.readouterr().err
    assert missing in err and "does not exist" in err
    run = json.loads((out / "gpu_run.json").read_text())
    assert run["status"] == "failed" and missing in run["error"] and run["phases"] == []
    # a registered target that this machine has not fetched: nothing is downloaded, the message says what to do
    monkeypatch.setenv("DSPARK_HF_CACHE", str(models / "empty-cache"))
    assert _run(script, models, ["--target", "qwen2.5-coder-1.5b-instruct", "--out", str(out), *COMMON]) == 2
    assert "dspark-hf fetch-target qwen2.5-coder-1.5b-instruct" in capsys.readouterr().err
    (models / "empty").mkdir()
    assert _run(script, models, ["--target", str(models / "target"), "--drafter", str(models / "empty"),
                                 "--out", str(out), *COMMON]) == 2
    assert "has no config.json and no *.safetensors weights" in capsys.readouterr().err
    assert _run(script, models, ["--target", str(models / "target"), "--out", str(out), *COMMON[:2],
                                 "--datasets", "humaneval,aime", *COMMON[4:]]) == 2
    assert "has no prompts for ['aime']" in capsys.readouterr().err
    assert _run(script, models, ["--target", str(models / "target"), "--assistant", str(models / "target"),
                                 "--out", str(out), *COMMON]) == 2
    assert "is the target itself" in capsys.readouterr().err
