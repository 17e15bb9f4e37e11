"""OpenAIServing: OpenAI requests -> engine requests -> OpenAI stream chunks (inside the engine replica).

Every request is produced as a stream of chunk dicts (``chat.completion.chunk`` / ``text_completion``) ending
with a usage chunk (``choices == []``); the ingress forwards them as SSE or merges them into one response.
One chunk may carry several tokens (speculative decoding accepts many per step); usage counts are exact: the
engine's output token ids, never the number of chunks.
"""

from __future__ import annotations

import codecs
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from cluster.controller import EngineController
from cluster.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from configs.sampling import SamplingParams
from flexspec.engine.outputs import RequestOutput
from flexspec.engine.prompt_bound import prompt_length_bound
from flexspec.engine.sequence import TokenLogprob
from flexspec.engine.token_bytes import TokenBytes
from flexspec.errors import FlexspecError, InvalidRequestError, check_context_length, check_prompt_min_tokens

_T = TypeVar("_T")


class OpenAIServing:
    """Formats one replica's engine outputs as OpenAI chunks.

    Args:
        controller: the replica's engine loop.
        tokenizer: the engine's tokenizer (chat template, prompt encoding, token bytes for logprobs).
        model_name: the name echoed in responses.
        max_model_len: context limit used for default ``max_tokens`` and the 400 on overflow.

    A prompt text too long to fit whatever its tokens (``flexspec.engine.prompt_bound``) gets that 400 before it
    is tokenized.
    """

    def __init__(
        self, controller: EngineController, tokenizer: Any, model_name: str, max_model_len: int
    ) -> None:
        self.controller = controller
        self.tokenizer = tokenizer
        self.token_bytes = TokenBytes(tokenizer)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.length_bound = prompt_length_bound(tokenizer)  # None: no early length check

    # ---- chat -----------------------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest) -> AsyncIterator[dict[str, Any]]:
        req.check_supported()
        engine = self.controller.engine
        text = _user_input(
            "messages",
            lambda: engine.render_chat_template(
                [m.as_template_dict() for m in req.messages],
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
            ),
        )
        # the text the tokenizer gets, so the bound holds for the template's own tokens too
        self._check_text_length(text, "messages")
        prompt = _user_input("messages", lambda: engine.encode(text, add_special_tokens=False))
        jobs = self._jobs(req, [prompt], param="messages")
        head = self._head(f"chatcmpl-{uuid.uuid4().hex}", "chat.completion.chunk")
        for i in range(len(jobs)):  # role first, as OpenAI does
            role = {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            yield head | {"choices": [role]} | self._usage_so_far(req, jobs[i])
        async for index, out in self._run(jobs):
            if not (out.new_text or out.finished or (req.logprobs and out.new_logprobs)):
                continue  # tokens whose text is held back (partial UTF-8 / possible stop string)
            choice: dict[str, Any] = {
                "index": index,
                "delta": {"content": out.new_text} if out.new_text else {},
                "logprobs": None,
                "finish_reason": out.finish_reason,
            }
            if req.logprobs:
                choice["logprobs"] = {"content": [self._chat_logprob(lp) for lp in out.new_logprobs]}
            yield head | {"choices": [choice]} | self._usage_so_far(req, jobs[index])
        yield head | {"choices": [], "usage": self._usage(jobs)}

    def _chat_logprob(self, lp: TokenLogprob) -> dict[str, Any]:
        """OpenAI's entry: ``bytes`` are the token's raw bytes (a part of a multi-byte character included),
        ``token`` its text or ``bytes:\\xNN...`` when those bytes are not valid UTF-8 on their own."""

        def entry(tok: int, value: float) -> dict[str, Any]:
            raw = self.token_bytes.bytes_of(tok)
            return {"token": self.token_bytes.name(tok), "logprob": value, "bytes": list(raw)}

        return entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}

    # ---- completions ----------------------------------------------------------------------------------------
    async def completion(self, req: CompletionRequest) -> AsyncIterator[dict[str, Any]]:
        req.check_supported()
        engine = self.controller.engine
        texts_or_ids = req.prompts()
        for p in texts_or_ids:  # every text before any is tokenized
            if isinstance(p, str):
                self._check_text_length(p, "prompt")
        prompts = [
            _user_input("prompt", lambda p=p: engine.encode(p)) if isinstance(p, str) else list(p)
            for p in texts_or_ids
        ]
        jobs = self._jobs(req, prompts, param="prompt")
        head = self._head(f"cmpl-{uuid.uuid4().hex}", "text_completion")
        # text_offset: characters of the tokens' text completed before each token, so every part of a
        # character split over tokens points at that character
        texts = [codecs.getincrementaldecoder("utf-8")("replace") for _ in jobs]
        offsets = [0] * len(jobs)
        async for index, out in self._run(jobs):
            if not (out.new_text or out.finished or (req.logprobs is not None and out.new_logprobs)):
                continue
            choice: dict[str, Any] = {
                "index": index,
                "text": out.new_text,
                "logprobs": None,
                "finish_reason": out.finish_reason,
            }
            if req.logprobs is not None:
                name = self.token_bytes.name
                text_offset = []
                for lp in out.new_logprobs:
                    text_offset.append(offsets[index])
                    offsets[index] += len(texts[index].decode(self.token_bytes.bytes_of(lp.token_id)))
                choice["logprobs"] = {
                    "tokens": [name(lp.token_id) for lp in out.new_logprobs],
                    "token_logprobs": [lp.logprob for lp in out.new_logprobs],
                    # the chosen token among the alternatives, as OpenAI's legacy API and vLLM give it
                    "top_logprobs": [
                        {name(lp.token_id): lp.logprob} | {name(t): v for t, v in lp.top}
                        for lp in out.new_logprobs
                    ],
                    "text_offset": text_offset,
                }
            yield head | {"choices": [choice]} | self._usage_so_far(req, jobs[index])
        yield head | {"choices": [], "usage": self._usage(jobs)}

    # ---- shared ---------------------------------------------------------------------------------------------
    def _check_text_length(self, text: str, param: str) -> None:
        """The 400 for a text too long to fit whatever its tokens, before the tokenizer spends seconds on it."""
        if self.length_bound is not None:
            min_tokens = self.length_bound.min_num_tokens(text)
            check_prompt_min_tokens(min_tokens, len(text), self.max_model_len, prompt_param=param)

    def _jobs(self, req: SamplingRequest, prompts: list[list[int]], param: str) -> list[_Job]:
        """One engine request per (prompt, choice); index = prompt * n + choice, as OpenAI numbers them."""
        jobs = []
        rid = uuid.uuid4().hex
        for p, ids in enumerate(prompts):
            limit = req.max_output_tokens(len(ids), self.max_model_len)
            check_context_length(len(ids), limit, self.max_model_len, prompt_param=param)
            for c in range(req.n):
                index = p * req.n + c
                jobs.append(_Job(f"{rid}-{index}", index, p, ids, req.sampling_params(limit, c)))
        return jobs

    async def _run(self, jobs: list[_Job]) -> AsyncIterator[tuple[int, RequestOutput]]:
        by_id = {j.request_id: j for j in jobs}
        gen = self.controller.generate([(j.request_id, j.prompt_token_ids, j.params) for j in jobs])
        try:
            async for out in gen:
                job = by_id[out.request_id]
                job.num_output_tokens = out.num_output_tokens
                yield job.index, out
        finally:
            await gen.aclose()  # aborts whatever did not finish (client gone, request cancelled)

    def _usage(self, jobs: list[_Job]) -> dict[str, int]:
        prompt = sum(len(ids) for ids in {j.prompt_index: j.prompt_token_ids for j in jobs}.values())
        completion = sum(j.num_output_tokens for j in jobs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _usage_so_far(self, req: SamplingRequest, job: _Job) -> dict[str, Any]:
        """``{"usage": ...}`` for a chunk of choice ``job`` when the request asked for continuous usage stats
        (its prompt's tokens and its own tokens so far, as vLLM reports them), else ``{}``."""
        return {"usage": self._usage([job])} if req.continuous_usage else {}

    def _head(self, id_: str, obj: str) -> dict[str, Any]:
        return {"id": id_, "object": obj, "created": int(time.time()), "model": self.model_name}


def _user_input(param: str, render: Callable[[], _T]) -> _T:
    """Run the chat template / tokenizer on user text; what they reject (a template's own error, text that
    is not valid Unicode such as a lone surrogate) is a 400 naming ``param``, not a 500."""
    try:
        return render()
    except FlexspecError:
        raise
    except Exception as e:  # jinja2.TemplateError, UnicodeEncodeError, tokenizers' errors
        raise InvalidRequestError(f"{param} could not be rendered: {type(e).__name__}", param=param) from e


class _Job:
    """One engine request of an OpenAI request: choice ``index`` of prompt ``prompt_index``."""

    __slots__ = ("index", "num_output_tokens", "params", "prompt_index", "prompt_token_ids", "request_id")

    def __init__(
        self, request_id: str, index: int, prompt_index: int, ids: list[int], params: SamplingParams
    ):
        self.request_id = request_id
        self.index = index
        self.prompt_index = prompt_index
        self.prompt_token_ids = ids
        self.params = params
        self.num_output_tokens = 0
