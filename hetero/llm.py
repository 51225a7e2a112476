"""The offline API, in the shape vLLM users know:

from hetero import LLM, SamplingParams
llm = LLM("model.gguf", kv_dtype="fp8", max_num_seqs=64)
for out in llm.generate(["Hello", "Bonjour"], SamplingParams(max_tokens=32)):
    print(out.outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from hetero.factory import LaunchConfig
from hetero.launch import build_engine
from hetero.sampling import SamplingParams
from hetero.text_stream import RequestOutput, TextStream


class LLM:
    def __init__(self, model: str | None = None, progress: bool = False, loaded=None, **options):
        launch = LaunchConfig.from_options(**options)
        self.engine = build_engine(model, launch, progress=progress, loaded=loaded)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion, batched; outputs in the order of the prompts."""
        batch = _as_prompt_list(prompts)
        plist = _as_params_list(params, len(batch))
        outputs = {}
        for out in self.stream(batch, plist):
            if out.finished:
                outputs[out.request_id] = out
        return [outputs[k] for k in sorted(outputs, key=lambda r: int(r.split("-")[-1]))]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([self.tokenizer.encode(prompt)], params)[0]

    def stream(self, prompts, params_list) -> Iterator[RequestOutput]:
        """Yield a RequestOutput (cumulative) each time a request makes progress."""
        live: dict[str, tuple[RequestOutput, list[TextStream]]] = {}
        seq_of: dict[str, tuple[str, int]] = {}
        for prompt, p in zip(prompts, params_list):
            rid = f"req-{next(self._ids)}"
            text, ids = self._encode(prompt)
            streams = [TextStream(self.tokenizer, p.for_sequence(i), i) for i in range(p.n)]
            live[rid] = (RequestOutput(rid, text, ids, [s.out for s in streams]), streams)
            for i in range(p.n):
                sid = f"{rid}/{i}"
                self.engine.add_request(sid, ids, streams[i].params)
                seq_of[sid] = (rid, i)
        while self.engine.has_unfinished():
            touched = set()
            for step in self.engine.step():
                rid, i = seq_of[step.request_id]
                stream = live[rid][1][i]
                stream.add(step)
                if stream.stopped_by_string and not step.finished:
                    self.engine.abort(step.request_id)
                live[rid][0].num_cached_tokens = max(
                    live[rid][0].num_cached_tokens, step.num_cached_tokens
                )
                touched.add(rid)
            for rid in touched:
                out, streams = live[rid]
                out.finished = all(s.finished for s in streams)
                yield out

    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special=True)
        return None, [int(t) for t in prompt]


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and isinstance(items[0], int):  # one prompt given as token ids
        return [items]
    return items


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{len(params)} SamplingParams for {n} prompts")
    return params
