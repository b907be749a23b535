"""Lookup drafts and the DSpark drafter in one round: one source per round, or spliced per position? An offline answer
from the target's recorded greedy output (issue 14: tau; issue 13: what a two-source tree could add at most).

    python scripts/sim_drafter_lookup.py --out results/drafter_lookup_sim

Reuses `refs.json` of `scripts/sim_lookup_trees.py` (the target's own greedy continuations of the first prompts of
each evaluation set; `--refs`, recorded there when missing). One target forward over each prompt + continuation gives
the drafter's context; the drafter then drafts, at every round start t, its block exactly as `DSparkDrafter.draft`
does at batch 1 (candidate restriction, Markov head, STS-calibrated confidences), except that the head's previous
token is the recorded one. Under greedy verification that is exact wherever it matters: a draft counts only if every
draft before it equals the recorded token, and then the previous token *is* the recorded one. The lookup's pick at
each position (`NgramLookup`'s chain rule: the better-estimated of its corpus and context candidates) is likewise a
function of the recorded prefix. Per round (N drafts verified, all methods alike):

* `lookup`, `drafter`: one source's chain;
* `lookup_by_drafter`: the lookup's chain, except that where its corpus and context candidates disagree the one
  the drafter gives the higher probability is drafted (the drafter as the lookup's arbiter);
* `round_pick`: the source with the larger expected number of accepted drafts (sum of prefix survival; the rule of
  `merge_lookup_drafts`, the batched loop's);
* `splice`: at every depth the token of the source whose *conditional* estimate there is higher (the lookup's
  calibrated estimate against the drafter's confidence), each source continuing from the tokens chosen so far (the
  lookup from the sequence, the drafter's Markov head from the previous token; its backbone does not read them);
* `splice_fit`: the same, but where the sources disagree the choice comes from a table of how often each was right
  in that (lookup-estimate, drafter-confidence) bin, fit on the other half of the continuations (two folds);
* `oracle_round`: the better of the two chains after the fact (the most a two-branch tree of N + N nodes accepts);
* `oracle_splice`: a depth counts if either source drafted the recorded token (the most any per-depth choice can get).

Tau is new tokens per round (accepted drafts + the target's own token). `--scheduled` adds, for `round_pick` and
`splice`, the length chosen on the target's cost curve measured in the same run (`AssistOptions._best_length`, the
batch-1 loop's rule: expected tokens per second), from estimates along the recorded prefix (past the first rejected
draft they are those of the recorded tokens, not of the drafts: an approximation that touches only how many drafts
are verified).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_lookup_trees import SETS, Drafts, cost_curve, record  # noqa: E402

from dspark_hf import DSparkDrafter  # noqa: E402
from dspark_hf.models.candidate_generator import AssistOptions  # noqa: E402
from dspark_hf.provenance import atomic_write_json, atomic_write_text, provenance  # noqa: E402
from dspark_hf.testbed.release import load_release_drafter, resolve_lookup  # noqa: E402
from dspark_hf.testbed.targets import load_target  # noqa: E402
from dspark_hf.training.data import TokenizedExample  # noqa: E402
from dspark_hf.training.features import OnlineFeatures  # noqa: E402

METHODS = ("lookup", "drafter", "lookup_by_drafter", "round_pick", "splice", "splice_fit", "oracle_round",
           "oracle_splice")
BINS = np.array([0.2, 0.4, 0.6, 0.8])  # estimate bins of `splice_fit`'s table (5 x 5)


def fit_choice(data: list[dict], k: int) -> np.ndarray:
    """`[5, 5]` bool: where the two sources disagree, choose the lookup in (lookup-estimate bin, drafter-confidence
    bin) iff it was right there at least as often as the drafter, over every (round start, depth) of `data`."""
    right = np.zeros((2, 5, 5))
    for d in data:
        gen, n = d["gen"], len(d["gen"])
        for t in range(n):
            for j in range(min(k, n - t)):
                q = t + j
                lt, dt = d["l_tok"][q], int(d["d_tok"][t, j])
                if lt < 0 or lt == dt:
                    continue
                b = np.digitize(d["l_est"][q], BINS), np.digitize(float(d["d_conf"][t, j]), BINS)
                right[0][b] += lt == gen[q]
                right[1][b] += dt == gen[q]
    return right[0] >= right[1]


@torch.no_grad()
def drafter_blocks(drafter, features, prompt: list[int], gen: list[int],
                   scored: list[list[int]] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """`[T, K]` draft tokens and confidences of the drafter's block at every round start t (its anchor is the last
    verified token, position len(prompt) + t - 1), the head fed the recorded previous token; with `scored` (per
    position of the continuation, C target ids), also `[T, K, C]` the drafter's log-probabilities of them over its
    whole draft vocabulary at the slot that drafts that position (-inf outside it, or for an id < 0)."""
    seq = prompt + gen
    ex = TokenizedExample(id="r", input_ids=seq, loss_mask=[0] * len(prompt) + [1] * len(gen))
    f = features([ex])
    ids = f.input_ids[0]
    pos = torch.arange(len(prompt) - 1, len(seq) - 1)
    k = drafter.config.block_size
    hidden = drafter(ids[pos][None], pos[None], f.context, context_mask=f.attention_mask.bool(),
                     return_logits=False).hidden_states[0]  # [T, K, d]
    base = drafter.draft_logits(hidden)
    values, cand, rows = drafter.prepare_candidates(base)
    padded = torch.cat([ids, ids.new_full((k,), -1)])
    head, d2t = drafter.markov_head, drafter.d2t
    temps = drafter.config.sts_temperatures
    tokens, confs = [], []
    logp = None
    if scored is not None:
        vocab = drafter.config.vocab_size
        t2d = torch.arange(vocab) if d2t is None else torch.full((vocab,), -1, dtype=torch.long).index_copy(
            0, d2t, torch.arange(len(d2t)))
        c = len(scored[0]) if scored else 0
        wanted = torch.tensor([row for row in scored] + [[-1] * c] * k, dtype=torch.long)  # [len(gen) + K, C]
        logp = torch.full((len(gen), k, c), float("-inf"))
    for j in range(k):
        prev_ids = padded[pos + j].clamp(min=0)  # the anchor, then the recorded tokens (past the end: no match anyway)
        latent, feats, _ = head.step(drafter.to_draft_inputs(prev_ids), hidden[:, j], None)
        if logp is not None:
            full = torch.log_softmax(base[:, j] + head.markov_w2(latent).float(), dim=-1)  # [T, Vd]
            want = wanted[j:j + len(gen)]  # the ids of the position slot j drafts, per round start
            ok = want >= 0
            draft_ids = torch.where(ok, t2d[want.clamp(min=0)], -1)
            ok &= draft_ids >= 0
            logp[:, j] = torch.where(ok, full.gather(1, draft_ids.clamp(min=0)), float("-inf"))
        logits = values[:, j] + head.project_rows(latent, rows[:, j]).float()
        pick = cand[:, j].gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)
        tokens.append(pick if d2t is None else d2t[pick])
        raw = drafter.confidence_head(hidden[:, j], feats).float()
        confs.append(torch.sigmoid(raw / temps[j]) if temps else torch.sigmoid(raw))
    return torch.stack(tokens, 1).numpy(), torch.stack(confs, 1).numpy(), None if logp is None else logp.numpy()


def disagreements(data: list[dict], k: int) -> dict[str, float]:
    """Over every (round start, depth < K) along the recorded prefix where the lookup has a candidate: how often the
    two sources draft different tokens, and then how often each is right and how sure each said it was."""
    n = dis = l_right = d_right = 0
    l_est = d_conf = 0.0
    for d in data:
        gen = d["gen"]
        for t in range(len(gen)):
            for j in range(min(k, len(gen) - t)):
                q, lt, dt = t + j, d["l_tok"][t + j], int(d["d_tok"][t, j])
                if lt < 0:
                    continue
                n += 1
                if lt != dt:
                    dis += 1
                    l_right += lt == gen[q]
                    d_right += dt == gen[q]
                    l_est += d["l_est"][q]
                    d_conf += float(d["d_conf"][t, j])
    dis_ = max(dis, 1)
    return {"drafts": n, "disagree": dis / max(n, 1), "lookup_right": l_right / dis_, "drafter_right": d_right / dis_,
            "lookup_estimate": l_est / dis_, "drafter_confidence": d_conf / dis_}


def lookup_steps(drafts: Drafts, prompt: list[int], gen: list[int]) -> tuple[list[int], list[float], list[int]]:
    """The lookup's pick and its calibrated estimate at every position of the continuation (-1 / 0: none), and the
    other source's differing candidate there (-1: none)."""
    toks, ests, others = [], [], []
    for q in range(len(gen)):
        pick, other = drafts.step(prompt + gen[:q])
        toks.append(-1 if pick is None else pick[0])
        ests.append(0.0 if pick is None else float(pick[1]))
        others.append(-1 if other is None else other[0])
    return toks, ests, others


