"""`DSparkTrainer`: trains a drafter on target-regenerated data (paper 3.3), on accelerate.

* CPU or one GPU by default; DDP / FSDP through `accelerate launch dspark-hf train ...` (each process takes its slice
  of every global batch); fp32 or bf16 autocast; gradient accumulation; linear warmup then cosine decay; gradient
  clipping. Only the drafter's own parameters train: the target, its embedding and LM head stay frozen.
* Deterministic data: the example order of epoch e is a permutation seeded by (seed, e) and the anchors of
  micro-batch g are sampled with a generator seeded by (seed, g, rank). A checkpoint therefore only needs the weights,
  the optimizer and scheduler states and the step to resume exactly.
* Checkpoints `output_dir/checkpoint-XXXXXX/` (a loadable drafter folder + `trainer_state.pt`) are written to a temporary
  folder and renamed; `output_dir/final/` holds the finished drafter; `output_dir/log.jsonl` every loss term,
  accept_rate@k and the expected accepted length from c*.
* The held-out split is a fixed hash of the example id, so it never changes between runs.
"""

from __future__ import annotations

import json
import math
import shutil
import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import torch

from ..models.configuration_dspark import DSparkConfig
from .data import TokenizedExample, read_examples, sample_anchors
from .features import FeatureBatch, FeatureCache, OnlineFeatures, build_feature_cache
from .losses import LossOutput, LossWeights, dspark_loss
from ..models.modeling_dspark import DSparkDrafter
from ..provenance import atomic_write_json, provenance
from .config import DSparkTrainingConfig


def is_heldout(example_id: str, fraction: float) -> bool:
    """A fixed, id-based split: the same examples are held out in every run."""
    return fraction > 0 and (zlib.crc32(example_id.encode()) % 10_000) < fraction * 10_000


def split_examples(examples: Sequence[TokenizedExample], fraction: float):
    train = [e for e in examples if not is_heldout(e.id, fraction)]
    heldout = [e for e in examples if is_heldout(e.id, fraction)]
    return train, heldout


def build_drafter(config: DSparkTrainingConfig, target) -> DSparkDrafter:
    """A drafter for `target` as the training config describes (or loaded from `init_from`)."""
    if config.init_from:
        return DSparkDrafter.from_pretrained(config.init_from, target=target)
    overrides = dict(
        block_size=config.block_size, num_hidden_layers=config.num_hidden_layers,
        sequential_head=config.sequential_head, markov_rank=config.markov_rank,
        confidence_head=config.confidence_head, loss_decay=config.loss_decay,
        draft_candidates=config.draft_candidates,
    )
    if config.intermediate_size:
        overrides["intermediate_size"] = config.intermediate_size
    if config.target_layer_ids:
        overrides["target_layer_ids"] = list(config.target_layer_ids)
    drafter = DSparkDrafter.from_target(target, **overrides)
    return drafter.float() if config.mixed_precision == "no" else drafter


