"""scripts/gpu_train_drafters.py end to end on tiny random models on the CPU: prepare (GGUF parts, held-out prompt
ids, fingerprint), run (workers side by side under a time budget, export, pack into <= 15 MiB parts) and unpack."""

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from conftest import load_script, learnable_examples, make_target, make_tokenizer



def _script():
    return load_script("gpu_train_drafters")


@pytest.fixture
def lease(tmp_path):
    target, tok = make_target("llama"), make_tokenizer()
    target.generation_config.pad_token_id = 0
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    data = tmp_path / "data"
    data.mkdir()
    (data / "data-00000.jsonl").write_text("".join(
        json.dumps({**asdict(e), "source": "t"}) + "\n" for e in learnable_examples(target, count=60)))
    (tmp_path / "prompts.jsonl").write_text("".join(
        json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"w{5 + i} w{9 + i} w{20 + i}"}]}) + "\n"
        for i in range(3)))
    (tmp_path / "fake.gguf").write_bytes(bytes(range(256)) * 50)  # 12,800 bytes: cut into 3 parts of 5,000
    return tmp_path


def _prepare(script, root: Path) -> dict:
    rc = script.main(["prepare", "--target", str(root / "target"), "--gguf", str(root / "fake.gguf"),
                      "--eval-prompts", str(root / "prompts.jsonl"), "--eval-num-prompts", "2",
                      "--part-mb", str(5000 / 1024 / 1024), "--out", str(root / "gpu")])
    assert rc == 0
    return json.loads((root / "gpu" / "manifest.json").read_text())


def test_prepare_cuts_the_gguf_and_assemble_checks_every_part(lease):
    script = _script()
    manifest = _prepare(script, lease)
    assert manifest["parts"] == ["target.gguf.part00", "target.gguf.part01", "target.gguf.part02"]
    assert len(manifest["eval_prompt_ids"]) == 2 and all(manifest["eval_prompt_ids"])
    assert manifest["fingerprint"] == script.tensor_fingerprint(lease / "target")
    # the parts may sit in several folders (one per lease call): found and joined in order
    other = lease / "call1"
    other.mkdir()
    (lease / "gpu" / "target.gguf.part00").rename(other / "target.gguf.part00")
    gguf = script._assemble(manifest, [other, lease / "gpu"], lease / "joined")
    assert gguf.read_bytes() == (lease / "fake.gguf").read_bytes()
    (other / "target.gguf.part00").unlink()
    with pytest.raises(script.InputError, match="parts missing.*part00"):
        script._assemble(manifest, [other, lease / "gpu"], lease / "joined")
    (other / "target.gguf.part00").write_bytes(b"x" * 5000)
    with pytest.raises(script.InputError, match="sha256"):
        script._assemble(manifest, [other, lease / "gpu"], lease / "joined")


