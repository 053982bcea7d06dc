"""The offline API, shaped like vLLM's: LLM(model=..., **engine_args).generate / .chat."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch
from tqdm import tqdm

from tqserve.config import EngineArgs
from tqserve.engine.llm_engine import LLMEngine
from tqserve.outputs import RequestOutput
from tqserve.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | dict


class LLM:
    def __init__(self, model: str | None = None, loaded: tuple | None = None, **engine_args) -> None:
        """`loaded`: (model, hf_config, tokenizer) from `tqserve.models.loader.load_model`, to
        share one set of weights between several engines."""
        self.engine = LLMEngine(EngineArgs.from_kwargs(model=model, **engine_args), loaded=loaded)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling_params")
        order = []
        for prompt, sp in zip(prompts, params):
            rid = str(next(self._ids))
            text, ids = self._tokenize(prompt)
            # only finished outputs are read here (`_run`): the engine need not build one every step
            sp = dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
            self.engine.add_request(rid, ids, sp, prompt=text)
            order.append(rid)
        return self._run(order, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [
            {
                "prompt_token_ids": tok.apply_chat_template(
                    c, add_generation_prompt=True, tokenize=True, **(chat_template_kwargs or {})
                )
            }
            for c in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def prompt_logprobs_full(self, token_ids: list[int], include_last: bool = False) -> torch.Tensor:
        """[len-1, vocab] log-softmax of every next-token distribution of a prompt whose next token
        is in the prompt, computed through the engine (prompt attention reads the paged, possibly
        quantized, cache); with `include_last`, [len, vocab]: also the distribution after the prompt."""
        rid = str(next(self._ids))
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs_full=True)
        self.engine.add_request(rid, list(token_ids), params)
        parent = self.engine.processor.parents[rid]
        self._run([rid], False)
        full = torch.cat(parent.prompt_logprobs_full, dim=0)
        return full if include_last else full[:-1]

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.engine.tokenizer.encode(prompt["prompt"])
        raise ValueError("each prompt must be a string or a dict with 'prompt' or 'prompt_token_ids'")

    def _run(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[rid] for rid in order]
