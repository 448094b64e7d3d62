"""``Engine.generate`` on the paged cache: how an engine whose run configuration names a kernel
mode generates (its steps attend on the kernels, which read pages), by serving its rows."""

from __future__ import annotations

from typing import Iterator

import numpy as np

from dayzero.engine.generate import Engine
from dayzero.engine.paged_steps import ServingConfig, default_page_size
from dayzero.engine.sampling import SamplingParams
from dayzero.engine.serving import ServingEngine
from dayzero.engine.serving_images import RequestImages


def stream_on_pages(engine: Engine, ids: list[list[int]], max_new_tokens: int, params: list[SamplingParams],
                    images: list | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``Engine.stream_ids`` on the paged cache, the way an engine whose run configuration names a
    kernel mode generates (its steps attend on the kernels): the rows are served concurrently, one
    slot each, and their tokens handed out position by position as every row has produced it.
    ``images``: each row's preprocessed images, its placeholders already expanded in ``ids``."""
    context = max(2, min(max(len(r) for r in ids) + max_new_tokens, engine.config.max_position_embeddings))
    page = default_page_size(engine.config)
    # Room for every row at full length at once: no row waits for pages (each position is handed
    # out only when every row has produced it, so one waiting row would hold back all of them).
    server = ServingEngine(engine, ServingConfig(slots=len(ids), page_size=page, max_context=context,
                                                 num_pages=len(ids) * -(-context // page)))
    requests = []
    for b, (row, p) in enumerate(zip(ids, params)):
        request = server._request(row, max_new_tokens, p, False, True, False)
        if images and images[b]:
            request.images = RequestImages.of(request.prompt, images[b], engine.config.vision.image_token_id)
        requests.append(server._enqueue(request))
    row_of = {request: row for row, request in enumerate(requests)}
    produced: list[list[tuple[int, float]]] = [[] for _ in ids]
    position = 0
    try:
        for event in server.stream():
            produced[row_of[event.request_id]].append((event.token, event.logprob))
            while position < max_new_tokens and all(len(p) > position for p in produced):
                yield (np.array([p[position][0] for p in produced], np.int32),
                       np.array([p[position][1] for p in produced], np.float32))
                position += 1
    finally:  # the engine's compile time includes the paged steps' (``bench`` reports it)
        engine.compile_s += sum(r.steps.compile_s for r in server.replicas)