def test_fingerprint_sees_one_changed_weight(lease):
    script = _script()
    before = script.tensor_fingerprint(lease / "target")
    model = make_target("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 4] += 1e-6
    model.save_pretrained(lease / "changed")
    assert script.tensor_fingerprint(lease / "changed") != before


def test_run_trains_the_runs_side_by_side_and_unpack_gives_loadable_drafters(lease, monkeypatch):
    from dspark_hf import DSparkDrafter

    script = _script()
    _prepare(script, lease)
    out = lease / "OUT"
    monkeypatch.setattr(script, "PACK_PART_BYTES", 200_000)  # several parts, as the real drafters need
    rc = script.main(["run", "--manifest", str(lease / "gpu" / "manifest.json"), "--target-dir",
                      str(lease / "target"), "--data", str(lease / "data"), "--runs", "dspark,dflash",
                      "--out", str(out), "--work", str(lease / "work"), "--budget", "6", "--batch-size", "4",
                      "--num-anchors", "8", "--eval-every", "5", "--save-every", "1000", "--threads", "1",
                      "--report-every", "1", "--device", "cpu", "--set", "alpha_ce=1.0", "--set", "markov_rank=24"])
    assert rc == 0, (lease / "work" / "dspark" / "worker.log").read_text()[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and "summary.json" in files and "drafters.tar.part01" in files
    assert all((out / f).stat().st_size <= 16 * 1024 * 1024 for f in files)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["phases"]["target"]["fingerprint_ok"] is True
    for name in ("dspark", "dflash"):
        run = summary["runs"][name]
        assert run["steps"] >= 1 and run["packed"].startswith("yes")
        assert run["worker"]["ok"] is True and run["worker"]["plans"], run  # the budget re-planned max_steps
        assert run["heldout_tau"] and run["heldout_tau"][-1] >= 1.0
    dest = lease / "drafters"
    assert script.main(["unpack", "--files", str(out), "--dest", str(dest)]) == 0
    target = make_target("llama")
    for name, head in (("dspark", "markov"), ("dflash", "none")):
        drafter = DSparkDrafter.from_pretrained(dest / name, target=target)
        assert drafter.config.sequential_head == head
        trained = json.loads((dest / name / "training_config.json").read_text())["config"]
        assert trained["alpha_ce"] == 1.0 and trained["markov_rank"] == 24  # --set reached every run
        assert (dest / name / "log.jsonl").exists() and (dest / name / "heldout.jsonl").exists()
    assert drafter_rank(dest / "dspark") == 24
    assert summary["phases"]["workers started"]["settings"] == {"alpha_ce": 1.0, "markov_rank": 24}
    # a damaged part is refused, not unpacked into a half-written folder
    (out / "drafters.tar.part00").write_bytes(b"broken")
    assert script.main(["unpack", "--files", str(out), "--dest", str(lease / "again")]) == 2
    assert not (lease / "again").exists()


def drafter_rank(folder: Path) -> int:
    return json.loads((folder / "config.json").read_text())["markov_rank"]


@pytest.mark.parametrize("item, message", [
    ("batch_size=8", "set by --batch-size"),
    ("alpha=1.0", "not a training-config field"),
    ("alpha_ce", "expected KEY=VALUE"),
    ("teacher_topk=0", "teacher_topk must be >= 1"),
])
def test_run_refuses_a_bad_setting_before_any_model_loads(lease, capsys, item, message):
    script = _script()
    _prepare(script, lease)
    rc = script.main(["run", "--manifest", str(lease / "gpu" / "manifest.json"), "--target-dir",
                      str(lease / "target"), "--data", str(lease / "data"), "--runs", "dspark", "--out",
                      str(lease / "OUT"), "--work", str(lease / "work"), "--device", "cpu", "--set", item])
    assert rc == 2 and message in capsys.readouterr().err
    assert not (lease / "work").exists()  # refused before the target was read or a worker started


def test_run_refuses_a_target_that_is_not_the_cpus(lease):
    script = _script()
    _prepare(script, lease)
    make_target("llama", seed=3).save_pretrained(lease / "other")
    rc = script.main(["run", "--manifest", str(lease / "gpu" / "manifest.json"), "--target-dir", str(lease / "other"),
                      "--data", str(lease / "data"), "--runs", "dspark", "--out", str(lease / "OUT"),
                      "--work", str(lease / "work"), "--device", "cpu"])
    assert rc == 2
    assert json.loads((lease / "OUT" / "summary.json").read_text())["phases"]["target"]["fingerprint_ok"] is False


def test_smoke_runs_every_preset_on_a_tiny_target(tmp_path):
    script = _script()
    out = tmp_path / "OUT"
    assert script.main(["smoke", "--out", str(out), "--work", str(tmp_path / "smoke"), "--budget", "3",
                        "--device", "cpu"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["runs"]) == {"dspark", "dflash", "dspark-2l"}
    assert summary["phases"]["generate"]["answered"] == 24  # the held-out id among the 25 prompts is not answered
    assert summary["generated"]["packed"].startswith("yes")
    for run in summary["runs"].values():
        assert run["worker"]["ok"] and run["worker"]["excluded_heldout_examples"] == 2  # s0, s1
        assert run["packed"].startswith("yes") and run["heldout_tau"]


def test_prepare_lists_the_unanswered_prompts_as_ids_and_run_answers_them_before_training(lease):
    import gzip

    from dspark_hf.training.data import GenerationRecipe, chat_prompt_ids, generate_responses, read_examples

    script = _script()
    tok = make_tokenizer()
    train = [{"id": f"t{i}", "messages": [{"role": "user", "content": f"w{30 + i} w{40 + i}"}], "source": "s"}
             for i in range(6)] + [{"id": "p0", "messages": [{"role": "user", "content": "w7"}]}]  # p0 is held out
    (lease / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    answered = lease / "answered"
    answered.mkdir()
    (answered / "data-00000.jsonl").write_text(json.dumps({"id": "t0", "input_ids": [1, 2], "loss_mask": [0, 1]}) + "\n")
    rc = script.main(["prepare", "--target", str(lease / "target"), "--gguf", str(lease / "fake.gguf"),
                      "--eval-prompts", str(lease / "prompts.jsonl"), "--eval-num-prompts", "2",
                      "--part-mb", "1", "--out", str(lease / "gpu"), "--generate-prompts", str(lease / "train.jsonl"),
                      "--generate-skip", str(answered)])
    assert rc == 0
    manifest = json.loads((lease / "gpu" / "manifest.json").read_text())
    assert manifest["generate"]["prompts"] == 5 and manifest["generate"]["left_out"] == 2
    with gzip.open(lease / "gpu" / "generate.jsonl.gz", "rt") as handle:
        rows = [json.loads(line) for line in handle]
    assert [r["id"] for r in rows] == [f"t{i}" for i in range(1, 6)]
    assert rows[0]["prompt_ids"] == chat_prompt_ids(tok, train[1]["messages"])

    # generation only: a --hard-stop that leaves no time to train skips the runs and still returns the answers
    out = lease / "OUT"
    rc = script.main(["run", "--manifest", str(lease / "gpu" / "manifest.json"), "--target-dir", str(lease / "target"),
                      "--data", str(lease / "data"), "--runs", "dspark", "--out", str(out), "--work",
                      str(lease / "work"), "--device", "cpu", "--generate", str(lease / "gpu" / "generate.jsonl.gz"),
                      "--generate-batch-size", "2", "--generate-max-new-tokens", "6", "--hard-stop", "5"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["phases"]["generate"]["answered"] == 5 and "train skipped" in summary["phases"]
    assert script.main(["unpack", "--files", str(out), "--dest", str(lease / "back"),
                        "--data-dest", str(lease / "data-gpu")]) == 0
    got = read_examples(lease / "data-gpu")
    # the same answers the CPU path gives from the messages, with the tokenizer
    target = make_target("llama")
    target.generation_config.pad_token_id = 0
    generate_responses(target, tok, train[1:6], lease / "reference", GenerationRecipe(max_new_tokens=6, batch_size=2),
                       progress=False)
    assert sorted(e.to_json() for e in got) == sorted(e.to_json() for e in read_examples(lease / "reference"))
    assert script.main(["unpack", "--files", str(out), "--dest", str(lease / "back2"),
                        "--data-dest", str(lease / "data-gpu")]) == 2  # never over an existing folder
    assert not (lease / "back2").exists()

    # with time to train, the runs train on the generated answers too (listed first)
    rc = script.main(["run", "--manifest", str(lease / "gpu" / "manifest.json"), "--target-dir", str(lease / "target"),
                      "--data", str(lease / "data"), "--runs", "dspark", "--out", str(lease / "OUT2"), "--work",
                      str(lease / "work"), "--device", "cpu", "--generate", str(lease / "gpu" / "generate.jsonl.gz"),
                      "--generate-batch-size", "2", "--generate-max-new-tokens", "6", "--budget", "3",
                      "--batch-size", "4", "--num-anchors", "8", "--eval-every", "1000", "--threads", "1"])
    assert rc == 0
    summary = json.loads((lease / "OUT2" / "summary.json").read_text())
    assert summary["phases"]["workers started"]["data"].split(",") == [str(lease / "work" / "generated"),
                                                                        str(lease / "data")]
    from dspark_hf.training.trainer import split_examples

    both = [e for e in read_examples([lease / "work" / "generated", lease / "data"])
            if e.id not in set(manifest["exclude_ids"])]
    assert len(both) == 65  # 60 learnable examples + the 5 answers
    assert summary["runs"]["dspark"]["worker"]["train_examples"] == len(split_examples(both, 0.02)[0])

    # a generation file that is not the one the manifest names is refused
    with gzip.open(lease / "gpu" / "generate.jsonl.gz", "at") as handle:
        handle.write(json.dumps({"id": "x", "prompt_ids": [3]}) + "\n")
    assert script.main(["run", "--manifest", str(lease / "gpu" / "manifest.json"), "--target-dir",
                        str(lease / "target"), "--data", str(lease / "data"), "--runs", "", "--out",
                        str(lease / "OUT3"), "--work", str(lease / "work3"), "--device", "cpu",
                        "--generate", str(lease / "gpu" / "generate.jsonl.gz")]) == 2


def test_slim_branch_holds_the_package_without_releases_and_leaves_the_checkout_alone(tmp_path):
    import shutil
    import subprocess

    repo = tmp_path / "repo"
    for rel, text in {"src/dspark_hf/a.py": "x = 1\n", "src/dspark_hf/testbed/releases/r/model.bin": "w" * 1000,
                      "scripts/gpu_train_drafters.py": "# lease\n", "scripts/other.py": "# not sent\n",
                      "setup.cfg": "[metadata]\n", "data/d1/data-00000.jsonl": "{}\n", "data/d2/data-00000.jsonl": "{}\n",
                      "results/big.json": "r" * 5000}.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "all"], check=True)
    (repo / "untracked.txt").write_text("u" * 10)
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_slim_branch.sh"
    shutil.copy(script, repo / "slim.sh")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": "/usr/bin:/bin"}
    res = subprocess.run(["bash", "slim.sh", "lease", "data/d1"], cwd=repo, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    files = subprocess.run(git + ["ls-tree", "-r", "--name-only", "lease"], capture_output=True, text=True).stdout.split()
    assert sorted(files) == ["data/d1/data-00000.jsonl", "scripts/gpu_train_drafters.py", "setup.cfg",
                             "src/dspark_hf/a.py"]
    assert "untracked files not ignored by git travel too" in res.stdout and "fits" in res.stdout
    status = subprocess.run(git + ["status", "--porcelain"], capture_output=True, text=True).stdout.split("\n")
    assert sorted(s for s in status if s) == ["?? slim.sh", "?? untracked.txt"]  # work tree and index untouched
    res = subprocess.run(["bash", "slim.sh", "lease", "data/missing"], cwd=repo, capture_output=True, text=True, env=env)
    assert res.returncode == 2 and "data/missing not found" in res.stderr


def test_prepare_answers_several_prompt_files_in_their_order(lease):
    """`--generate-prompts a.jsonl,b.jsonl`: a's prompts first (the evaluation-form prompts go before the rest), an id
    in both kept once, a missing file named."""
    import gzip

    script = _script()
    first = [{"id": f"e{i}", "messages": [{"role": "user", "content": f"w{50 + i}"}]} for i in range(2)]
    rest = [{"id": "e1", "messages": [{"role": "user", "content": "w51"}]},
            {"id": "t0", "messages": [{"role": "user", "content": "w60 w61"}]}]
    for name, rows in (("first.jsonl", first), ("rest.jsonl", rest)):
        (lease / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["prepare", "--target", str(lease / "target"), "--gguf", str(lease / "fake.gguf"), "--eval-prompts",
              str(lease / "prompts.jsonl"), "--eval-num-prompts", "2", "--part-mb", "1", "--out", str(lease / "gpu")]
    assert script.main(common + ["--generate-prompts", f"{lease / 'first.jsonl'},{lease / 'rest.jsonl'}"]) == 0
    with gzip.open(lease / "gpu" / "generate.jsonl.gz", "rt") as handle:
        assert [json.loads(line)["id"] for line in handle] == ["e0", "e1", "t0"]
    assert script.main(common + ["--generate-prompts", f"{lease / 'first.jsonl'},{lease / 'gone.jsonl'}"]) != 0