class DSparkTrainer:
    """Trains `drafter` on `examples` against `target` (see module docstring)."""

    def __init__(self, config: DSparkTrainingConfig, target, examples: Sequence[TokenizedExample],
                 drafter: DSparkDrafter | None = None, accelerator=None, progress: bool = True) -> None:
        from accelerate import Accelerator

        self.config = config
        self.accelerator = accelerator or Accelerator(
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            mixed_precision=config.mixed_precision, cpu=not torch.cuda.is_available(),
        )
        self.target = target.eval().requires_grad_(False)
        self.drafter = drafter if drafter is not None else build_drafter(config, target)
        self.drafter.check_target(target)
        self.train_examples, self.heldout = split_examples(examples, config.heldout_fraction)
        if not self.train_examples:
            raise ValueError("no training examples left after the held-out split")
        self.progress = progress
        self.output_dir = Path(config.output_dir)
        self.weights = LossWeights(ce=config.alpha_ce, tv=config.alpha_tv, conf=config.alpha_conf,
                                   decay=self.drafter.config.effective_loss_decay)
        layer_ids = self.drafter.config.target_layer_ids
        if config.feature_cache:
            with self.accelerator.autocast():  # bf16 mixed precision also speeds up the one pass of the target
                build_feature_cache(target, self.train_examples, config.feature_cache, layer_ids,
                                    max_length=config.max_length, dtype=getattr(torch, config.feature_cache_dtype),
                                    progress=progress)
            self.features = FeatureCache(config.feature_cache, target, layer_ids, max_shards_in_memory=None)
        else:
            self.features = OnlineFeatures(target, layer_ids)
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay,
                                           betas=(0.9, 0.95))
        from transformers import get_cosine_schedule_with_warmup

        self.scheduler = get_cosine_schedule_with_warmup(self.optimizer, config.warmup_steps, config.max_steps)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(self.drafter, self.optimizer,
                                                                              self.scheduler)
        self.step = 0

    # ------------------------------------------------------------------ data
    def micro_batch(self, index: int) -> list[TokenizedExample]:
        """The examples of global micro-batch `index` for this process (deterministic)."""
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        per = self.config.batch_size * world
        n = len(self.train_examples)
        out = []
        for j in range(per * index, per * (index + 1)):
            epoch, pos = divmod(j, n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.config.seed * 100_003 + epoch))
            out.append(self.train_examples[int(perm[pos])])
        return out[rank::world]

    def blocks(self, feats: FeatureBatch, index: int) -> dict[str, torch.Tensor]:
        """Samples anchors per sequence and gathers their labels: anchor ids/positions `[B, A]`, valid `[B, A]`,
        labels and label mask `[B, A, K]`."""
        k = self.drafter.config.block_size
        gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + index * 7_919
                                            + self.accelerator.process_index)
        per_seq = []
        for i in range(feats.input_ids.shape[0]):
            length = int(feats.attention_mask[i].sum())
            per_seq.append(sample_anchors(feats.loss_mask[i, :length], self.config.num_anchors, k, gen))
        a = max(1, max(len(p[0]) for p in per_seq))
        b = len(per_seq)
        pos = torch.zeros(b, a, dtype=torch.long)
        valid = torch.zeros(b, a, dtype=torch.bool)
        label_mask = torch.zeros(b, a, k, dtype=torch.bool)
        for i, (anchors, lm) in enumerate(per_seq):
            pos[i, : len(anchors)] = anchors
            valid[i, : len(anchors)] = True
            label_mask[i, : len(anchors)] = lm
        t = feats.input_ids.shape[1]
        label_pos = (pos[..., None] + 1 + torch.arange(k)).clamp(max=t - 1)
        labels = feats.input_ids.gather(1, label_pos.reshape(b, -1)).reshape(b, a, k)
        anchor_ids = feats.input_ids.gather(1, pos)
        return {"anchor_ids": anchor_ids, "anchor_pos": pos, "valid": valid, "labels": labels,
                "label_mask": label_mask & valid[..., None]}

    # ------------------------------------------------------------------ step
    def compute_loss(self, examples: Sequence[TokenizedExample], index: int) -> LossOutput:
        feats = self.features(examples, self.config.max_length)
        blk = self.blocks(feats, index)
        device = self.accelerator.device
        drafter = self.accelerator.unwrap_model(self.model)
        k = drafter.config.block_size
        out = self.model(blk["anchor_ids"].to(device), blk["anchor_pos"].to(device), feats.context.to(device),
                         context_mask=feats.attention_mask.bool().to(device), return_logits=False)
        sel = blk["valid"].to(device)
        hidden = out.hidden_states[sel]  # [N, K, d]
        labels = blk["labels"].to(device)[sel]
        mask = blk["label_mask"].to(device)[sel]
        anchors = blk["anchor_ids"].to(device)[sel]
        logits = drafter.lm_head(hidden).float()
        prev = torch.cat([anchors[:, None], labels[:, :-1]], dim=1)  # teacher forcing: [anchor, ground truth]
        features = None
        if drafter.markov_head is not None:
            bias, features = drafter.markov_head.teacher_forced(prev, hidden)
            logits = logits + bias.float()
        conf_logits = drafter.confidence_head(hidden, features) if drafter.confidence_head is not None else None
        with torch.no_grad():
            b_idx = sel.nonzero()[:, 0]
            t = feats.final_hidden.shape[1]
            tpos = (blk["anchor_pos"].to(device)[sel][:, None] + torch.arange(k, device=device)).clamp(max=t - 1)
            final = feats.final_hidden.to(device)[b_idx[:, None], tpos]  # [N, K, d]: predicts the label at p+k+1
            target_logits = drafter.lm_head(final.to(drafter.dtype)).float()
        return dspark_loss(logits, target_logits, labels, mask, conf_logits, self.weights)

    # ------------------------------------------------------------------ checkpoints
    def checkpoints(self) -> list[Path]:
        return sorted(self.output_dir.glob("checkpoint-[0-9]*"))

    def save_checkpoint(self) -> Path:
        final = self.output_dir / f"checkpoint-{self.step:06d}"
        if not self.accelerator.is_main_process:
            return final
        tmp = self.output_dir / f".tmp-checkpoint-{self.step:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        drafter = self.accelerator.unwrap_model(self.model)
        drafter.save_pretrained(tmp)
        torch.save({"step": self.step, "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "config": asdict(self.config)},
                   tmp / "trainer_state.pt")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in self.checkpoints()[: -self.config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load_checkpoint(self, path: Path) -> None:
        from safetensors.torch import load_file

        state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
        drafter = self.accelerator.unwrap_model(self.model)
        drafter.load_state_dict(load_file(path / "model.safetensors"), strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])

    # ------------------------------------------------------------------ loop
    def train(self) -> Path:
        cfg = self.config
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if cfg.resume and self.checkpoints():
            self.load_checkpoint(self.checkpoints()[-1])
        atomic_write_json(self.output_dir / "training_config.json",
                          {"config": asdict(cfg), "provenance": provenance(self.accelerator.device),
                           "train_examples": len(self.train_examples), "heldout_examples": len(self.heldout)})
        bar = None
        if self.progress and self.accelerator.is_main_process:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.max_steps, initial=self.step, desc="training drafter", unit="step")
        self.model.train()
        log_path = self.output_dir / "log.jsonl"
        while self.step < cfg.max_steps:
            for micro in range(cfg.gradient_accumulation_steps):
                index = self.step * cfg.gradient_accumulation_steps + micro
                with self.accelerator.accumulate(self.model), self.accelerator.autocast():
                    out = self.compute_loss(self.micro_batch(index), index)
                    self.accelerator.backward(out.total)
                    if self.accelerator.sync_gradients and cfg.max_grad_norm > 0:
                        self.accelerator.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                    self.optimizer.step()
                    self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            if not math.isfinite(float(out.total.detach())):
                raise FloatingPointError(f"loss became {float(out.total.detach())} at step {self.step}; lower the learning rate")
            if self.step % cfg.log_every == 0 or self.step == cfg.max_steps:
                record = {"step": self.step, "lr": self.scheduler.get_last_lr()[0], **out.as_dict()}
                if self.accelerator.is_main_process:
                    with open(log_path, "a") as handle:
                        handle.write(json.dumps(record) + "\n")
                if bar is not None:
                    bar.set_postfix(loss=f"{record['loss']:.3f}", tau=f"{record['expected_tau']:.2f}")
            if bar is not None:
                bar.update(1)
            if self.step % cfg.save_every == 0 or self.step == cfg.max_steps:
                self.accelerator.wait_for_everyone()
                self.save_checkpoint()
        if bar is not None:
            bar.close()
        final = self.output_dir / "final"
        if self.accelerator.is_main_process:
            tmp = self.output_dir / ".tmp-final"
            shutil.rmtree(tmp, ignore_errors=True)
            self.accelerator.unwrap_model(self.model).save_pretrained(tmp)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
        return final


def train_from_config(config: DSparkTrainingConfig, progress: bool = True) -> Path:
    """Loads the target and the data named in `config` and trains (what `dspark-hf train` runs)."""
    from ..testbed.targets import load_target

    target, _ = load_target(config.target)
    examples = read_examples(config.data_dir)
    trainer = DSparkTrainer(config, target, examples, progress=progress)
    return trainer.train()
