"""dspark_hf: DSpark speculative decoding for HuggingFace Transformers.

`import dspark_hf` registers the `dspark` model type with `AutoConfig` / `AutoModel` and lets
`target.generate(**inputs, assistant_model=drafter)` use a `DSparkDrafter` (batch size 1). Batches go through
`dspark_hf.generate(target, drafter, ...)` (or `target.generate(..., custom_generate=dspark_hf.speculative_generate,
drafter=drafter)`), with confidence-scheduled verification. `dspark_hf.load_pair(drafter_id_or_folder)` loads a
drafter with the target it records (`dspark_hf.hub`). Training lives in `dspark_hf.training.trainer`, calibration in
`dspark_hf.training.calibration`, evaluation in `dspark_hf.evaluation.evaluate`; real targets in `dspark_hf.testbed.targets`.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModel

from .models.candidate_generator import AssistOptions, DSparkCandidateGenerator, LookupAssistant, SpeculationStats, install_generate_hook
from .models.lookup import LookupProposal, NgramLookup
from .models.prepacked import PrepackedLinear, prepack_linears, unpack_linears
from .models.gqa_attention import restore_attention, use_gqa_attention
from .models.configuration_dspark import DSparkConfig
from .models.drafting import DraftBlock, DSparkContextCache
from .decoding.batched import DSparkGenerateOutput, RowStats, SPSCache, generate, speculative_generate
from .decoding.policy_memory import PolicyMemory
from .training.calibration import expected_calibration_error, fit_sts
from .decoding.scheduler import async_lengths, prefix_survival, schedule_prefix, threshold_lengths
from .decoding.sps import SPSTable, profile_batch1_sps, profile_sps
from .decoding.tree import DraftTree, TreeSpec, draft_tree
from .decoding.tree_attention import check_tree_attention
from .decoding.tree_verification import TreeVerificationResult, tree_verify
from .models.modeling_dspark import DSparkDrafter, DSparkOutput
from .decoding.hf_dflash import dflash_adapter, hf_dflash_generate
from . import convert as _convert  # noqa: F401,E402  (DSparkDrafter.from_pretrained reads foreign formats)
from .convert import convert_checkpoint, detect_format
from .hub import NotCachedError, load_pair  # also installs the drafter's model-card writer
from .decoding.verification import (
    SamplingParams,
    VerificationResult,
    greedy_verify,
    rejection_verify,
    verify,
    warp_logits,
)

__version__ = "0.1.0"

AutoConfig.register("dspark", DSparkConfig, exist_ok=True)
AutoModel.register(DSparkConfig, DSparkDrafter, exist_ok=True)
install_generate_hook()

__all__ = [
    "AssistOptions",
    "LookupAssistant",
    "LookupProposal",
    "NgramLookup",
    "PrepackedLinear",
    "prepack_linears",
    "unpack_linears",
    "use_gqa_attention",
    "restore_attention",
    "DSparkGenerateOutput",
    "RowStats",
    "SPSCache",
    "PolicyMemory",
    "SPSTable",
    "async_lengths",
    "expected_calibration_error",
    "fit_sts",
    "convert_checkpoint",
    "detect_format",
    "dflash_adapter",
    "generate",
    "load_pair",
    "NotCachedError",
    "hf_dflash_generate",
    "prefix_survival",
    "profile_batch1_sps",
    "profile_sps",
    "schedule_prefix",
    "speculative_generate",
    "threshold_lengths",
    "DSparkCandidateGenerator",
    "DSparkConfig",
    "DSparkContextCache",
    "DSparkDrafter",
    "DSparkOutput",
    "DraftBlock",
    "DraftTree",
    "TreeSpec",
    "TreeVerificationResult",
    "check_tree_attention",
    "draft_tree",
    "tree_verify",
    "SamplingParams",
    "SpeculationStats",
    "VerificationResult",
    "greedy_verify",
    "rejection_verify",
    "verify",
    "warp_logits",
]
