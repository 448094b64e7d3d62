"""Peer implementations measured side by side with dayzero in ``dayzero bench``.

HF transformers (fp32, CPU torch) and llama.cpp (through ``llama-cpp-python``), each loaded
once and asked to run the same prompts. Neither is a dependency of dayzero: a peer that is not
installed is a clear error naming what to install.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from dayzero.tools.measure import timed_speeds


class PeerError(ValueError):
    """A peer that cannot run (not installed, or no source checkpoint)."""


def hf_source(arg: str, model_dir: str | None) -> Path:
    """The checkpoint HF loads: SRC as given, or the embedded GGUF for the default model."""
    from dayzero.engine.default_model import default_gguf_path

    if arg != "auto":
        if not Path(arg).exists():
            raise PeerError(f"--vs-hf {arg}: no such file or directory; pass the original checkpoint")
        return Path(arg)
    if model_dir is not None:
        raise PeerError("--vs-hf needs SRC (the original checkpoint) when --model is given")
    return default_gguf_path()


class HFPeer:
    """HF transformers in fp32 on all CPU threads (the model loads at the first measurement)."""

    def __init__(self, src: Path):
        try:
            import torch
            import transformers  # noqa: F401 - checked here so a missing install fails early
        except ImportError:
            raise PeerError("--vs-hf needs transformers and torch: pip install 'dayzero[test]'") from None
        self.src = src
        self._torch = torch
        self._model = None

    def _load(self):
        from transformers import AutoModelForCausalLM

        torch, src = self._torch, self.src
        torch.set_num_threads(os.cpu_count() or 1)
        if src.suffix == ".gguf":
            model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
        return model.eval()

    def measure(self, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict[str, float]:
        """Best-of-``repeats`` TTFT, prefill and decode speed on ``prompts``."""
        return timed_speeds(*self.runner(prompts, new_tokens), new_tokens, repeats)

    def runner(self, prompts: list[list[int]], new_tokens: int) -> tuple:
        """One greedy generation of ``new_tokens`` on ``prompts``: (``run() -> (ttft_s,
        decode_s)``, the prompts it runs)."""
        if self._model is None:
            self._model = self._load()
        torch, model = self._torch, self._model
        ids = torch.tensor(prompts)
        streamer = _TokenClock()

        def run() -> tuple[float, float]:
            streamer.reset()
            with torch.no_grad():
                model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False, streamer=streamer)
            return streamer.first - streamer.start, streamer.last - streamer.first

        return run, prompts


class _TokenClock:
    """An HF generation streamer that only notes when the first and the last new token came."""

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.first = self.last = None
        self._seen_prompt = False

    def put(self, value) -> None:  # called with the prompt first, then with each new token
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        now = time.perf_counter()
        self.first = self.first or now
        self.last = now

    def end(self) -> None:
        pass


class LlamaCppPeer:
    """llama.cpp on a GGUF file, greedy, one sequence, all CPU threads."""

    def __init__(self, gguf: Path):
        try:
            from llama_cpp import Llama
        except ImportError:
            raise PeerError("--vs-llamacpp needs llama-cpp-python: pip install llama-cpp-python") from None
        if not gguf.exists():
            raise PeerError(f"--vs-llamacpp {gguf}: no such file; pass a .gguf file")
        self.gguf = gguf
        self._Llama = Llama
        self._llm = None

    def _new_model(self, n_ctx: int, **options):
        """A llama.cpp context of ``n_ctx`` tokens on all CPU threads (``options``: more Llama arguments)."""
        return self._Llama(model_path=str(self.gguf), n_ctx=n_ctx, n_batch=n_ctx, n_threads=os.cpu_count() or 1,
                           verbose=False, **options)

    def _model(self, n_ctx: int):
        if self._llm is None or self._llm.n_ctx() < n_ctx:
            self._llm = self._new_model(n_ctx)
        return self._llm

    def measure(self, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict[str, float]:
        """Best-of-``repeats`` TTFT, prefill and decode speed on one prompt."""
        return timed_speeds(*self.runner(prompts, new_tokens), new_tokens, repeats)

    def runner(self, prompts: list[list[int]], new_tokens: int) -> tuple:
        """One greedy generation of ``new_tokens`` on the first prompt (llama-cpp-python runs one
        sequence): (``run() -> (ttft_s, decode_s)``, the prompts it runs: that one)."""
        prompt = prompts[0]
        llm = self._model(len(prompt) + new_tokens)

        def run() -> tuple[float, float]:
            llm.reset()
            start = time.perf_counter()
            llm.eval(prompt)
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            first = time.perf_counter()
            for _ in range(new_tokens - 1):
                llm.eval([token])
                token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            return first - start, time.perf_counter() - first

        return run, prompts[:1]

    def sequence_logits(self, ids: list[int]) -> np.ndarray:
        """llama.cpp's logits [n, V] at every position of ``ids`` (one pass, float32)."""
        llm = self._new_model(len(ids), logits_all=True)
        llm.eval(list(ids))
        return np.asarray(llm.scores[: len(ids)], np.float32)
