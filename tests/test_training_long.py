"""Training at length: the long-run learning-rate schedule, draft layers initialised from the target, held-out tau
measured along the way, and training time carried across resumes."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import load_script, batch_oracle, learnable_examples, make_target
from dspark_hf.training.config import DSparkTrainingConfig
from dspark_hf.training.trainer import (DSparkTrainer, build_drafter, build_lr_scheduler, heldout_prompt_ids,
                                        heldout_tau, init_layers_from_target)


def tiny_config(tmp_path, **kw) -> DSparkTrainingConfig:
    base = dict(output_dir=str(tmp_path / "run"), max_steps=6, batch_size=4, num_anchors=8, block_size=4,
                markov_rank=16, learning_rate=3e-3, warmup_steps=2, save_every=1000, log_every=1, resume=False,
                heldout_fraction=0.1, draft_candidates=None)
    base.update(kw)
    return DSparkTrainingConfig(**base)


def _multipliers(cfg: DSparkTrainingConfig, steps: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_lr_scheduler(opt, cfg)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def test_wsd_schedule_warms_up_holds_then_decays_to_the_floor(tmp_path):
    cfg = tiny_config(tmp_path, lr_schedule="wsd", warmup_steps=4, max_steps=20, decay_fraction=0.25, min_lr_ratio=0.1)
    lr = _multipliers(cfg, 21)
    assert lr[:4] == pytest.approx([0.0, 0.25, 0.5, 0.75])
    assert lr[4:15] == pytest.approx([1.0] * 11)  # stable until step 15 = 20 - 5
    assert lr[15:] == pytest.approx([1.0, 0.82, 0.64, 0.46, 0.28, 0.1])
    # a longer run (resumed with a larger max_steps) is still in its stable phase where the short one decayed
    longer = _multipliers(tiny_config(tmp_path, lr_schedule="wsd", warmup_steps=4, max_steps=200,
                                      decay_fraction=0.25, min_lr_ratio=0.1), 21)
    assert longer[4:21] == pytest.approx([1.0] * 17)
    assert _multipliers(tiny_config(tmp_path, lr_schedule="constant", warmup_steps=2), 5) == pytest.approx(
        [0.0, 0.5, 1.0, 1.0, 1.0])


def test_schedule_settings_are_validated(tmp_path):
    with pytest.raises(ValueError, match="lr_schedule"):
        tiny_config(tmp_path, lr_schedule="linear")
    with pytest.raises(ValueError, match="decay_fraction"):
        tiny_config(tmp_path, lr_schedule="wsd", decay_fraction=0.0)
    with pytest.raises(ValueError, match="eval_num_prompts"):
        tiny_config(tmp_path, eval_num_prompts=0)


def test_draft_layers_start_as_copies_of_the_target_layers(tmp_path):
    target = make_target("qwen3")  # Qwen3 layers have q/k norms too: every draft-layer parameter has a twin
    cfg = tiny_config(tmp_path, num_hidden_layers=2, init_layers_from_target=[-1, 1])
    drafter = build_drafter(cfg, target)
    for i, lid in enumerate([-1, 1]):
        source = dict(target.model.layers[lid].named_parameters())
        for name, param in drafter.layers[i].named_parameters():
            assert torch.equal(param, source[name]), (i, name)
    llama = make_target("llama")  # no q/k norms in Llama: those keep their init, the rest is copied
    d = build_drafter(tiny_config(tmp_path), llama)
    copied = init_layers_from_target(d, llama, [2])
    assert "self_attn.q_proj.weight" in copied[0] and "mlp.down_proj.weight" in copied[0]
    assert "self_attn.q_norm.weight" not in copied[0]
    assert torch.equal(d.layers[0].mlp.up_proj.weight, llama.model.layers[2].mlp.up_proj.weight)
    with pytest.raises(ValueError, match="out of range"):
        init_layers_from_target(d, llama, [7])
    with pytest.raises(ValueError, match="lists 2 layers"):
        init_layers_from_target(d, llama, [0, 1])


def test_heldout_tau_counts_emitted_tokens_per_round(tmp_path):
    """An oracle whose drafts are always right emits block + 1 = 5 tokens a round: 12 tokens per row take rounds of
    5, 5 and the rest, and the first token comes from the prefill, so tau is exactly 11 / 3 for each row."""
    target = make_target("llama")
    prompts = [[5, 9, 13, 7], [22, 3, 8, 41, 17, 6]]
    oracle = batch_oracle(target, prompts, max_new_tokens=12, correct=4)
    result = heldout_tau(target, oracle, prompts, max_new_tokens=12)
    assert result["heldout_rounds"] == 6
    assert result["heldout_tau"] == pytest.approx(11 / 3)
    assert result["heldout_accept@1"] == pytest.approx(1.0)
    wrong = batch_oracle(target, prompts, max_new_tokens=12, correct=0)
    assert heldout_tau(target, wrong, prompts, max_new_tokens=12)["heldout_tau"] == pytest.approx(1.0)


def test_training_logs_heldout_tau_and_keeps_training_time_across_a_resume(tmp_path):
    target = make_target("llama")
    examples = learnable_examples(target, count=40)

    def run(max_steps: int, resume: bool) -> DSparkTrainer:
        cfg = tiny_config(tmp_path, max_steps=max_steps, save_every=3, resume=resume, eval_every=3,
                          eval_num_prompts=3, eval_max_new_tokens=6)
        torch.manual_seed(0)
        trainer = DSparkTrainer(cfg, target, examples, drafter=build_drafter(cfg, target), progress=False)
        trainer.train()
        return trainer

    first = run(3, False)
    assert len(first.eval_prompt_ids) == 3
    assert first.eval_prompt_ids == heldout_prompt_ids(first.heldout, 3)
    assert all(len(p) == 8 for p in first.eval_prompt_ids)  # the prompt part only (learnable_examples: 8 tokens)
    second = run(6, True)
    records = [json.loads(line) for line in (tmp_path / "run" / "heldout.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 6]
    assert all(1.0 <= r["heldout_tau"] <= 5.0 and r["heldout_prompts"] == 3 for r in records)
    # training time accumulates over the two sessions and is logged with every record
    assert second.train_seconds > first.train_seconds > 0
    assert records[1]["train_seconds"] == pytest.approx(second.train_seconds)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    seconds = [r["train_seconds"] for r in log]
    assert seconds == sorted(seconds) and seconds[3] > seconds[2]
    # so does the steps' process CPU time, which other jobs on the cores do not inflate
    assert second.train_cpu_seconds > first.train_cpu_seconds > 0
    assert records[1]["train_cpu_seconds"] == pytest.approx(second.train_cpu_seconds)
    cpu = [r["train_cpu_seconds"] for r in log]
    assert cpu == sorted(cpu) and cpu[3] > cpu[2]
    # a checkpoint written before CPU time was kept: resumed, the run stops reporting it rather than undercount
    state_path = tmp_path / "run" / "checkpoint-000006" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    state.pop("train_cpu_seconds")
    state_path.write_text(json.dumps(state))
    third = run(7, True)
    assert third.train_cpu_seconds is None
    last = json.loads((tmp_path / "run" / "log.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 7 and "train_cpu_seconds" not in last and last["train_seconds"] > seconds[-1]
    # the last record's held-out tau is the final drafter's
    again = heldout_tau(target, second.drafter.eval(), second.eval_prompt_ids, 6)
    assert records[-1]["heldout_tau"] == pytest.approx(again["heldout_tau"])


def _script(name: str):
    return load_script(name)


def test_heldout_tau_script_merges_separate_measurements_and_refuses_mismatched_settings(tmp_path):
    script = _script("heldout_tau")
    settings = {"target": "t", "prompts": "p.jsonl", "num_prompts": 24, "max_new_tokens": 64,
                "provenance": {"device": "cpu", "torch": "x"}}
    for label, tau in (("base", 1.25), ("noinit", 1.125)):
        (tmp_path / f"{label}.json").write_text(json.dumps({**settings, "results": {label: {
            "heldout_tau": tau, "heldout_accept@1": tau - 1, "heldout_rounds": 100}}}))
    merged = script.main(["--merge", str(tmp_path / "base.json"), str(tmp_path / "noinit.json"),
                          "--out", str(tmp_path / "out" / "all.json")])
    assert list(merged["results"]) == ["base", "noinit"] and merged["num_prompts"] == 24
    md = (tmp_path / "out" / "all.md").read_text()
    assert "| base | 1.250 | 0.250 | 100 |" in md and "| noinit | 1.125 | 0.125 | 100 |" in md and "num_prompts=24" in md
    (tmp_path / "other.json").write_text(json.dumps({**settings, "num_prompts": 8, "results": {"x": {
        "heldout_tau": 1.0, "heldout_accept@1": 0.0, "heldout_rounds": 1}}}))
    with pytest.raises(SystemExit):
        script.main(["--merge", str(tmp_path / "base.json"), str(tmp_path / "other.json")])
    with pytest.raises(SystemExit):
        script.main(["--merge", str(tmp_path / "base.json"), str(tmp_path / "base.json")])  # a label twice
    with pytest.raises(SystemExit):
        script.main(["--drafter", f"x={tmp_path / 'missing'}"])  # no target


def test_heldout_tau_by_source_pools_to_what_one_call_on_every_prompt_counts():
    """`scripts/heldout_tau.py --by-source` measures each source family apart and pools them into the drafter's row:
    tau over all rounds, first-draft acceptance over all verifying rounds, the same as one call on every prompt."""
    script = _script("heldout_tau")
    target = make_target("llama")
    prompts = [[5, 9, 13, 7], [22, 3, 8, 41, 17, 6], [30, 31, 2], [11, 12, 13, 14, 15]]
    correct = [4, 0, 2, 1]  # drafts right per round, per row (the oracle knows its rows by position)
    whole = heldout_tau(target, batch_oracle(target, prompts, 10, correct), prompts, max_new_tokens=10)
    parts = [heldout_tau(target, batch_oracle(target, prompts[:1], 10, correct[:1]), prompts[:1], max_new_tokens=10),
             heldout_tau(target, batch_oracle(target, prompts[1:], 10, correct[1:]), prompts[1:], max_new_tokens=10)]
    assert parts[0]["heldout_tau"] != pytest.approx(parts[1]["heldout_tau"])  # the pooling has something to weigh
    pooled = script.pool(parts)
    for key in ("heldout_tau", "heldout_accept@1"):
        assert pooled[key] == pytest.approx(whole[key])
    assert pooled["heldout_rounds"] == whole["heldout_rounds"] and pooled["heldout_prompts"] == 4
    assert script.pool(parts[:1]) == parts[0]


class _FakeClock:
    """perf_counter for the trainer module: each optimizer step costs `pace` seconds (advanced by the test's hook)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def process_time(self) -> float:
        return self.now

    def __getattr__(self, name):  # everything else from the real module
        import time

        return getattr(time, name)


def _budget_run(tmp_path, monkeypatch, pace: float, **kw):
    import dspark_hf.training.trainer as trainer_module

    clock = _FakeClock()
    monkeypatch.setattr(trainer_module, "time", clock)
    target = make_target("llama")
    cfg = tiny_config(tmp_path, lr_schedule="wsd", warmup_steps=2, decay_fraction=0.25, **kw)
    trainer = DSparkTrainer(cfg, target, learnable_examples(target, count=40), progress=False)
    real_compute = trainer.compute_loss
    lrs = []

    def compute(examples, index):
        clock.now += pace
        lrs.append(trainer.optimizer.param_groups[0]["lr"])
        return real_compute(examples, index)

    trainer.compute_loss = compute
    trainer.train()
    return trainer, lrs


def test_time_budget_replans_max_steps_so_the_wsd_decay_ends_at_the_budget(tmp_path, monkeypatch):
    # 2 s a step, a 60 s budget: about 30 steps, far below max_steps=1000, and the schedule decays to its floor
    trainer, lrs = _budget_run(tmp_path, monkeypatch, pace=2.0, max_steps=1000, time_budget_seconds=60.0,
                               min_lr_ratio=0.0)
    assert 27 <= trainer.step <= 31, trainer.step
    assert trainer.config.max_steps == trainer.step
    assert trainer.budget_plans and trainer.budget_plans[0]["max_steps"] < 1000
    peak = 3e-3
    assert max(lrs) == pytest.approx(peak)
    assert lrs[-1] < 0.2 * peak  # the last step ran near the end of the decay, not at the peak
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == trainer.step
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()


def test_time_budget_never_passes_max_steps_and_refuses_a_cosine_schedule(tmp_path, monkeypatch):
    trainer, _ = _budget_run(tmp_path, monkeypatch, pace=0.01, max_steps=12, time_budget_seconds=600.0)
    assert trainer.step == 12  # the budget would allow 60,000 steps: max_steps is the upper limit
    with pytest.raises(ValueError, match="cosine"):
        tiny_config(tmp_path, lr_schedule="cosine", time_budget_seconds=10.0)
    with pytest.raises(ValueError, match="time_budget_seconds"):
        tiny_config(tmp_path, lr_schedule="wsd", time_budget_seconds=0.0)


def test_a_replanned_schedule_continues_from_the_current_step(tmp_path):
    cfg = tiny_config(tmp_path, lr_schedule="wsd", warmup_steps=4, max_steps=20, decay_fraction=0.25, min_lr_ratio=0.1)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    build_lr_scheduler(opt, cfg)  # sets initial_lr, as the trainer's first schedule does
    sched = build_lr_scheduler(opt, cfg, last_step=16)
    assert sched.get_last_lr()[0] == pytest.approx(_multipliers(cfg, 17)[16])  # 0.82: one step into the decay
    assert opt.param_groups[0]["lr"] == pytest.approx(0.82)