def lead(ok: list[bool]) -> int:
    n = 0
    for x in ok:
        if not x:
            break
        n += 1
    return n


def replay(gen, l_tok, l_est, d_tok, d_conf, n: int, costs: list[float] | None, table: np.ndarray,
           l_other: list[int] | None = None, logp: np.ndarray | None = None) -> dict[str, float]:
    """Tau per method for one continuation at N drafts per round (and `*_scheduled` with `costs`); `table` is
    `fit_choice`'s, fit on other continuations; `l_other` / `logp` (`lookup_steps`' other candidates, and
    `drafter_blocks`' log-probabilities of [pick, other]) give `lookup_by_drafter` (the lookup alone without them)."""
    k = d_tok.shape[1]
    out = {}
    # the batch-1 loop's own length rule: (1 + sum of survival) / seconds, maximised over the whole curve
    lengths = None if costs is None else AssistOptions(sps=lambda width: 1.0 / costs[width - 1])
    names = list(METHODS) + (["round_pick_scheduled", "splice_fit_scheduled"] if costs else [])
    for m in names:
        t = rounds = 0
        while t < len(gen):
            depth = min(n, len(gen) - t)
            truth = gen[t:t + depth]
            lk = [l_tok[t + j] == truth[j] for j in range(depth)]
            dk = [j < k and int(d_tok[t, j]) == truth[j] for j in range(depth)]
            le = [l_est[t + j] for j in range(depth)]
            de = [float(d_conf[t, j]) if j < k else 0.0 for j in range(depth)]
            ls, ds = np.cumprod(le).tolist(), np.cumprod(de).tolist()
            base = m.removesuffix("_scheduled")
            if base == "lookup":
                a = lead(lk)
            elif base == "lookup_by_drafter":  # where the lookup's sources disagree, the drafter's likelier token
                ok = []
                for j in range(depth):
                    q = t + j
                    other = -1 if l_other is None or j >= k else l_other[q]
                    take_other = other >= 0 and logp[t, j, 1] > logp[t, j, 0]
                    ok.append((other if take_other else l_tok[q]) == truth[j])
                a = lead(ok)
            elif base == "drafter":
                a = lead(dk)
            elif base == "round_pick":
                use_lookup = sum(ls) > sum(ds)
                ok, surv = (lk, ls) if use_lookup else (dk, ds)
                a = lead(ok[:lengths._best_length(surv, exhaustive=True)] if m.endswith("_scheduled") else ok)
            elif base in ("splice", "splice_fit"):
                if base == "splice":  # the lookup's token where its estimate is higher
                    choose = [le[j] > de[j] for j in range(depth)]
                else:  # where the fitted table says the lookup is right more often (or the drafter has no slot)
                    choose = [l_tok[t + j] >= 0 and (j >= k or bool(
                        table[np.digitize(le[j], BINS), np.digitize(de[j], BINS)])) for j in range(depth)]
                ok = [lk[j] if choose[j] else dk[j] for j in range(depth)]
                surv = np.cumprod([le[j] if choose[j] else de[j] for j in range(depth)]).tolist()
                a = lead(ok[:lengths._best_length(surv, exhaustive=True)] if m.endswith("_scheduled") else ok)
            elif base == "oracle_round":
                a = max(lead(lk), lead(dk))
            else:
                a = lead([x or y for x, y in zip(lk, dk)])
            rounds += 1
            t += a + 1
        out[m] = len(gen) / rounds
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--drafter", default="release", help="a drafter folder, or `release` (the shipped one)")
    p.add_argument("--lookup", default="release", help="a lookup table file, or `release` (the shipped one)")
    p.add_argument("--refs", default="results/lookup_tree_sim/refs.json")
    p.add_argument("--prompts", type=int, default=12, help="recorded per set when --refs is missing")
    p.add_argument("--max-new-tokens", type=int, default=128, help="recorded when --refs is missing")
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 7])
    p.add_argument("--scheduled", action="store_true", help="also the lengths the cost curve picks (times the target)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    refs_file = Path(args.refs)
    if refs_file.exists():
        refs = json.loads(refs_file.read_text())
    else:
        refs = record(args.target, args.prompts, args.max_new_tokens)
        atomic_write_text(refs_file, json.dumps(refs))
    target, _ = load_target(args.target)
    drafter = (load_release_drafter(args.target, target) if args.drafter == "release"
               else DSparkDrafter.from_pretrained(args.drafter, target=target)).eval()
    if drafter.markov_head is None or drafter.config.sequential_head != "markov" or not drafter.config.draft_candidates:
        raise SystemExit("this replay implements the Markov head with candidate restriction (the release drafter's)")
    features = OnlineFeatures(target, drafter.config.target_layer_ids)
    drafts = Drafts(resolve_lookup(args.lookup, args.target))
    costs = None
    if args.scheduled:
        curve = cost_curve(args.target, list(range(1, max(args.budgets) + 2)))
        costs = [curve[w] for w in range(1, max(args.budgets) + 2)]
    per: dict[str, dict[str, list[float]]] = {}
    first_hits = {"lookup": 0, "drafter": 0, "either": 0, "positions": 0}
    data = []
    for i, ref in enumerate(refs):
        prompt, gen = ref["prompt"], ref["gen"]
        l_tok, l_est, l_other = lookup_steps(drafts, prompt, gen)
        d_tok, d_conf, logp = drafter_blocks(drafter, features, prompt, gen, [list(x) for x in zip(l_tok, l_other)])
        data.append({"gen": gen, "d_tok": d_tok, "d_conf": d_conf, "l_tok": l_tok, "l_est": l_est,
                     "l_other": l_other, "logp": logp})
        print(f"[{i + 1}/{len(refs)}] {ref['set']} {ref['id']}", file=sys.stderr, flush=True)
    k = drafter.config.block_size
    tables = [fit_choice(data[1::2], k), fit_choice(data[0::2], k)]  # two folds: each continuation's rule from the others
    for i, (ref, d) in enumerate(zip(refs, data)):
        gen, l_tok, l_est, d_tok, d_conf = d["gen"], d["l_tok"], d["l_est"], d["d_tok"], d["d_conf"]
        for q in range(len(gen)):
            lh, dh = l_tok[q] == gen[q], int(d_tok[q, 0]) == gen[q]
            first_hits["lookup"] += lh
            first_hits["drafter"] += dh
            first_hits["either"] += lh or dh
            first_hits["positions"] += 1
        for n in args.budgets:
            for m, v in replay(gen, l_tok, l_est, d_tok, d_conf, n, costs, tables[i % 2], d["l_other"],
                               d["logp"]).items():
                per.setdefault(ref["set"], {}).setdefault(f"{m}@{n}", []).append(v)
    tau = {s: {m: float(np.mean(v)) for m, v in d.items()} for s, d in per.items()}
    cols = list(next(iter(tau.values())))
    macro = {m: float(np.mean([tau[s][m] for s in tau])) for m in cols}
    command = "python scripts/sim_drafter_lookup.py " + " ".join(argv if argv is not None else sys.argv[1:])
    prov = provenance(command=command, threads=torch.get_num_threads())
    hits = {k: v / first_hits["positions"] for k, v in first_hits.items() if k != "positions"}
    split = disagreements(data, k)
    lines = ["# Lookup drafts and the drafter, one source per round or spliced per position (replayed offline, greedy)",
             "", f"Command: `{command}`. {len(refs)} recorded target continuations ({args.refs}); drafter "
             f"`{args.drafter}`, lookup table `{args.lookup}`. Tau = new tokens per round, N drafts verified per round "
             "(`method@N`); no timing except the cost curve of `--scheduled`. Device: " + prov["device"] + ".", "",
             "| set | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for s in SETS:
        if s in tau:
            lines.append(f"| {s} | " + " | ".join(f"{tau[s][m]:.2f}" for m in cols) + " |")
    lines.append("| **macro** | " + " | ".join(f"**{macro[m]:.3f}**" for m in cols) + " |")
    lines += ["", f"Next token drafted right, over all {first_hits['positions']} positions (given the recorded prefix): "
              f"lookup {hits['lookup']:.3f}, drafter's first slot {hits['drafter']:.3f}, either {hits['either']:.3f}.",
              "", f"Where they disagree ({split['disagree']:.1%} of {split['drafts']:,} (round start, depth < {k}) "
              f"pairs with a lookup candidate): the lookup is right {split['lookup_right']:.1%} of the time (its mean "
              f"estimate {split['lookup_estimate']:.2f}), the drafter {split['drafter_right']:.1%} (its mean confidence "
              f"{split['drafter_confidence']:.2f})."]
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"settings": vars(args), "tau": tau, "macro": macro, "first_draft_right": hits, "disagreements": split,
            "costs": costs,
            "provenance": prov}
    atomic_write_json(out / "results.json", data)
    atomic_write_text(out / "results.md", text)
    print(text)
    return data


if __name__ == "__main__":
    main()
