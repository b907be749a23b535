"""DSpark speculative decoding as a transformers `custom_generate` recipe: this drafter folder's own
`custom_generate/generate.py`, so that a target runs it with nothing but transformers installed::

    target = AutoModelForCausalLM.from_pretrained(target_id)
    out = target.generate(**inputs, custom_generate="org/this-drafter", trust_remote_code=True,  # or a local folder
                          max_new_tokens=128, do_sample=False)                                   # any batch size

transformers loads this file from the repo (or folder) named by `custom_generate` and calls `generate(model=target,
**the generate() arguments)`. It loads the drafter from that same repo (`drafter=` names another repo / folder, or
passes a loaded drafter), in the target's dtype on the device of its input embedding, binds it (fingerprint checked)
and runs the batched loop of dspark_hf through `target.generate(custom_generate=speculative_generate, ...)`: the same
arguments (`policy`, `sps`, `threshold`, `generator`, `return_dict_in_generate`, `streamer` at batch size 1, ...) and
the same output as `import dspark_hf; target.generate(..., custom_generate=dspark_hf.speculative_generate,
drafter=drafter)`. The loaded drafter is kept on the target for later calls.

The files next to it in `custom_generate/` are copies of dspark_hf's modules (`dspark_hf.hub.remote_code` writes them
on `save_pretrained`, with their relative imports flattened), so the recipe needs no `pip install dspark-hf`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ..decoding.batched import speculative_generate
from ..models.modeling_dspark import DSparkDrafter

__all__ = ["generate"]


def _repo_of_this_call() -> str | None:
    """The `custom_generate` repo id / folder this file was loaded from: transformers passes it to no one, so it is
    read from the calling `generate()` frame (transformers calls this function from `GenerationMixin.generate`)."""
    frame = sys._getframe(1)
    for _ in range(8):
        frame = frame.f_back
        if frame is None:
            return None
        source = frame.f_locals.get("custom_generate")
        if frame.f_code.co_name == "generate" and isinstance(source, (str, os.PathLike)):
            return os.fspath(source)
    return None


def _load_drafter(model: Any, source: str, revision: str | None) -> Any:
    embed = model.get_input_embeddings()
    device = embed.weight.device if embed is not None else model.device
    key = (source, revision, str(device), str(model.dtype))
    loaded = model.__dict__.setdefault("_dspark_custom_generate_drafters", {})  # a plain dict: no submodule
    if key not in loaded:
        drafter = DSparkDrafter.from_pretrained(source, **({"revision": revision} if revision else {}))
        drafter = drafter.to(device=device, dtype=model.dtype).eval()
        try:
            drafter.bind_target(model)
        except ValueError as err:
            raise ValueError(f"the DSpark drafter {source!r} does not fit this target "
                             f"({getattr(model.config, '_name_or_path', '') or type(model).__name__}): {err}") from err
        loaded[key] = drafter
    return loaded[key]


def generate(model: Any, drafter: Any = None, drafter_revision: str | None = None, **kwargs: Any) -> Any:
    """`target.generate(**inputs, custom_generate=<this repo>, trust_remote_code=True, ...)`: DSpark's batched loop
    with the drafter of this repo (or `drafter=`: a repo id, a folder or a loaded `DSparkDrafter`)."""
    if drafter is None or isinstance(drafter, (str, os.PathLike)):
        source = os.fspath(drafter) if drafter is not None else _repo_of_this_call()
        if source is None:
            raise ValueError("could not tell which repo this custom_generate recipe was loaded from; pass "
                             "drafter='org/drafter' (or a folder) to generate()")
        drafter = _load_drafter(model, source, drafter_revision)
    return model.generate(custom_generate=speculative_generate, drafter=drafter, **kwargs)
