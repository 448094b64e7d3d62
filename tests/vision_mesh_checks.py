"""Image prompts on a mesh of 8 faked CPU devices, run in a fresh interpreter by
tests/test_vision_mesh.py through :func:`run_part` (``tests.mesh_checks.run_part`` with
``module="tests.vision_mesh_checks"``: the device count is fixed when jax starts).

``python -m tests.vision_mesh_checks vision MODEL_DIR`` prints one JSON object: for each mesh
of :data:`MESHES`, ``Engine.generate``'s and the serving engine's greedy tokens and logprobs for
an image prompt and a text prompt against one device.
"""

from __future__ import annotations

import json
import sys

import jax.numpy as jnp
import numpy as np
from PIL import Image

from dayzero.engine.generate import Engine
from dayzero.engine.image_processing import QwenImageConfig
from dayzero.engine.serving import ServingConfig, ServingEngine
from dayzero.sharding.placement import placement_for
from tests import mesh_checks

MODULE = "tests.vision_mesh_checks"
MESHES = {"tp2ep4": {"tensor": 2, "expert": 4}, "dp4tp2": {"data": 4, "tensor": 2}}
# The tiny tower's 4-pixel patches (tests/test_vision_generate.py): a 40 x 28 image is 20 tokens.
SMALL = dict(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=64 * 64)
NEW = 6


def run_part(part: str, *args: str, **options) -> dict:
    """:func:`tests.mesh_checks.run_part` for a part of this module (same options)."""
    return mesh_checks.run_part(part, *args, module=MODULE, **options)


def _requests(config) -> tuple[list[list[int]], list]:
    """An image prompt (text, vision start, the placeholder, vision end, text) and a text prompt."""
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (28, 40, 3), dtype=np.uint8))
    vc = config.vision
    text = lambda n: rng.integers(0, vc.image_token_id, n).tolist()  # noqa: E731 (below the special tokens)
    with_image = text(5) + [vc.vision_start_token_id, vc.image_token_id, vc.vision_end_token_id] + text(3)
    return [with_image, text(6)], [[image], []]


def _run(engine: Engine, prompts, images) -> dict:
    """Greedy tokens and logprobs of ``Engine.generate`` and of a serving engine."""
    engine.image_config = QwenImageConfig(**SMALL)
    out = engine.generate(prompts, images=images, max_new_tokens=NEW, ignore_eos=True, logprobs=True)
    server = ServingEngine(engine, ServingConfig(slots=2, page_size=8, max_chunk=16, min_chunk=16, max_context=64))
    ids = [server.submit(p, images=im or None, max_new_tokens=NEW, ignore_eos=True, logprobs=True)
           for p, im in zip(prompts, images)]
    for _ in server.stream():
        pass
    served = [server.completion(i) for i in ids]
    return {"tokens": [c.token_ids for c in out], "logprobs": [c.logprobs for c in out],
            "served_tokens": [c.token_ids for c in served], "served_logprobs": [c.logprobs for c in served]}


def _diff(a, b) -> float:
    return max(float(np.max(np.abs(np.subtract(x, y)))) for x, y in zip(a, b))


def part_vision(model_dir: str) -> dict:
    """The converted tiny Qwen3-VL-MoE in ``model_dir`` on each of :data:`MESHES` against one device."""
    from dayzero.convert import load_checkpoint

    config, weights = load_checkpoint(model_dir, dtype=jnp.float32)
    prompts, images = _requests(config)
    ref = _run(Engine(config, weights, kernels="reference"), prompts, images)
    out = {"ref_served_same": ref["served_tokens"] == ref["tokens"]}
    for name, axes in MESHES.items():
        got = _run(Engine(config, weights, kernels="reference", placement=placement_for(axes)), prompts, images)
        out[name] = {"same_tokens": got["tokens"] == ref["tokens"],
                     "logprob_diff": _diff(got["logprobs"], ref["logprobs"]),
                     "served_same_tokens": got["served_tokens"] == ref["tokens"],
                     "served_logprob_diff": _diff(got["served_logprobs"], ref["logprobs"])}
    return out


PARTS = {"vision": part_vision}

if __name__ == "__main__":
    print(json.dumps(PARTS[sys.argv[1]](*sys.argv[2:])))
