"""vLLM's `POST /v1/chat/completions/batch`: several conversations in one request.

The body is a chat request whose `messages` is a list of conversations; each is rendered and
checked as a chat of its own (`chat_inputs`), all run as one `Generation` (one scheduling
group, so they take turns with other clients' requests), and the answer is one chat completion
with choice i for conversation i and the usage summed. As vLLM's: no streaming, no tools, no
beam search, `n` 1.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagoda.server.chat import (
    ChatInputs,
    chat_choice_of,
    chat_inputs,
    num_logprobs_of,
    reasoning_end,
)
from pagoda.server.errors import bad_request
from pagoda.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    random_id,
)
from pagoda.server.serving import (
    Generation,
    ServerContext,
    TokenNames,
    build_sampling_params,
    check_lora_model,
    shown_logprobs,
)
from pagoda.server.streaming import until_disconnect


class BatchChatCompletionRequest(ChatCompletionRequest):
    """A chat request whose `messages` holds several conversations (vLLM's)."""

    messages: list[list[ChatMessage]] = Field(min_length=1)  # type: ignore[assignment]

    def conversation(self, index: int) -> ChatCompletionRequest:
        """The chat request of conversation `index`: every other field as given."""
        fields: dict[str, Any] = {name: getattr(self, name) for name in ChatCompletionRequest.model_fields}
        return ChatCompletionRequest.model_construct(self.model_fields_set, **{**fields, "messages": self.messages[index]})


def _check_batch(req: BatchChatCompletionRequest) -> None:
    """vLLM's limits of the batch route (400s, its words where it has them)."""
    if req.stream:
        raise bad_request("Batch chat completions do not support streaming. Please set `stream` to False.",
                          "stream")
    if req.tools or req.tool_choice not in (None, "none"):
        raise bad_request("Batch chat completions do not support tools.", "tools")
    if req.use_beam_search:
        raise bad_request("Batch chat completions do not support beam search. Please set `use_beam_search` "
                          "to False.", "use_beam_search")
    if req.n != 1:
        raise bad_request("Batch chat completions do not support `n > 1`. Please set `n` to 1.", "n")
    if any(not conversation for conversation in req.messages):
        raise bad_request("Each conversation needs at least one message.", "messages")


async def create_batch_chat_completion(ctx: ServerContext, req: BatchChatCompletionRequest,
                                       raw: Request) -> Response:
    _check_batch(req)
    check_lora_model(ctx, req.model, False)
    singles = [req.conversation(i) for i in range(len(req.messages))]
    inputs: list[ChatInputs] = [await chat_inputs(ctx, single) for single in singles]
    num_logprobs = num_logprobs_of(singles[0])
    params = [build_sampling_params(ctx, one.fields, len(one.prompt.token_ids), one.max_tokens, num_logprobs)
              for one in inputs]
    gen = await Generation.create(ctx, random_id("chatcmpl"), [one.prompt for one in inputs], params,
                                  inputs[0].structured_param, req.priority, req.user, req.cache_salt,
                                  ctx.lora_for(req.model), reasoning_end(ctx, singles[0]))
    if await until_disconnect(raw, gen.run()) is None:
        return Response(status_code=499)
    names = TokenNames.of_request(ctx, req)
    shown = None if num_logprobs is None else shown_logprobs(req, num_logprobs)
    choices = [chat_choice_of(ctx, i, state, inputs[i], names, shown, bool(req.return_token_ids),
                              req.include_reasoning)
               for i, state in enumerate(gen.choices)]
    response = ChatCompletionResponse(id=gen.response_id, created=gen.created, model=req.model or ctx.model_name,
                                      choices=choices, usage=gen.usage())
    return JSONResponse(response.model_dump())
