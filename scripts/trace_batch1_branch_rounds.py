"""Where lookup-branch rounds go at batch 1, `fixed` vs `scheduled` (issue 13 diagnostic, not a benchmark): per policy,
the rounds of `dspark_hf.generate(target, release drafter, x, lookup=<release table>, tree_budget=0,
tree_max_nodes=4, record_rounds=True)` over 2 HumanEval + 2 GSM-symbolic prompts, 64 new tokens each, summed:
rounds, lookup-only rounds (the drafter gate skipped the drafter), rounds verifying nothing (plain steps), nodes
verified and accepted, tokens emitted per round. Prepacked GQA target, one torch thread.

    OMP_NUM_THREADS=1 python scripts/trace_batch1_branch_rounds.py
"""

import collections

import torch

from dspark_hf.decoding.batched import SPSCache, generate
from dspark_hf.evaluation.prompt_sets import load_prompt_set
from dspark_hf.models.gqa_attention import use_gqa_attention
from dspark_hf.models.prepacked import prepack_linears
from dspark_hf.testbed.release import load_release_drafter, resolve_lookup
from dspark_hf.testbed.targets import load_target
from dspark_hf.training.data import chat_prompt_ids


def main() -> None:
    torch.set_num_threads(1)
    target, tok = load_target("smollm2-135m-instruct")
    prepack_linears(target)
    use_gqa_attention(target)
    drafter = load_release_drafter("smollm2-135m-instruct", target).eval()
    table = resolve_lookup("release", "smollm2-135m-instruct")
    cache = SPSCache()
    prompts = [chat_prompt_ids(tok, it.messages) for s in ("humaneval", "gsm_symbolic")
               for it in load_prompt_set(s, limit=2)]
    for policy in ("fixed", "scheduled"):
        extra = {"sps": cache} if policy == "scheduled" else {}
        agg = collections.Counter()
        for p in prompts:
            x = torch.tensor([p])
            out = generate(target, drafter, x, attention_mask=torch.ones_like(x), max_new_tokens=64, do_sample=False,
                           lookup=table, tree_budget=0, tree_max_nodes=4, policy=policy, record_rounds=True,
                           return_dict_in_generate=True, **extra)
            agg["rounds"] += out.stats[0].rounds
            agg["tokens"] += int(out.num_generated[0])
            for r in out.rounds:
                agg["records"] += 1
                agg["lookup_only"] += int(r.lookup_only)
                agg["drafter_ran"] += int(r.drafts is not None and not r.lookup_only)
                tv = r.tree_verified if r.tree_verified is not None else r.lengths
                agg["verified"] += int(tv.sum())
                agg["zero_verified"] += int((tv == 0).sum())
                ta = r.tree_accepted if r.tree_accepted is not None else r.accepted
                agg["accepted"] += int(ta.sum())
        print(policy, dict(agg), "tokens/round %.2f" % (agg["tokens"] / max(1, agg["records"])), flush=True)


if __name__ == "__main__":
    main()
